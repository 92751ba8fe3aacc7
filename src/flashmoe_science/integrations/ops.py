"""The attention and MoE front doors as ``torch.library`` custom ops (namespace ``flashmoe_science``), for
``torch.compile``.

Dynamo cannot trace a Triton or Gluon launch made through the prepared-launch caches, so under ``torch.compile`` the
public functions (``flash_attention_science``, ``fused_moe``, ``fused_experts``, ``moe_route``) call the
``compiled_*`` functions below, which call these ops: the compiler sees one opaque node per op, with a fake
implementation giving its outputs' shapes, dtypes and strides, and the backward as another op
(``register_autograd``). In eager mode the public functions never come here (one ``is_compiling()`` test per call):
their prepared launches keep the host time they had (benchmarks/tools/host_time_custom_ops.py measures both).

Each op's real implementation runs the eager front door under ``no_grad``, so checks, kernel choice and the
prepared-launch caches are the eager ones; only its outputs are made to have the layout its fake promises.

Ops: ``attention_forward`` -> (out, lse) and ``attention_backward``; ``moe_route`` and ``moe_route_backward``;
``fused_experts_forward`` -> (out, residuals for the backward) and ``fused_experts_backward``; and, for calls that
record no gradient, ``fused_moe_inference`` / ``fused_experts_inference`` (no residuals saved; the few-token decode
kernel with its fused routing).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from flashmoe_science.attention import api as attention_api
from flashmoe_science.attention import reference as attention_reference
from flashmoe_science.moe import api as moe_api
from flashmoe_science.moe import routing
from flashmoe_science.moe.reference import fused_experts_reference_backward

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
def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@_op(f"{NAMESPACE}::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, backend: str,
                      deterministic: bool) -> tuple[Tensor, Tensor]:
    """``flash_attention_science(q, k, v, return_lse=True, ...)`` on 4-D ``(B, H, L, D)`` tensors. `deterministic`
    is the backward's (saved here for it)."""
    with torch.no_grad():
        out, lse = attention_api.flash_attention_science(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                         return_lse=True, backend=backend,
                                                         deterministic=deterministic)
    return _laid_out_like(out, q), lse.contiguous()


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, causal, softmax_scale, backend, deterministic):
    # the eager checks run here, at trace time, so bad input fails when compiling with the eager messages
    attention_api._check_inputs(q, k, v, softmax_scale, backend)
    attention_api._check_flags(causal=causal, deterministic=deterministic)
    return _empty_like_fake(q), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


@_op(f"{NAMESPACE}::attention_backward", mutates_args=())
def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       softmax_scale: float, backend: str, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    grads = attention_api.attention_gradients(grad_out, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                              backend=backend, deterministic=deterministic)
    return tuple(_laid_out_like(g, t) for g, t in zip(grads, (q, k, v)))


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, causal, softmax_scale, backend, deterministic):
    return _empty_like_fake(q), _empty_like_fake(k), _empty_like_fake(v)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, backend, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = (causal, softmax_scale, backend, deterministic)
    ctx.mark_non_differentiable(lse)  # as the eager autograd.Function's


def _attention_autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, *ctx.options)
    return dq, dk, dv, None, None, None, None


attention_forward.register_autograd(_attention_autograd_backward, setup_context=_attention_setup_context)


def _as_4d(t: Tensor) -> Tensor:
    """(B, H, L, D) of a 2-D, 3-D, 4-D or deeper tensor (a view; a copy only where deeper leading dims cannot
    merge, which eager mode avoids by looping and a compiled graph cannot)."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    return t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:])


def compiled_attention(q, k, v, causal, softmax_scale, return_lse, backend, deterministic, fp8_descales=()):
    """``flash_attention_science`` as the compiler traces it (its arguments as there)."""
    if any(t is not None for t in fp8_descales):
        raise ValueError("the FP8 forward (q_descale, k_descale, v_descale) has no torch.compile custom op yet: "
                         "call it outside the compiled region (torch.compiler.disable)")
    if not all(isinstance(t, Tensor) for t in (q, k, v)):  # the eager message, before any shape is read
        attention_api._check_inputs(q, k, v, softmax_scale, backend)
    attention_api._check_flags(return_lse=return_lse)
    scale = attention_reference.default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    out, lse = attention_forward(_as_4d(q), _as_4d(k), _as_4d(v), causal, scale, backend, deterministic)
    out, lse = out.reshape(q.shape), lse.reshape(q.shape[:-1])
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------------------------ routing
@_op(f"{NAMESPACE}::moe_route", mutates_args=())
def moe_route(router_logits: Tensor, top_k: int, renormalize: bool, scoring: str) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        return moe_api.moe_route(router_logits, top_k, renormalize, scoring)


@moe_route.register_fake
def _moe_route_fake(router_logits, top_k, renormalize, scoring):
    moe_api._check_router_logits(router_logits)
    moe_api._check_top_k(top_k, router_logits.shape[1])
    moe_api._check_routing_options(renormalize, scoring)
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


def compiled_moe_route(router_logits, top_k, renormalize, scoring):
    return moe_route(router_logits, top_k, renormalize, scoring)


# ------------------------------------------------------------------------------------------------------ experts
# The Triton forward's residuals, in this order: its expert sort's five tensors, then the SwiGLU pre-activations
# (gate_up) and output (h) by sorted row. The reference backend keeps none (its backward recomputes): empty tensors.
_SORT_FIELDS = ("sorted_pair_ids", "pair_row", "tile_expert", "expert_counts", "expert_row_start")


def _experts_backend(x: Tensor, backend: str) -> str:
    return moe_api._choose_backend(backend, x)


def _triton_tiles(x, w1, topk_ids):
    from flashmoe_science.moe import triton_gemm

    return triton_gemm._default_tiles(x, w1, topk_ids)


def _residuals_fake(x, w1, topk_ids, backend) -> list[Tensor]:
    """Tensors shaped as ``fused_experts_forward``'s residuals (every size follows from the shapes, none from the
    ids: dispatch.sort_buffers, triton_gemm.forward_buffers)."""
    if _experts_backend(x, backend) == "reference":
        return [x.new_empty((0,)) for _ in range(len(_SORT_FIELDS) + 2)]
    from flashmoe_science.moe.dispatch import max_row_tiles

    block_m, (num_tokens, top_k), num_experts = _triton_tiles(x, w1, topk_ids).block_m, topk_ids.shape, w1.shape[0]
    num_tiles = max_row_tiles(num_tokens * top_k, num_experts, block_m)
    sizes = ((num_tiles * block_m,), (num_tokens * top_k,), (num_tiles,), (num_experts,), (num_experts,))
    sort = [x.new_empty(size, dtype=torch.int32) for size in sizes]
    rows, two_d_ff = num_tiles * block_m, w1.shape[1]
    return [*sort, x.new_empty((rows, two_d_ff)), x.new_empty((rows, two_d_ff // 2))]


# out, then the residuals (a fixed count: a list output would reach the backward as one gradient)
_EXPERTS_OUTPUTS = tuple[(Tensor,) * (1 + len(_SORT_FIELDS) + 2)]


@_op(f"{NAMESPACE}::fused_experts_forward", mutates_args=())
def fused_experts_forward(x: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                          backend: str) -> _EXPERTS_OUTPUTS:
    """(out, *residuals): ``fused_experts`` for a call that records gradients, keeping what its backward needs."""
    chosen = _experts_backend(x, backend)
    if chosen == "reference":
        with torch.no_grad():
            out = moe_api.fused_experts(x, w1, w2, topk_weights, topk_ids, backend=chosen)
        return (out, *_residuals_fake(x, w1, topk_ids, chosen))
    from flashmoe_science.moe import triton_gemm

    with _on_device(x):
        out, saved = triton_gemm.moe_forward(x, w1, w2, topk_weights.float().contiguous(), topk_ids,
                                             save_for_backward=True)
    rows, two_d_ff = saved.sort.tile_expert.numel() * saved.tiles.block_m, w1.shape[1]
    gate_up = saved.gate_up if saved.gate_up is not None else x.new_empty((rows, two_d_ff))  # None: no tokens
    h = saved.h if saved.h is not None else x.new_empty((rows, two_d_ff // 2))
    return (out, *(getattr(saved.sort, name) for name in _SORT_FIELDS), gate_up, h)


@fused_experts_forward.register_fake
def _fused_experts_forward_fake(x, w1, w2, topk_weights, topk_ids, backend):
    num_tokens, _, _, _ = moe_api._check_experts(x, w1, w2)
    moe_api._check_topk(topk_weights, topk_ids, num_tokens, x)
    return (x.new_empty(x.shape), *_residuals_fake(x, w1, topk_ids, backend))


@_op(f"{NAMESPACE}::fused_experts_backward", mutates_args=())
def fused_experts_backward(grad_out: Tensor, x: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                           topk_ids: Tensor, residuals: list[Tensor], backend: str) -> list[Tensor]:
    """[dx, dw1, dw2, dweights] of ``fused_experts_forward``."""
    chosen = _experts_backend(x, backend)
    if chosen == "reference":
        grads = fused_experts_reference_backward(grad_out, x, w1, w2, topk_weights, topk_ids)
        return [_laid_out_like(g, t) for g, t in zip(grads, (x, w1, w2, topk_weights))]
    from flashmoe_science.moe import triton_gemm
    from flashmoe_science.moe.dispatch import ExpertSort

    tiles = _triton_tiles(x, w1, topk_ids)  # the forward's: the same rule on the same shapes
    *sort_tensors, gate_up, h = residuals
    sort = ExpertSort(*sort_tensors, tiles.block_m, topk_ids.shape[1], topk_ids.numel())
    saved = triton_gemm.SavedForBackward(sort, tiles, gate_up, h)
    with _on_device(x):
        dx, dw1, dw2, dweights = triton_gemm.moe_backward(grad_out, x, w1, w2, topk_weights.float().contiguous(),
                                                          saved)
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
    with torch.no_grad():
        return moe_api.fused_experts(x, w1, w2, topk_weights, topk_ids, backend=backend)


@fused_experts_inference.register_fake
def _fused_experts_inference_fake(x, w1, w2, topk_weights, topk_ids, backend):
    return _fused_experts_forward_fake(x, w1, w2, topk_weights, topk_ids, backend)[0]


@_op(f"{NAMESPACE}::fused_moe_inference", mutates_args=())
def fused_moe_inference(x: Tensor, w1: Tensor, w2: Tensor, router_logits: Tensor, top_k: int, renormalize: bool,
                        scoring: str, backend: str) -> Tensor:
    with torch.no_grad():
        return moe_api.fused_moe(x, w1, w2, router_logits, top_k, renormalize=renormalize, scoring=scoring,
                                 backend=backend)


@fused_moe_inference.register_fake
def _fused_moe_inference_fake(x, w1, w2, router_logits, top_k, renormalize, scoring, backend):
    num_tokens, _, num_experts, _ = moe_api._check_experts(x, w1, w2)
    moe_api._check_router_logits(router_logits, num_tokens, num_experts)
    moe_api._check_top_k(top_k, num_experts)
    moe_api._check_routing_options(renormalize, scoring)
    return x.new_empty(x.shape)


def _records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def compiled_fused_experts(x, w1, w2, topk_weights, topk_ids, backend):
    if _records_grad(x, w1, w2, topk_weights):
        return fused_experts_forward(x, w1, w2, topk_weights, topk_ids, backend)[0]
    return fused_experts_inference(x, w1, w2, topk_weights, topk_ids, backend)


def compiled_fused_moe(x, w1, w2, router_logits, top_k, renormalize, scoring, backend):
    if _records_grad(x, w1, w2, router_logits):
        topk_weights, topk_ids = moe_route(router_logits, top_k, renormalize, scoring)
        return fused_experts_forward(x, w1, w2, topk_weights, topk_ids, backend)[0]
    return fused_moe_inference(x, w1, w2, router_logits, top_k, renormalize, scoring, backend)
