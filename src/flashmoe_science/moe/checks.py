"""The MoE front doors' input checks: TypeError/ValueError naming the argument and what was expected.

Everything behind them (the planner, the layer, the kernels) takes already-checked tensors and never validates user
input again.
"""

import torch

from flashmoe_science.moe.routing import SCORING_FUNCTIONS

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name, value, ndim, dtypes=None):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {value.dtype}")


def check_same_device(name, value, x):
    if value.device != x.device:
        raise ValueError(f"{name} is on {value.device} but x is on {x.device}; all tensors must share a device")


def check_top_k(top_k, num_experts):
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def check_routing_options(renormalize, scoring):
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if scoring not in SCORING_FUNCTIONS:
        raise ValueError(f"scoring must be one of {SCORING_FUNCTIONS}, got {scoring!r}")


def check_router_logits(router_logits, num_tokens=None, num_experts=None):
    check_tensor("router_logits", router_logits, 2, FLOAT_DTYPES)
    if num_tokens is not None and router_logits.shape[0] != num_tokens:
        raise ValueError(
            f"router_logits must have x.shape[0]={num_tokens} rows, got shape {tuple(router_logits.shape)}"
        )
    if num_experts is not None and router_logits.shape[1] != num_experts:
        raise ValueError(
            f"router_logits must have num_experts={num_experts} columns (w1.shape[0]), "
            f"got shape {tuple(router_logits.shape)}"
        )


def check_experts(x, w1, w2):
    """Checks x (T, d), w1 (E, 2F, d), w2 (E, d, F); returns (T, d, E, F).

    Each dim is read from the argument that defines it (d from x, E from w1, F from w2) and every other argument is
    checked against it, so the error names the tensor whose own dims are wrong, and shows both shapes where two
    weights disagree."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("w1", w1, 3)
    check_tensor("w2", w2, 3)
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} dtype {w.dtype} must match x dtype {x.dtype}")
        check_same_device(name, w, x)
    num_tokens, d_model = x.shape
    num_experts, two_d_ff, w1_d_model = w1.shape
    if w1_d_model != d_model:
        raise ValueError(f"w1 must have shape (E, 2*F, d) with d = x.shape[1] = {d_model}, got {tuple(w1.shape)}")
    if w2.shape[1] != d_model:
        raise ValueError(f"w2 must have shape (E, d, F) with d = x.shape[1] = {d_model}, got {tuple(w2.shape)}")
    if num_experts == 0:
        raise ValueError(f"w1 must hold at least one expert, got shape {tuple(w1.shape)}")
    if w2.shape[0] != num_experts:
        raise ValueError(f"w1 and w2 must hold the same number of experts E: w1 {tuple(w1.shape)} has "
                         f"{num_experts}, w2 {tuple(w2.shape)} has {w2.shape[0]}")
    if two_d_ff == 0 or two_d_ff % 2 != 0:
        raise ValueError(f"w1.shape[1] must be 2*F (gate rows then up rows) with F >= 1, got {tuple(w1.shape)}")
    d_ff = w2.shape[2]
    if d_ff == 0:
        raise ValueError(f"w2.shape[2] must be F >= 1, got {tuple(w2.shape)}")
    if two_d_ff != 2 * d_ff:
        raise ValueError(f"w1 must have shape (E, 2*F, d) = {(num_experts, 2 * d_ff, d_model)} with F = w2.shape[2] "
                         f"= {d_ff}, got {tuple(w1.shape)}: w1 and w2 {tuple(w2.shape)} disagree on F")
    return num_tokens, d_model, num_experts, d_ff


def check_topk(topk_weights, topk_ids, num_tokens, x):
    check_tensor("topk_weights", topk_weights, 2, FLOAT_DTYPES)
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    if topk_weights.shape[0] != num_tokens:
        raise ValueError(f"topk_weights must have x.shape[0]={num_tokens} rows, got shape {tuple(topk_weights.shape)}")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"topk_ids shape {tuple(topk_ids.shape)} must equal topk_weights shape {tuple(topk_weights.shape)}"
        )
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must have at least one column (top_k >= 1), got shape {tuple(topk_ids.shape)}")
    check_same_device("topk_weights", topk_weights, x)
    check_same_device("topk_ids", topk_ids, x)
