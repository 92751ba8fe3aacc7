"""The attention and MoE front doors as ``torch.library`` custom ops (namespace ``flashmoe_science``), for
``torch.compile``.

Dynamo cannot trace a Triton or Gluon launch made through the prepared-launch caches, so under ``torch.compile`` the
public functions (``flash_attention_science``, ``flash_attention_varlen``, ``flash_attention_decode``,
``fused_moe``, ``fused_experts``, ``moe_route``) call these ops (``torch.ops.flashmoe_science.*``): the compiler
sees one opaque node per op, with a fake implementation giving its outputs' shapes, dtypes and strides (and running
the eager checks at trace time), and the backward as another op (``register_autograd``). In eager mode the public
functions never come here (one ``is_compiling()`` test per call): their prepared launches keep the host time they
had (benchmarks/tools/host_time_custom_ops.py measures both).

An attention op's real implementation calls the layer below the public functions (``attention.call``, and
``attention.decode.call.decode_call``: checked problem -> plan -> execute), so a compiled call runs each check once; only
its outputs are made to have the layout its fake promises.

Ops: ``attention_forward`` -> (out, lse) and ``attention_backward`` (window, softcap, ALiBi; not attn_bias, not
FP8); ``attention_varlen_forward``/``attention_varlen_backward``; ``attention_decode`` (forward only; the caches
written in place by ``attention_decode_append`` when new keys come); ``moe_route`` and ``moe_route_backward``;
``fused_experts_forward`` -> (out, residuals for the backward) and ``fused_experts_backward``; and, for calls that
record no gradient, ``fused_moe_inference`` / ``fused_experts_inference`` (no residuals saved; the few-token decode
kernel with its fused routing).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from flashmoe_science.attention import call
from flashmoe_science.attention.decode.call import decode_call
from flashmoe_science.attention.problem import dense_problem
from flashmoe_science.moe import execute as moe_execute
from flashmoe_science.moe import routing
from flashmoe_science.moe.checks import (check_experts, check_router_logits, check_routing_options, check_top_k,
                                         check_topk)
from flashmoe_science.moe.dispatch import ExpertSort, max_row_tiles
from flashmoe_science.moe.plan import ExpertsProblem, plan_experts
from flashmoe_science.moe.reference import fused_experts_reference, fused_experts_reference_backward

NAMESPACE = "flashmoe_science"
_op = torch.library.custom_op


def _same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether `a` and `b` (one shape) have the same strides wherever a dim has more than one element."""
    return all(n <= 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def _laid_out_like(t: Tensor, like: Tensor) -> Tensor:
    """`t` with the strides `torch.empty_like(like)` has (what the fake implementations promise), copied only where
    they differ (the reference path's outputs; the kernels' already have them)."""
    layout = torch.empty_like(like, device="meta")
    if _same_layout(t, layout):
        return t
    return torch.empty_like(like).copy_(t)


def _on_device(x: Tensor):
    """Triton launches on the current CUDA device: make it x's."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _empty_like_fake(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return torch.empty_like(t, dtype=dtype)


# --------------------------------------------------------------------------------------------------- attention
# The mask-and-score options travel as (causal, softmax_scale, window or None, softcap or None, alibi_slopes or None)
# after q, k, v; `backend` and `deterministic` last. attn_bias has no op (its gradient's buffer follows the bias's
# broadcast shape): under compile it raises.


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _window(window: list[int] | None):
    # int(): a fake implementation may see symbolic ints (dynamo makes a changing int dynamic); the mask specialises
    return None if window is None else tuple(int(side) for side in window)


def _autograd_on():
    """Autograd inside an op's implementation, where the dispatcher has switched it off: the reference backward
    differentiates through its score modifications (softcap, GQA expansion)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False))
    stack.enter_context(torch.enable_grad())
    return stack


@_op(f"{NAMESPACE}::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, window: list[int] | None,
                      softcap: float | None, alibi_slopes: Tensor | None, backend: str,
                      deterministic: bool) -> tuple[Tensor, Tensor]:
    """``attention_forward_lse`` on 4-D ``(B, H, L, D)`` tensors. `deterministic` is the backward's (saved for it)."""
    with torch.no_grad():
        out, lse = call.dense_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window=_window(window),
                                      softcap=softcap, alibi_slopes=alibi_slopes, backend=backend, return_lse=True)
    return _laid_out_like(out, q), lse.contiguous()


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, backend, deterministic):
    # the eager checks run here, at trace time, so bad input fails when compiling with the eager messages; not the
    # kernel choice, which reads data pointers (a fake tensor has none)
    dense_problem(q, k, v, causal=causal, softmax_scale=softmax_scale, window=_window(window), softcap=softcap,
                  alibi_slopes=alibi_slopes, backend=backend, deterministic=deterministic)
    return _empty_like_fake(q), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


@_op(f"{NAMESPACE}::attention_backward", mutates_args=())
def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       softmax_scale: float, window: list[int] | None, softcap: float | None,
                       alibi_slopes: Tensor | None, backend: str, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    with _autograd_on():
        grads = call.dense_backward(q, k, v, out, lse, grad_out, causal=causal, softmax_scale=softmax_scale,
                                    window=_window(window), softcap=softcap, alibi_slopes=alibi_slopes,
                                    backend=backend, deterministic=deterministic)
    return tuple(_laid_out_like(g.detach(), t) for g, t in zip(grads, (q, k, v)))


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, *options):
    return _empty_like_fake(q), _empty_like_fake(k), _empty_like_fake(v)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = options
    ctx.mark_non_differentiable(lse)  # as the eager autograd.Function's


def _attention_autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out.stride(-1) != 1:  # e.g. the stride-0 gradient of out.sum(); as the eager autograd.Function does
        grad_out = grad_out.contiguous()
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, *ctx.options)
    return dq, dk, dv, *(None for _ in ctx.options)


attention_forward.register_autograd(_attention_autograd_backward, setup_context=_attention_setup_context)


@_op(f"{NAMESPACE}::attention_varlen_forward", mutates_args=())
def attention_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
                             window: list[int] | None, softcap: float | None, alibi_slopes: Tensor | None,
                             backend: str, deterministic: bool,
                             check_values: bool | None = None) -> tuple[Tensor, Tensor]:
    """``flash_attention_varlen(..., return_lse=True)`` on packed ``(total, H, D)`` tensors."""
    with torch.no_grad():
        out, lse = call.packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       causal=causal, softmax_scale=softmax_scale, window=_window(window),
                                       softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True, backend=backend,
                                       deterministic=deterministic, check_values=check_values)
    return out.contiguous(), lse.contiguous()


@attention_varlen_forward.register_fake
def _attention_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale, window, softcap, alibi_slopes, backend, deterministic,
                                   check_values=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))


@_op(f"{NAMESPACE}::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              causal: bool, softmax_scale: float, window: list[int] | None, softcap: float | None,
                              alibi_slopes: Tensor | None, backend: str, deterministic: bool,
                              check_values: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    with _on_device(q), _autograd_on():
        grads = call.packed_backward(q, k, v, out, lse, grad_out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, causal=causal, softmax_scale=softmax_scale, window=_window(window),
                                     softcap=softcap, alibi_slopes=alibi_slopes, backend=backend,
                                     deterministic=deterministic, check_values=check_values)
    return tuple(g.detach().contiguous() for g in grads)


@attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(grad_out, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _varlen_autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = attention_varlen_backward(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                           *ctx.options)
    return dq, dk, dv, None, None, *(None for _ in ctx.options)


attention_varlen_forward.register_autograd(_varlen_autograd_backward, setup_context=_varlen_setup_context)


# ------------------------------------------------------------------------------------------------------- decode
# Two registrations of one function: with k_new/v_new the caches are written in place (declared mutated), without
# them they are only read (a declared mutation would make the compiler copy the whole cache on every call).
def _decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, rotary_cos, rotary_sin,
            rotary_interleaved, causal, softmax_scale, window, softcap, alibi_slopes, num_splits, backend,
            check_values, cache_batch_idx, cache_leftpad, k_scale, v_scale):
    out, lse = decode_call(
        q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k_new, v_new=v_new, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, k_scale=k_scale, v_scale=v_scale, causal=causal, softmax_scale=softmax_scale,
        window=_window(window), softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True,
        num_splits="auto" if num_splits == 0 else num_splits, backend=backend, check_values=check_values)
    return out.contiguous(), lse.to(_lse_dtype(q)).contiguous()


def _decode_fake(q, *args):
    batch, length_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, length_q), dtype=_lse_dtype(q))


attention_decode = _op(f"{NAMESPACE}::attention_decode", _decode, mutates_args=(),
                       schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
                              "Tensor? k_new, Tensor? v_new, Tensor? rotary_cos, Tensor? rotary_sin, "
                              "bool rotary_interleaved, bool causal, float? softmax_scale, SymInt[]? window, "
                              "float? softcap, Tensor? alibi_slopes, int num_splits, str backend, bool? check_values, "
                              "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? k_scale, Tensor? v_scale) "
                              "-> (Tensor, Tensor)")
attention_decode_append = _op(
    f"{NAMESPACE}::attention_decode_append", _decode, mutates_args=("k_cache", "v_cache"),
    schema="(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? block_table, "
           "Tensor? k_new, Tensor? v_new, Tensor? rotary_cos, Tensor? rotary_sin, bool rotary_interleaved, "
           "bool causal, float? softmax_scale, SymInt[]? window, float? softcap, Tensor? alibi_slopes, int num_splits, "
           "str backend, bool? check_values, Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? k_scale, "
           "Tensor? v_scale) -> (Tensor, Tensor)")
attention_decode.register_fake(_decode_fake)
attention_decode_append.register_fake(_decode_fake)


# ------------------------------------------------------------------------------------------------------ routing
@_op(f"{NAMESPACE}::moe_route", mutates_args=())
def moe_route(router_logits: Tensor, top_k: int, renormalize: bool, scoring: str) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        return moe_execute.route_checked(router_logits, top_k, renormalize, scoring)


@moe_route.register_fake
def _moe_route_fake(router_logits, top_k, renormalize, scoring):
    check_router_logits(router_logits)
    check_top_k(top_k, router_logits.shape[1])
    check_routing_options(renormalize, scoring)
    shape = (router_logits.shape[0], top_k)
    weights_dtype = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    return router_logits.new_empty(shape, dtype=weights_dtype), router_logits.new_empty(shape, dtype=torch.int64)


@_op(f"{NAMESPACE}::moe_route_backward", mutates_args=())
def moe_route_backward(grad_weights: Tensor, router_logits: Tensor, topk_ids: Tensor, renormalize: bool,
                       scoring: str) -> Tensor:
    if routing.routes_in_triton(router_logits):
        from flashmoe_science.moe import triton_routing

        return triton_routing.route_backward(router_logits, topk_ids, grad_weights, renormalize, scoring == "sigmoid")
    grad_logits = routing.route_reference_backward(router_logits, topk_ids, grad_weights, renormalize, scoring)
    return _laid_out_like(grad_logits, router_logits)


@moe_route_backward.register_fake
def _moe_route_backward_fake(grad_weights, router_logits, topk_ids, renormalize, scoring):
    return _empty_like_fake(router_logits)


def _route_setup_context(ctx, inputs, output):
    router_logits, _, renormalize, scoring = inputs
    _, topk_ids = output
    ctx.save_for_backward(router_logits, topk_ids)
    ctx.options = (renormalize, scoring)
    ctx.mark_non_differentiable(topk_ids)


def _route_autograd_backward(ctx, grad_weights, grad_ids):
    router_logits, topk_ids = ctx.saved_tensors
    return moe_route_backward(grad_weights, router_logits, topk_ids, *ctx.options), None, None, None


moe_route.register_autograd(_route_autograd_backward, setup_context=_route_setup_context)


# ------------------------------------------------------------------------------------------------------ experts
# The kernel layer's residuals, in this order: its expert sort's five tensors, then the SwiGLU pre-activations
# (gate_up) and output (h) by sorted row. The reference keeps none (its backward recomputes): empty tensors.
# The backward op plans the call again (a custom op passes tensors, not the forward's plan): the same planner on
# the same tensors, so the same plan.
_SORT_FIELDS = ("sorted_pair_ids", "pair_row", "tile_expert", "expert_counts", "expert_row_start")


def _residuals_fake(x, w1, w2, topk_ids, backend) -> list[Tensor]:
    """Tensors shaped as ``fused_experts_forward``'s residuals (every size follows from the shapes, none from the
    ids: dispatch.sort_buffers, layer.forward_buffers)."""
    plan = plan_experts(ExpertsProblem(x, w1, w2, topk_ids.shape[1], backend, training=True), gemms=False)
    if plan.plan is None:
        return _no_residuals(x)
    block_m, (num_tokens, top_k), num_experts = plan.plan.tiles.block_m, topk_ids.shape, w1.shape[0]
    num_tiles = max_row_tiles(num_tokens * top_k, num_experts, block_m)
    sizes = ((num_tiles * block_m,), (num_tokens * top_k,), (num_tiles,), (num_experts,), (num_experts,))
    sort = [x.new_empty(size, dtype=torch.int32) for size in sizes]
    rows, two_d_ff = num_tiles * block_m, w1.shape[1]
    return [*sort, x.new_empty((rows, two_d_ff)), x.new_empty((rows, two_d_ff // 2))]


def _no_residuals(x) -> list[Tensor]:
    return [x.new_empty((0,)) for _ in range(len(_SORT_FIELDS) + 2)]


# out, then the residuals (a fixed count: a list output would reach the backward as one gradient)
_EXPERTS_OUTPUTS = tuple[(Tensor,) * (1 + len(_SORT_FIELDS) + 2)]


@_op(f"{NAMESPACE}::fused_experts_forward", mutates_args=())
def fused_experts_forward(x: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                          backend: str) -> _EXPERTS_OUTPUTS:
    """(out, *residuals): ``fused_experts`` for a call that records gradients, keeping what its backward needs."""
    plan = moe_execute.plan_experts_call(x, w1, w2, topk_weights, topk_ids, backend, training=True)
    if plan.plan is None:
        with torch.no_grad():
            return (fused_experts_reference(x, w1, w2, topk_weights, topk_ids), *_no_residuals(x))
    from flashmoe_science.moe import layer

    with _on_device(x):
        out, saved = layer.moe_forward(x, w1, w2, topk_weights.float().contiguous(), topk_ids, plan.plan,
                                       save_for_backward=True)
    rows, two_d_ff = saved.sort.tile_expert.numel() * saved.plan.tiles.block_m, w1.shape[1]
    gate_up = saved.gate_up if saved.gate_up is not None else x.new_empty((rows, two_d_ff))  # None: no tokens
    h = saved.h if saved.h is not None else x.new_empty((rows, two_d_ff // 2))
    return (out, *(getattr(saved.sort, name) for name in _SORT_FIELDS), gate_up, h)


@fused_experts_forward.register_fake
def _fused_experts_forward_fake(x, w1, w2, topk_weights, topk_ids, backend):
    num_tokens, _, _, _ = check_experts(x, w1, w2)
    check_topk(topk_weights, topk_ids, num_tokens, x)
    return (x.new_empty(x.shape), *_residuals_fake(x, w1, w2, topk_ids, backend))


@_op(f"{NAMESPACE}::fused_experts_backward", mutates_args=())
def fused_experts_backward(grad_out: Tensor, x: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                           topk_ids: Tensor, residuals: list[Tensor], backend: str) -> list[Tensor]:
    """[dx, dw1, dw2, dweights] of ``fused_experts_forward``."""
    plan = plan_experts(ExpertsProblem(x, w1, w2, topk_ids.shape[1], backend, training=True))
    if plan.plan is None:
        grads = fused_experts_reference_backward(grad_out, x, w1, w2, topk_weights, topk_ids)
        return [_laid_out_like(g, t) for g, t in zip(grads, (x, w1, w2, topk_weights))]
    from flashmoe_science.moe import layer

    *sort_tensors, gate_up, h = residuals
    sort = ExpertSort(*sort_tensors, plan.plan.tiles.block_m, topk_ids.shape[1], topk_ids.numel())
    saved = layer.SavedForBackward(sort, plan.plan, gate_up, h)
    with _on_device(x):
        dx, dw1, dw2, dweights = layer.moe_backward(grad_out, x, w1, w2, topk_weights.float().contiguous(), saved)
    return [dx, dw1, dw2, _laid_out_like(dweights.to(topk_weights.dtype), topk_weights)]


@fused_experts_backward.register_fake
def _fused_experts_backward_fake(grad_out, x, w1, w2, topk_weights, topk_ids, residuals, backend):
    return [_empty_like_fake(x), _empty_like_fake(w1), _empty_like_fake(w2), _empty_like_fake(topk_weights)]


def _experts_setup_context(ctx, inputs, output):
    x, w1, w2, topk_weights, topk_ids, backend = inputs
    ctx.save_for_backward(x, w1, w2, topk_weights, topk_ids, *output[1:])
    ctx.backend = backend
    ctx.mark_non_differentiable(*output[1:])


def _experts_autograd_backward(ctx, grad_out, *grad_residuals):
    x, w1, w2, topk_weights, topk_ids, *residuals = ctx.saved_tensors
    dx, dw1, dw2, dweights = fused_experts_backward(grad_out, x, w1, w2, topk_weights, topk_ids, residuals,
                                                    ctx.backend)
    return dx, dw1, dw2, dweights, None, None


fused_experts_forward.register_autograd(_experts_autograd_backward, setup_context=_experts_setup_context)


@_op(f"{NAMESPACE}::fused_experts_inference", mutates_args=())
def fused_experts_inference(x: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                            backend: str) -> Tensor:
    with torch.no_grad(), _on_device(x):
        return moe_execute.experts(x, w1, w2, topk_weights, topk_ids, backend)


@fused_experts_inference.register_fake
def _fused_experts_inference_fake(x, w1, w2, topk_weights, topk_ids, backend):
    return _fused_experts_forward_fake(x, w1, w2, topk_weights, topk_ids, backend)[0]


@_op(f"{NAMESPACE}::fused_moe_inference", mutates_args=())
def fused_moe_inference(x: Tensor, w1: Tensor, w2: Tensor, router_logits: Tensor, top_k: int, renormalize: bool,
                        scoring: str, backend: str) -> Tensor:
    with torch.no_grad(), _on_device(x):
        return moe_execute.moe(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)


@fused_moe_inference.register_fake
def _fused_moe_inference_fake(x, w1, w2, router_logits, top_k, renormalize, scoring, backend):
    num_tokens, _, num_experts, _ = check_experts(x, w1, w2)
    check_router_logits(router_logits, num_tokens, num_experts)
    check_top_k(top_k, num_experts)
    check_routing_options(renormalize, scoring)
    return x.new_empty(x.shape)
