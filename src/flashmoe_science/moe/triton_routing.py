"""Top-k routing in one Triton launch each way, with the semantics of ``routing.route_reference``.

The PyTorch routing is five kernels forward (cast, softmax, top-k, sum, divide) and as many autograd nodes
backward: on few tokens their launch costs outweigh the expert GEMMs they feed (docs/perf-notes.md).
Here one program handles BLOCK_T rows of logits, all E experts of a row in registers:

- ``_route_forward_kernel``: scores (softmax or sigmoid) in float32, then top_k rounds of "take the row's best
  score, lowest expert id among equals", then the optional renormalisation. Rows come out ordered by decreasing
  score, as ``torch.topk`` orders them.
- ``_route_backward_kernel``: the logits' gradient from the weights' gradient, recomputing the scores from the
  logits (cheaper than saving a (T, E) score tensor). With ``s`` the scores, ``sel`` the chosen experts, ``g`` the
  weights' gradient scattered to its experts (zero elsewhere) and ``w`` the routing weights:
    softmax, renormalised:   w = softmax over sel of the logits, so  dl = sel * w * (g - sum(g * w))
    softmax:                 w = s,                                   dl = s * (g - sum(g * s))
    sigmoid, renormalised:   w = s / S, S = sum over sel of s,        dl = sel * (g - sum(g * w)) / S * s * (1 - s)
    sigmoid:                 w = s,                                   dl = g * s * (1 - s)
"""

import torch
import triton
import triton.language as tl

from flashmoe_science.moe.launch import Launch

MAX_EXPERTS = 1024  # a row of scores lives in one program's registers


@triton.jit
def _scores(logits_ptr, rows, experts, num_tokens, num_experts, stride_lt, stride_le, SIGMOID: tl.constexpr):
    """(BLOCK_T, E_POW2) float32 scores of the given rows and their validity mask (padding experts score 0)."""
    valid = (rows < num_tokens)[:, None] & (experts < num_experts)[None, :]
    # rows past the end read the last row again (their results are never stored): no 0/0 in their softmax
    in_rows = tl.minimum(rows, num_tokens - 1).to(tl.int64)
    logits = tl.load(logits_ptr + in_rows[:, None] * stride_lt + experts[None, :] * stride_le,
                     mask=(experts < num_experts)[None, :], other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = shifted / tl.sum(shifted, axis=1)[:, None]
    return tl.where(valid, scores, 0.0), valid


@triton.jit
def _top_k(scores, valid, experts, TOP_K: tl.constexpr, K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr):
    """(weights, ids), each (rows, K_POW2): top_k rounds of "take the row's best score, lowest expert id among
    equals" (slots past TOP_K hold 0), then the optional renormalisation. Also the decode kernel's routing
    (moe/triton_decode.py)."""
    remaining = tl.where(valid, scores, -1.0)  # scores are >= 0: padding experts are never taken
    slots = tl.arange(0, K_POW2)
    weights = tl.zeros([scores.shape[0], K_POW2], dtype=tl.float32)
    ids = tl.zeros([scores.shape[0], K_POW2], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)
        best_id = tl.min(tl.where(remaining == best[:, None], experts[None, :], scores.shape[1]), axis=1)
        weights = tl.where(slots[None, :] == slot, best[:, None], weights)
        ids = tl.where(slots[None, :] == slot, best_id[:, None], ids)
        remaining = tl.where(experts[None, :] == best_id[:, None], -2.0, remaining)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    return weights, ids


@triton.jit(do_not_specialize=["num_tokens"])
def _route_forward_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    stride_lt,
    stride_le,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, E_POW2)
    scores, valid = _scores(logits_ptr, rows, experts, num_tokens, num_experts, stride_lt, stride_le, SIGMOID)
    weights, ids = _top_k(scores, valid, experts, TOP_K, K_POW2, RENORMALIZE)
    slots = tl.arange(0, K_POW2)
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = (rows < num_tokens)[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _route_backward_kernel(
    logits_ptr,
    ids_ptr,
    grad_weights_ptr,
    grad_logits_ptr,
    num_tokens,
    num_experts,
    stride_lt,
    stride_le,
    stride_gt,
    stride_gk,
    TOP_K: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_valid = rows < num_tokens
    experts = tl.arange(0, E_POW2)
    scores, valid = _scores(logits_ptr, rows, experts, num_tokens, num_experts, stride_lt, stride_le, SIGMOID)
    # the weights' gradient scattered to its experts, and the chosen-expert mask
    grad = tl.zeros([BLOCK_T, E_POW2], dtype=tl.float32)
    chosen = tl.zeros([BLOCK_T, E_POW2], dtype=tl.int1)
    for slot in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + rows.to(tl.int64) * TOP_K + slot, mask=row_valid, other=-1)
        g = tl.load(grad_weights_ptr + rows.to(tl.int64) * stride_gt + slot * stride_gk, mask=row_valid, other=0.0)
        hit = experts[None, :] == expert[:, None]
        grad = tl.where(hit, g.to(tl.float32)[:, None], grad)
        chosen = chosen | hit
    if RENORMALIZE:
        # (rows past the end chose nothing: 1, not 0/0)
        total = tl.where(row_valid, tl.sum(tl.where(chosen, scores, 0.0), axis=1), 1.0)[:, None]
        weights = tl.where(chosen, scores / total, 0.0)
        centred = tl.where(chosen, grad - tl.sum(grad * weights, axis=1)[:, None], 0.0)
        if SIGMOID:
            grad_logits = centred / total * scores * (1.0 - scores)
        else:
            grad_logits = weights * centred
    else:
        if SIGMOID:
            grad_logits = grad * scores * (1.0 - scores)
        else:
            grad_logits = scores * (grad - tl.sum(grad * scores, axis=1)[:, None])
    tl.store(grad_logits_ptr + rows.to(tl.int64)[:, None] * num_experts + experts[None, :],
             grad_logits.to(grad_logits_ptr.dtype.element_ty), mask=valid)


def _program_shape(num_tokens: int, num_experts: int) -> dict:
    """E_POW2, BLOCK_T (rows per program: ~2K scores, fewer when there are fewer tokens) and num_warps (one per 256
    scores, so that a decode call's top-k rounds reduce within one warp, without shared memory or barriers: 8.8 µs
    for one token at E=128 with 32 rows and 4 warps per program)."""
    e_pow2 = triton.next_power_of_2(num_experts)
    block_t = max(1, min(64, 2048 // e_pow2, triton.next_power_of_2(max(num_tokens, 1))))
    return dict(E_POW2=e_pow2, BLOCK_T=block_t, num_warps=max(1, min(4, block_t * e_pow2 // 256)))


def route_forward_launch(router_logits, weights, ids, top_k: int, renormalize: bool, sigmoid: bool) -> Launch:
    num_tokens, num_experts = router_logits.shape
    shape = _program_shape(num_tokens, num_experts)
    args = (router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0), router_logits.stride(1))
    meta = dict(TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), SIGMOID=sigmoid, RENORMALIZE=renormalize, **shape)
    return Launch(_route_forward_kernel, (triton.cdiv(num_tokens, shape["BLOCK_T"]),), args, meta)


def route_backward_launch(router_logits, ids, grad_weights, grad_logits, renormalize: bool, sigmoid: bool) -> Launch:
    num_tokens, num_experts = router_logits.shape
    shape = _program_shape(num_tokens, num_experts)
    args = (router_logits, ids, grad_weights, grad_logits, num_tokens, num_experts, router_logits.stride(0),
            router_logits.stride(1), grad_weights.stride(0), grad_weights.stride(1))
    meta = dict(TOP_K=ids.shape[1], SIGMOID=sigmoid, RENORMALIZE=renormalize, **shape)
    return Launch(_route_backward_kernel, (triton.cdiv(num_tokens, shape["BLOCK_T"]),), args, meta)


class RouteTriton(torch.autograd.Function):
    """``routing.route`` on float16/bfloat16/float32 logits with at most MAX_EXPERTS experts: one launch forward,
    one backward. Saves the logits and the ids (the backward recomputes the scores)."""

    @staticmethod
    def forward(ctx, router_logits, top_k: int, renormalize: bool, sigmoid: bool):
        num_tokens = router_logits.shape[0]
        weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
        ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
        if num_tokens > 0:
            route_forward_launch(router_logits, weights, ids, top_k, renormalize, sigmoid)()
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(router_logits, ids)
        ctx.options = (renormalize, sigmoid)
        return weights, ids

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_weights, _grad_ids):
        router_logits, ids = ctx.saved_tensors
        return route_backward(router_logits, ids, grad_weights, *ctx.options), None, None, None


def route_backward(router_logits, ids, grad_weights, renormalize: bool, sigmoid: bool) -> torch.Tensor:
    """The router logits' gradient from the routing weights' (one launch; the scores are recomputed)."""
    grad_logits = torch.empty(router_logits.shape, dtype=router_logits.dtype, device=router_logits.device)
    if router_logits.shape[0] > 0:
        route_backward_launch(router_logits, ids, grad_weights, grad_logits, renormalize, sigmoid)()
    return grad_logits
