"""What our fused MoE takes of a vLLM MoE layer, without vLLM: the layer's settings it accepts, the weight checks,
and the expert call (``integrations/vllm/moe.py`` reads them off vLLM's objects and calls these).

vLLM routes (its router gives ``topk_weights`` (T, k) float32 and ``topk_ids`` (T, k) int32 after grouped top-k,
renormalisation, the scoring function, ``e_score_correction_bias`` and the routed scaling), and its MoE runner adds
the shared experts and all-reduces across tensor-parallel ranks. Ours runs what is left, the routed experts' GEMMs
and their weighted combine, on vLLM's own weights: ``w13_weight`` (E, 2F, d), rows [0:F] the gate and [F:2F] the up
projection, and ``w2_weight`` (E, d, F), which is ``fused_experts``' layout (no repacking). A setting that would
change that product (another activation, biases, expert parallelism, ...) is refused with one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmoe_science.integrations.vllm.switches import MOE_SWITCH

# vLLM's MoEActivation values that are our SwiGLU: silu(x @ gate.T) * (x @ up.T), gate rows first.
ACTIVATIONS = {"silu": "SwiGLU"}
DTYPES = (torch.bfloat16, torch.float16)
# vLLM's KernelConfig.moe_backend values that leave the unquantized kernel to the method ("humming" is for
# quantized layers: vLLM runs unquantized ones as "auto")
MOE_BACKENDS = ("auto", "humming")
# the expert call's backend: the Triton kernels or an error, never the PyTorch reference (it reads routing ids on
# the host, which a CUDA graph cannot capture)
BACKEND = "triton"
# tokens of the plan checked at weight processing (more than the decode kernel takes: the grouped GEMMs' plan)
PLAN_TOKENS = 256


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
    if not s.cuda:
        return "the platform is not CUDA (the kernels are Triton on NVIDIA GPUs)"
    if s.activation not in ACTIVATIONS:
        return (f"activation={s.activation!r}: the kernel computes SwiGLU (vLLM's 'silu' with gate rows first) "
                "only")
    if s.swiglu_limit is not None or s.swiglu_alpha is not None or s.swiglu_beta is not None:
        return (f"swiglu_limit={s.swiglu_limit}, swiglu_alpha={s.swiglu_alpha}, swiglu_beta={s.swiglu_beta}: the "
                "kernel's SwiGLU has no clamp or scaling")
    if s.has_bias:
        return "has_bias=True: the kernel's expert GEMMs have no biases"
    if s.in_dtype not in DTYPES:
        return f"dtype={s.in_dtype}: the switch runs bfloat16 and float16 models"
    if s.use_ep or s.ep_size > 1 or s.num_local_experts != s.num_experts:
        return (f"expert parallelism (ep_size={s.ep_size}, {s.num_local_experts} of {s.num_experts} experts on "
                "this rank): run without --enable-expert-parallel")
    if s.enable_eplb:
        return "enable_eplb=True: expert load balancing needs expert parallelism"
    if s.dp_size > 1 or s.pcp_size > 1 or s.sequence_parallel:
        return (f"data_parallel_size={s.dp_size}, prefill_context_parallel_size={s.pcp_size}, "
                f"sequence-parallel MoE={s.sequence_parallel}: the switch runs tensor parallelism only")
    if s.lora:
        return "LoRA is enabled: vLLM's MoE LoRA needs its own kernels"
    if s.moe_backend not in MOE_BACKENDS:
        return f"moe_backend={s.moe_backend!r} asks for one of vLLM's kernels"
    return None


def refused(reason: str) -> ValueError:
    """The error of a refused layer: the reason and what to do."""
    return ValueError(f"{MOE_SWITCH}=1: our fused MoE cannot run this MoE layer: {reason}. "
                      f"Unset {MOE_SWITCH} to run vLLM's own MoE kernels.")


def check_settings(settings: LayerSettings) -> None:
    """ValueError (``refused``) where our kernel cannot run the layer."""
    reason = refusal(settings)
    if reason is not None:
        raise refused(reason)


def check_layer(w13, w2, *, num_experts: int, hidden_size: int, intermediate_size: int, in_dtype: torch.dtype,
                expert_map=None, apply_router_weight_on_input: bool = False) -> None:
    """The layer as loaded: no expert map, the router weights on the output, and ``w13`` (E, 2F, d), ``w2``
    (E, d, F) unquantized in the model's dtype (F: the intermediate size of this tensor-parallel rank)."""
    if expert_map is not None:
        raise refused("the layer has an expert_map (expert parallelism): run without --enable-expert-parallel")
    if apply_router_weight_on_input:
        raise refused("apply_router_weight_on_input=True: the kernel weights the experts' outputs, not their inputs")
    for name, weight, shape in (("w13_weight", w13, (num_experts, 2 * intermediate_size, hidden_size)),
                                ("w2_weight", w2, (num_experts, hidden_size, intermediate_size))):
        if not isinstance(weight, torch.Tensor) or weight.dtype != in_dtype:
            dtype = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise refused(f"{name} is {dtype}, not the model's {in_dtype} (a quantized or converted weight)")
        if tuple(weight.shape) != shape:
            raise refused(f"{name} has shape {tuple(weight.shape)}, expected {shape}")


def check_plan(w13, w2, top_k: int) -> str:
    """The kernels' plan for this layer's weights (``describe_moe``), which raises where the Triton kernels cannot
    take them: at weight processing rather than at the first forward."""
    from flashmoe_science.moe.api import describe_moe

    x = torch.empty((PLAN_TOKENS, w13.shape[2]), dtype=w13.dtype, device=w13.device)
    try:
        return describe_moe(x, w13, w2, top_k, backend=BACKEND, training=False)
    except ValueError as error:
        raise refused(str(error)) from error


def run_experts(x, w13, w2, topk_weights, topk_ids, backend: str | None = None):
    """The routed experts' output (T, d) in x's dtype: ``sum_j topk_weights[t, j] * SwiGLU expert topk_ids[t, j]``
    of ``x[t]``; what vLLM's unquantized kernel returns for the same routing. ``backend``: default ``BACKEND``."""
    from flashmoe_science.moe.api import fused_experts

    return fused_experts(x, w13, w2, topk_weights, topk_ids, backend=backend or BACKEND)
