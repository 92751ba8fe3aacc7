"""What our fused MoE takes of a vLLM MoE layer, without vLLM: the layer's settings it accepts and the weight checks,
on ``integrations/engine_moe.py`` (``integrations/vllm/moe.py`` reads them off vLLM's objects and calls these).

vLLM routes (its router gives ``topk_weights`` (T, k) float32 and ``topk_ids`` (T, k) int32 after grouped top-k,
renormalisation, the scoring function, ``e_score_correction_bias`` and the routed scaling), and its MoE runner adds
the shared experts and all-reduces across tensor-parallel ranks. Ours runs what is left on vLLM's own weights
(``w13_weight`` (E, 2F, d), gate rows first, and ``w2_weight`` (E, d, F): ``fused_experts``' layout). A setting that
would change that product (another activation, biases, expert parallelism, ...) is refused with one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmoe_science.integrations import engine_moe
from flashmoe_science.integrations.vllm.switches import MOE_SWITCH

SWITCH = engine_moe.Switch(MOE_SWITCH, "vLLM")
# vLLM's KernelConfig.moe_backend values that leave the unquantized kernel to the method ("humming" is for
# quantized layers: vLLM runs unquantized ones as "auto")
MOE_BACKENDS = ("auto", "humming")
EP_HINT = "run without --enable-expert-parallel"


@dataclass(frozen=True)
class LayerSettings:
    """A vLLM MoE layer's settings that decide whether our kernel computes what vLLM's would (vLLM's
    ``FusedMoEConfig`` and its ``FusedMoEParallelConfig``, and the platform)."""

    activation: str  # MoEActivation.value
    in_dtype: torch.dtype
    num_experts: int  # global
    num_local_experts: int
    tp_size: int = 1
    dp_size: int = 1
    pcp_size: int = 1
    ep_size: int = 1
    use_ep: bool = False
    sequence_parallel: bool = False
    enable_eplb: bool = False
    has_bias: bool = False
    lora: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    swiglu_beta: float | None = None
    moe_backend: str = "auto"
    cuda: bool = True  # vLLM's current_platform.is_cuda()


def refusal(settings: LayerSettings) -> str | None:
    """Why our kernel cannot run this layer as vLLM would (one phrase naming the setting), or None."""
    s = settings
    reason = engine_moe.expert_refusal(
        "vLLM", cuda=s.cuda, activation=s.activation, in_dtype=s.in_dtype, num_experts=s.num_experts,
        num_local_experts=s.num_local_experts, ep_hint=EP_HINT, has_bias=s.has_bias, ep_size=s.ep_size,
        use_ep=s.use_ep, lora=s.lora,
        swiglu_options=dict(swiglu_limit=s.swiglu_limit, swiglu_alpha=s.swiglu_alpha, swiglu_beta=s.swiglu_beta))
    if reason is not None:
        return reason
    if s.enable_eplb:
        return "enable_eplb=True: expert load balancing needs expert parallelism"
    if s.dp_size > 1 or s.pcp_size > 1 or s.sequence_parallel:
        return (f"data_parallel_size={s.dp_size}, prefill_context_parallel_size={s.pcp_size}, "
                f"sequence-parallel MoE={s.sequence_parallel}: the switch runs tensor parallelism only")
    if s.moe_backend not in MOE_BACKENDS:
        return f"moe_backend={s.moe_backend!r} asks for one of vLLM's kernels"
    return None


def check_settings(settings: LayerSettings) -> None:
    """ValueError (``SWITCH.refused``) where our kernel cannot run the layer."""
    SWITCH.check(refusal(settings))


def check_layer(w13, w2, *, expert_map=None, **layer) -> None:
    """vLLM's layer as loaded: no expert map, then ``engine_moe.check_layer`` (``layer``: its keyword arguments)."""
    if expert_map is not None:
        raise SWITCH.refused(f"the layer has an expert_map (expert parallelism): {EP_HINT}")
    engine_moe.check_layer(SWITCH, w13, w2, **layer)


def check_plan(w13, w2, top_k: int) -> str:
    """``engine_moe.check_plan`` with vLLM's switch in its error."""
    return engine_moe.check_plan(SWITCH, w13, w2, top_k)


# vLLM's router applies the routed scaling factor: the experts' call takes none
run_experts = engine_moe.run_experts
