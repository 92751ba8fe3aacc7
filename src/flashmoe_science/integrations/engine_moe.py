"""An inference engine's unquantized MoE layer on our fused MoE: what the vLLM and SGLang plugins share (no engine
import).

The engine routes (top-k, renormalisation, scoring, correction bias) and adds the shared experts and the
tensor-parallel all-reduce; ours runs the routed experts' GEMMs, the SwiGLU between them and the weighted combine,
on the engine's own weights: ``w13`` (E, 2F, d), rows [0:F] the gate and [F:2F] the up projection, and ``w2``
(E, d, F), which is ``fused_experts``' layout (no repacking). A setting that would change that product is refused
with one line naming it (`Switch.refused`); each engine's module (``integrations.vllm.moe_config``,
``integrations.sglang.moe``) reads its layer's settings and passes them to `expert_refusal`, `check_layer`,
`check_plan` and `run_experts`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = (torch.bfloat16, torch.float16)
# the expert call's backend: the Triton kernels or an error, never the PyTorch reference (it reads routing ids on
# the host, which a CUDA graph cannot capture)
BACKEND = "triton"
# tokens of the plan checked at weight processing (more than the decode kernel takes: the grouped GEMMs' plan)
PLAN_TOKENS = 256
INPUT_WEIGHTS = "apply_router_weight_on_input=True: the kernel weights the experts' outputs, not their inputs"


@dataclass(frozen=True)
class Switch:
    """An engine's opt-in environment variable and the engine whose MoE kernels it replaces (the errors name both)."""

    variable: str
    engine: str

    def refused(self, reason: str) -> ValueError:
        """The error of a refused layer: the reason and what to do."""
        return ValueError(f"{self.variable}=1: our fused MoE cannot run this MoE layer: {reason}. "
                          f"Unset {self.variable} to run {self.engine}'s own MoE kernels.")

    def check(self, reason: str | None) -> None:
        """ValueError (`refused`) unless ``reason`` is None."""
        if reason is not None:
            raise self.refused(reason)


def expert_refusal(engine: str, *, cuda: bool, activation: str, in_dtype: torch.dtype, num_experts: int,
                   num_local_experts: int, ep_hint: str, gated: bool = True, swiglu_options: dict | None = None,
                   has_bias: bool = False, bias_setting: str = "has_bias", ep_size: int = 1, use_ep: bool = False,
                   lora: bool = False, apply_router_weight_on_input: bool = False) -> str | None:
    """Why our kernel cannot run a layer with these settings as ``engine`` would (one phrase naming the first such
    setting), or None. ``swiglu_options``: the engine's clamps and scales of the SwiGLU by its names (any not None
    is refused); ``ep_hint``: how to run without expert parallelism there."""
    if not cuda:
        return "the platform is not CUDA (the kernels are Triton on NVIDIA GPUs)"
    if activation != "silu" or not gated:
        return (f"activation={activation!r}{'' if gated else ', is_gated=False'}: the kernel computes SwiGLU "
                f"({engine}'s 'silu' with gate rows first) only")
    options = swiglu_options or {}
    if any(value is not None for value in options.values()):
        return (", ".join(f"{name}={value}" for name, value in options.items())
                + ": the kernel's SwiGLU has no clamp or scaling")
    if has_bias:
        return f"{bias_setting}=True: the kernel's expert GEMMs have no biases"
    if in_dtype not in DTYPES:
        return f"dtype={in_dtype}: the switch runs bfloat16 and float16 models"
    if use_ep or ep_size > 1 or num_local_experts != num_experts:
        return (f"expert parallelism (ep_size={ep_size}, {num_local_experts} of {num_experts} experts on this rank): "
                f"{ep_hint}")
    if lora:
        return f"LoRA is enabled: {engine}'s MoE LoRA needs its own kernels"
    if apply_router_weight_on_input:
        return INPUT_WEIGHTS
    return None


def check_layer(switch: Switch, w13, w2, *, num_experts: int, hidden_size: int, intermediate_size: int,
                in_dtype: torch.dtype, apply_router_weight_on_input: bool = False) -> None:
    """The layer as loaded: the router weights on the output, and ``w13`` (E, 2F, d), ``w2`` (E, d, F) unquantized
    in the model's dtype (F: the intermediate size of this tensor-parallel rank)."""
    if apply_router_weight_on_input:
        raise switch.refused(INPUT_WEIGHTS)
    for name, weight, shape in (("w13_weight", w13, (num_experts, 2 * intermediate_size, hidden_size)),
                                ("w2_weight", w2, (num_experts, hidden_size, intermediate_size))):
        if not isinstance(weight, torch.Tensor) or weight.dtype != in_dtype:
            dtype = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise switch.refused(f"{name} is {dtype}, not the model's {in_dtype} (a quantized or converted weight)")
        if tuple(weight.shape) != shape:
            raise switch.refused(f"{name} has shape {tuple(weight.shape)}, expected {shape}")


def check_plan(switch: Switch, w13, w2, top_k: int) -> str:
    """The kernels' plan for this layer's weights (``describe_moe``), which raises where the Triton kernels cannot
    take them: at weight processing rather than at the first forward."""
    from flashmoe_science.moe.api import describe_moe

    x = torch.empty((PLAN_TOKENS, w13.shape[2]), dtype=w13.dtype, device=w13.device)
    try:
        return describe_moe(x, w13, w2, top_k, backend=BACKEND, training=False)
    except ValueError as error:
        raise switch.refused(str(error)) from error


def run_experts(x, w13, w2, topk_weights, topk_ids, routed_scaling_factor: float | None = None,
                backend: str | None = None):
    """The routed experts' output (T, d) in x's dtype: ``s * sum_j topk_weights[t, j] * SwiGLU expert
    topk_ids[t, j]`` of ``x[t]`` (ids outside [0, E) add nothing), with ``s`` the routed scaling factor where the
    engine leaves it to the experts (None: 1). ``backend``: default ``BACKEND``."""
    from flashmoe_science.moe.api import fused_experts

    if routed_scaling_factor is not None and routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor  # (T, k): cheaper than scaling the (T, d) output
    return fused_experts(x, w13, w2, topk_weights, topk_ids, backend=backend or BACKEND)
