"""Top-k routing: router logits -> (routing weights, expert ids).

``route_reference`` is plain PyTorch on any device: autograd flows through it, which is how the router logits
get their gradient from the routing-weight gradient. ``route`` takes one Triton launch each way instead on CUDA
(``triton_routing``), where the reference's ten small kernels and autograd nodes cost more host time than the
expert GEMMs of a few-token layer.
"""

import torch

SCORING_FUNCTIONS = ("softmax", "sigmoid")
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str):
    """Scores in float32 (float64 stays float64), top-k, optional renormalisation to sum 1.

    Returns ``(topk_weights, topk_ids)``: float32 (or float64) ``(T, top_k)`` and int64 ``(T, top_k)``,
    each row ordered by decreasing score (equal scores: the lower expert id first).
    """
    if routes_in_triton(router_logits):
        from flashmoe_science.moe import triton_routing

        return triton_routing.RouteTriton.apply(router_logits, top_k, renormalize, scoring == "sigmoid")
    return route_reference(router_logits, top_k, renormalize, scoring)


def routes_in_triton(router_logits: torch.Tensor) -> bool:
    """Whether ``route`` takes the Triton launches for these logits (CUDA, a kernel dtype, at most MAX_EXPERTS)."""
    if not (router_logits.is_cuda and router_logits.dtype in _TRITON_DTYPES):
        return False
    from flashmoe_science.moe import triton_routing

    return router_logits.shape[1] <= triton_routing.MAX_EXPERTS


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str):
    """``route`` in PyTorch ops (equal scores are ordered as ``torch.topk`` orders them)."""
    compute_dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    logits = router_logits.to(compute_dtype)
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def route_reference_backward(router_logits: torch.Tensor, topk_ids: torch.Tensor, grad_weights: torch.Tensor,
                             renormalize: bool, scoring: str) -> torch.Tensor:
    """The router logits' gradient from the routing weights' (``route_reference``'s, for the ids it chose), without
    autograd (for callers where it is off, such as a custom op's implementation)."""
    compute_dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    logits = router_logits.to(compute_dtype)
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    grad_selected = grad_weights.to(compute_dtype)
    if renormalize:  # w = s / sum(s): dL/ds_j = (g_j - sum_i g_i w_i) / sum(s)
        selected = scores.gather(1, topk_ids)
        total = selected.sum(dim=-1, keepdim=True)
        grad_selected = (grad_selected - (grad_selected * selected / total).sum(dim=-1, keepdim=True)) / total
    grad_scores = torch.zeros_like(scores).scatter_add_(1, topk_ids, grad_selected)
    if scoring == "softmax":
        grad_logits = scores * (grad_scores - (grad_scores * scores).sum(dim=-1, keepdim=True))
    else:
        grad_logits = grad_scores * scores * (1 - scores)
    return grad_logits.to(router_logits.dtype)
