"""Top-k routing: router logits -> (routing weights, expert ids).

Plain PyTorch ops on any device: the work is O(T·E), tiny next to the expert GEMMs, and autograd flows
through it, which is how the router logits get their gradient from the routing-weight gradient.
"""

import torch

SCORING_FUNCTIONS = ("softmax", "sigmoid")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str):
    """Scores in float32 (float64 stays float64), top-k, optional renormalisation to sum 1.

    Returns ``(topk_weights, topk_ids)``: float32 (or float64) ``(T, top_k)`` and int64 ``(T, top_k)``,
    each row ordered by decreasing score (ties broken as ``torch.topk`` does).
    """
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
