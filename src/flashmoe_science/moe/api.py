"""The MoE front doors: ``moe_route``, ``fused_experts``, ``grouped_experts``, ``fused_moe``, and ``describe_moe``.

Each runs on x's device and hands the call to ``moe/execute.py`` (checks, one plan, run); under ``torch.compile``
it goes through the custom ops of ``moe/ops.py`` instead, which call the same layer.
"""

import torch

from flashmoe_science.device import on_another_cuda_device
from flashmoe_science.moe import execute, ops
from flashmoe_science.moe.checks import check_experts, check_top_k
from flashmoe_science.moe.fp8 import Fp8ExpertsProblem, check_fp8_experts, describe_fp8, plan_fp8_experts
from flashmoe_science.moe.plan import ExpertsProblem, describe, plan_experts


def moe_route(router_logits, top_k, renormalize=True, scoring="softmax"):
    """Router logits ``(T, E)`` -> ``(topk_weights, topk_ids)``, both ``(T, top_k)``.

    Scores are ``softmax`` (over all E experts) or ``sigmoid`` of the logits, computed in float32; the top_k best
    experts are kept and, with ``renormalize``, their weights rescaled to sum to 1. Weights are float32 (float64 for
    float64 logits), ids int64. Differentiable with respect to ``router_logits``.
    """
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        return ops.moe_route(router_logits, top_k, renormalize, scoring)
    return execute.route_checked(router_logits, top_k, renormalize, scoring)


def fused_experts(x, w1, w2, topk_weights, topk_ids, *, backend="auto", w1_scale=None, w2_scale=None):
    """SwiGLU experts for already-routed tokens; returns ``(T, d)`` in ``x.dtype``.

    ``x: (T, d)``; ``w1: (E, 2F, d)``, rows ``[0:F]`` the gate and ``[F:2F]`` the up projection; ``w2: (E, d, F)``;
    ``topk_weights: (T, k)`` float; ``topk_ids: (T, k)`` int32/int64, ids outside ``[0, E)`` mark dropped slots.
    ``backend``: ``"auto"`` (Triton on CUDA, else the PyTorch reference), ``"triton"`` or ``"reference"``.
    Differentiable with respect to x, w1, w2 and topk_weights.

    FP8 experts: ``w1``/``w2`` in ``torch.float8_e4m3fn`` with ``w1_scale`` ``(E, ceil(2F/128), ceil(d/128))`` and
    ``w2_scale`` ``(E, ceil(d/128), ceil(F/128))`` float32 (128x128 block scales, ``weight_scale_inv`` of a
    DeepSeek-V3 / Qwen3-FP8 checkpoint; ``moe.fp8.quantize_fp8_weights`` makes them); the activations are
    quantised per 1x128 group inside the kernels (``moe/fp8.py``). Forward only.
    """
    if w1_scale is not None or w2_scale is not None:
        return _fp8_call(execute.experts_fp8, x, x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, backend)
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        if execute.records_grad(x, w1, w2, topk_weights):
            return ops.fused_experts_forward(x, w1, w2, topk_weights, topk_ids, backend)[0]
        return ops.fused_experts_inference(x, w1, w2, topk_weights, topk_ids, backend)
    if on_another_cuda_device(x):
        with torch.cuda.device(x.device):  # Triton launches on the current device: make it x's
            return execute.experts(x, w1, w2, topk_weights, topk_ids, backend)
    return execute.experts(x, w1, w2, topk_weights, topk_ids, backend)


def grouped_experts(x, w1, w2, tokens_per_expert, row_weights=None, *, backend="auto"):
    """SwiGLU experts for rows already grouped by expert (what token dispatchers hand their experts).

    ``x: (R, d)`` with rows ``[c_0 + ... + c_{e-1}, c_0 + ... + c_e)`` for expert e, where ``tokens_per_expert``
    ``(E,)`` holds the counts ``c_e`` in expert order (any integer dtype, on any device: it is copied to x's without
    a synchronisation); rows past the counts' sum (capacity padding) come back as zeros. ``row_weights``: ``(R,)``
    or ``(R, 1)`` float, each row's output is scaled by it (the router's probability), differentiable; None: ones.
    ``w1``, ``w2``, ``backend``: as ``fused_experts``, which runs the rows as one routed slot each (top-k 1).
    """
    if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.dim() != 1 \
            or tokens_per_expert.is_floating_point():
        raise TypeError("tokens_per_expert must be a 1-D integer torch.Tensor of per-expert row counts")
    if tokens_per_expert.shape[0] != w1.shape[0]:
        raise ValueError(f"tokens_per_expert has {tokens_per_expert.shape[0]} counts for {w1.shape[0]} experts")
    offsets = torch.cumsum(tokens_per_expert.to(x.device, non_blocking=True), dim=0)
    rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
    expert_of_row = torch.searchsorted(offsets, rows, right=True)  # == E past the counts: a dropped slot
    if row_weights is None:
        row_weights = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
    elif row_weights.shape not in ((x.shape[0],), (x.shape[0], 1)):
        raise ValueError(f"row_weights must be ({x.shape[0]},) or ({x.shape[0]}, 1), got {tuple(row_weights.shape)}")
    return fused_experts(x, w1, w2, row_weights.reshape(-1, 1), expert_of_row.unsqueeze(1), backend=backend)


def fused_moe(x, w1, w2, router_logits, top_k, *, renormalize=True, scoring="softmax", backend="auto",
              w1_scale=None, w2_scale=None):
    """A whole MoE FFN layer: route ``router_logits`` ``(T, E)`` to ``top_k`` experts, run them, combine.

    Equivalent to ``fused_experts(x, w1, w2, *moe_route(router_logits, top_k, renormalize, scoring))``; gradients
    reach the router logits through the routing weights. FP8 experts: e4m3 ``w1``/``w2`` with their block scales
    ``w1_scale``/``w2_scale``, as ``fused_experts`` takes them (forward only).
    """
    if w1_scale is not None or w2_scale is not None:
        return _fp8_call(execute.moe_fp8, x, x, w1, w1_scale, w2, w2_scale, router_logits, top_k, renormalize,
                         scoring, backend)
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        if execute.records_grad(x, w1, w2, router_logits):
            topk_weights, topk_ids = ops.moe_route(router_logits, top_k, renormalize, scoring)
            return ops.fused_experts_forward(x, w1, w2, topk_weights, topk_ids, backend)[0]
        return ops.fused_moe_inference(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)
    if on_another_cuda_device(x):
        with torch.cuda.device(x.device):  # Triton launches on the current device: make it x's
            return execute.moe(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)
    return execute.moe(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)


@torch.compiler.disable  # a graph break: the custom ops of torch.compile take unquantised experts only
def _fp8_call(entry, x, *args):
    if on_another_cuda_device(x):
        with torch.cuda.device(x.device):  # Triton launches on the current device: make it x's
            return entry(*args)
    return entry(*args)


def describe_moe(x, w1, w2, top_k, *, backend="auto", training=True, w1_scale=None, w2_scale=None) -> str:
    """Which kernels a ``fused_moe``/``fused_experts`` call on these tensors runs, and why each family before them
    declined: the layer's family, then each expert GEMM's kernel and tiles (the backward's too with ``training``,
    the default; without it a few tokens run the one-launch decode kernel). With ``w1_scale``/``w2_scale``: the
    FP8 experts' plan (forward only: ``training`` does not apply)."""
    if w1_scale is not None or w2_scale is not None:
        check_fp8_experts(x, w1, w1_scale, w2, w2_scale)
        check_top_k(top_k, w1.shape[0])
        return describe_fp8(plan_fp8_experts(Fp8ExpertsProblem(x, w1, w1_scale, w2, w2_scale, top_k, backend)))
    check_experts(x, w1, w2)
    check_top_k(top_k, w1.shape[0])
    return describe(plan_experts(ExpertsProblem(x, w1, w2, top_k, backend, training)))
