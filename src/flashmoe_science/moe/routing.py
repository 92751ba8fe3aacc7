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
    if router_logits.is_cuda and router_logits.dtype in _TRITON_DTYPES:
        from flashmoe_science.moe import triton_routing

        if router_logits.shape[1] <= triton_routing.MAX_EXPERTS:
            return triton_routing.RouteTriton.apply(router_logits, top_k, renormalize, scoring == "sigmoid")
    return route_reference(router_logits, top_k, renormalize, scoring)


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
