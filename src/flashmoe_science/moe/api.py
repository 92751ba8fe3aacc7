"""The MoE front doors: ``moe_route``, ``fused_experts``, ``fused_moe``, and ``describe_moe``.

Each runs on x's device and hands the call to ``moe/execute.py`` (checks, one plan, run); under ``torch.compile``
it goes through the custom ops of ``integrations/ops.py`` instead, which call the same layer.
"""

import torch

from flashmoe_science.device import on_another_cuda_device
from flashmoe_science.moe import execute
from flashmoe_science.moe.checks import check_experts, check_top_k
from flashmoe_science.moe.plan import ExpertsProblem, describe, plan_experts


def moe_route(router_logits, top_k, renormalize=True, scoring="softmax"):
    """Router logits ``(T, E)`` -> ``(topk_weights, topk_ids)``, both ``(T, top_k)``.

    Scores are ``softmax`` (over all E experts) or ``sigmoid`` of the logits, computed in float32; the top_k best
    experts are kept and, with ``renormalize``, their weights rescaled to sum to 1. Weights are float32 (float64 for
    float64 logits), ids int64. Differentiable with respect to ``router_logits``.
    """
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        return torch.ops.flashmoe_science.moe_route(router_logits, top_k, renormalize, scoring)
    return execute.route_checked(router_logits, top_k, renormalize, scoring)


def fused_experts(x, w1, w2, topk_weights, topk_ids, *, backend="auto"):
    """SwiGLU experts for already-routed tokens; returns ``(T, d)`` in ``x.dtype``.

    ``x: (T, d)``; ``w1: (E, 2F, d)``, rows ``[0:F]`` the gate and ``[F:2F]`` the up projection; ``w2: (E, d, F)``;
    ``topk_weights: (T, k)`` float; ``topk_ids: (T, k)`` int32/int64, ids outside ``[0, E)`` mark dropped slots.
    ``backend``: ``"auto"`` (Triton on CUDA, else the PyTorch reference), ``"triton"`` or ``"reference"``.
    Differentiable with respect to x, w1, w2 and topk_weights.
    """
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        if execute.records_grad(x, w1, w2, topk_weights):
            return torch.ops.flashmoe_science.fused_experts_forward(x, w1, w2, topk_weights, topk_ids, backend)[0]
        return torch.ops.flashmoe_science.fused_experts_inference(x, w1, w2, topk_weights, topk_ids, backend)
    if on_another_cuda_device(x):
        with torch.cuda.device(x.device):  # Triton launches on the current device: make it x's
            return execute.experts(x, w1, w2, topk_weights, topk_ids, backend)
    return execute.experts(x, w1, w2, topk_weights, topk_ids, backend)


def fused_moe(x, w1, w2, router_logits, top_k, *, renormalize=True, scoring="softmax", backend="auto"):
    """A whole MoE FFN layer: route ``router_logits`` ``(T, E)`` to ``top_k`` experts, run them, combine.

    Equivalent to ``fused_experts(x, w1, w2, *moe_route(router_logits, top_k, renormalize, scoring))``; gradients
    reach the router logits through the routing weights.
    """
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        if execute.records_grad(x, w1, w2, router_logits):
            topk_weights, topk_ids = torch.ops.flashmoe_science.moe_route(router_logits, top_k, renormalize, scoring)
            return torch.ops.flashmoe_science.fused_experts_forward(x, w1, w2, topk_weights, topk_ids, backend)[0]
        return torch.ops.flashmoe_science.fused_moe_inference(x, w1, w2, router_logits, top_k, renormalize, scoring,
                                                              backend)
    if on_another_cuda_device(x):
        with torch.cuda.device(x.device):  # Triton launches on the current device: make it x's
            return execute.moe(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)
    return execute.moe(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)


def describe_moe(x, w1, w2, top_k, *, backend="auto", training=True) -> str:
    """Which kernels a ``fused_moe``/``fused_experts`` call on these tensors runs, and why each family before them
    declined: the layer's family, then each expert GEMM's kernel and tiles (the backward's too with ``training``,
    the default; without it a few tokens run the one-launch decode kernel)."""
    check_experts(x, w1, w2)
    check_top_k(top_k, w1.shape[0])
    return describe(plan_experts(ExpertsProblem(x, w1, w2, top_k, backend, training)))
