"""The dense and packed attention calls as ``torch.library`` custom ops, for ``torch.compile`` (``custom_ops``
describes the scheme): ``attention_forward`` -> (out, lse) and ``attention_backward`` (window, softcap, ALiBi; not
attn_bias, not FP8); ``attention_varlen_forward``/``attention_varlen_backward``. ``api`` and ``varlen`` call them
while compiling."""

from __future__ import annotations

import torch
from torch import Tensor

from flashmoe_science.attention import call
from flashmoe_science.attention.problem import dense_problem
from flashmoe_science.custom_ops import (NAMESPACE, autograd_on, custom_op, empty_like_fake, laid_out_like, lse_dtype,
                                         on_device, window_of)


# --------------------------------------------------------------------------------------------------- attention
# The mask-and-score options travel as (causal, softmax_scale, window or None, softcap or None, alibi_slopes or None)
# after q, k, v; `backend` and `deterministic` last. attn_bias has no op (its gradient's buffer follows the bias's
# broadcast shape): under compile it raises.


@custom_op(f"{NAMESPACE}::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, window: list[int] | None,
                      softcap: float | None, alibi_slopes: Tensor | None, backend: str,
                      deterministic: bool) -> tuple[Tensor, Tensor]:
    """``attention_forward_lse`` on 4-D ``(B, H, L, D)`` tensors. `deterministic` is the backward's (saved for it)."""
    with torch.no_grad():
        out, lse = call.dense_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window_of(window),
                                      softcap=softcap, alibi_slopes=alibi_slopes, backend=backend, return_lse=True)
    return laid_out_like(out, q), lse.contiguous()


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, causal, softmax_scale, window, softcap, alibi_slopes, backend, deterministic):
    # the eager checks run here, at trace time, so bad input fails when compiling with the eager messages; not the
    # kernel choice, which reads data pointers (a fake tensor has none)
    dense_problem(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window_of(window), softcap=softcap,
                  alibi_slopes=alibi_slopes, backend=backend, deterministic=deterministic)
    return empty_like_fake(q), q.new_empty(q.shape[:-1], dtype=lse_dtype(q))


@custom_op(f"{NAMESPACE}::attention_backward", mutates_args=())
def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       softmax_scale: float, window: list[int] | None, softcap: float | None,
                       alibi_slopes: Tensor | None, backend: str, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    with autograd_on():
        grads = call.dense_backward(q, k, v, out, lse, grad_out, causal=causal, softmax_scale=softmax_scale,
                                    window=window_of(window), softcap=softcap, alibi_slopes=alibi_slopes,
                                    backend=backend, deterministic=deterministic)
    return tuple(laid_out_like(g.detach(), t) for g, t in zip(grads, (q, k, v)))


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, *options):
    return empty_like_fake(q), empty_like_fake(k), empty_like_fake(v)


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


@custom_op(f"{NAMESPACE}::attention_varlen_forward", mutates_args=())
def attention_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
                             window: list[int] | None, softcap: float | None, alibi_slopes: Tensor | None,
                             backend: str, deterministic: bool,
                             check_values: bool | None = None) -> tuple[Tensor, Tensor]:
    """``flash_attention_varlen(..., return_lse=True)`` on packed ``(total, H, D)`` tensors."""
    with torch.no_grad():
        out, lse = call.packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       causal=causal, softmax_scale=softmax_scale, window=window_of(window),
                                       softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True, backend=backend,
                                       deterministic=deterministic, check_values=check_values)
    return out.contiguous(), lse.contiguous()


@attention_varlen_forward.register_fake
def _attention_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale, window, softcap, alibi_slopes, backend, deterministic,
                                   check_values=None):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q))


@custom_op(f"{NAMESPACE}::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              causal: bool, softmax_scale: float, window: list[int] | None, softcap: float | None,
                              alibi_slopes: Tensor | None, backend: str, deterministic: bool,
                              check_values: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    with on_device(q), autograd_on():
        grads = call.packed_backward(q, k, v, out, lse, grad_out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, causal=causal, softmax_scale=softmax_scale, window=window_of(window),
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
