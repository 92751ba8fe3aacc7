"""The execute layer: run a plan's forward and backward on checked 4-D views, with autograd where gradients flow.

`run` executes `plan.forward` (through `_KernelAttention` when a gradient is recorded, whose backward runs
`plan.backward` via `kernel_backward`); the reference's forward is differentiated by autograd itself. Plans come
from `attention.plan`; nothing here decides a kernel.
"""

from __future__ import annotations

import itertools

import torch

from flashmoe_science.attention.checks import check_triton_layout
from flashmoe_science.attention.features import CallFeatures
from flashmoe_science.attention.problem import features_4d


def kernel_backward(q, k, v, out, lse, grad_out, features: CallFeatures, softmax_scale: float, *, step,
                    deterministic: bool, need_dq=True, need_dkdv=True, need_dbias=False):
    """(dq, dk, dv, dbias) from the backward plan `step` on checked 4-D views (None for what is not needed)."""
    if grad_out.stride(-1) != 1:  # e.g. the stride-0 gradient of out.sum(): the kernels need unit last stride
        grad_out = grad_out.contiguous()
    need_dq = need_dq or need_dbias  # the dQ kernel forms the bias's gradient
    dq = torch.empty_like(q) if need_dq else None  # empty_like keeps the input's strides when it is dense
    dk = torch.empty_like(k) if need_dkdv else None
    dv = torch.empty_like(v) if need_dkdv else None
    if not (need_dq or need_dkdv):
        return dq, dk, dv, None
    delta = torch.empty_like(lse)
    return step.run(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale, deterministic,
                    need_dbias)


class _KernelAttention(torch.autograd.Function):
    """Forward through `plan.forward`, backward through `plan.backward` (`kernel_backward`). Saves only the inputs,
    out and lse (O(L) memory; the bias's gradient is O(bias), see `triton_backend.bias_grad_buffer`). `bias` is
    `features.attn_bias`, passed on its own so autograd sees it."""

    @staticmethod
    def forward(ctx, q, k, v, bias, features, softmax_scale, plan):
        out, lse = plan.forward.run(q, k, v, features, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.features, ctx.softmax_scale, ctx.plan = features, softmax_scale, plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # double backward raises "trying to differentiate twice ..."
    def backward(ctx, grad_out, grad_lse):
        # grad_lse is always None or zeros: lse is marked non-differentiable.
        q, k, v, out, lse = ctx.saved_tensors
        need_dq, need_dk, need_dv, need_dbias = ctx.needs_input_grad[:4]
        plan = ctx.plan
        dq, dk, dv, dbias = kernel_backward(
            q, k, v, out, lse, grad_out, ctx.features, ctx.softmax_scale, step=plan.backward,
            deterministic=plan.problem.deterministic_now(), need_dq=need_dq, need_dkdv=need_dk or need_dv,
            need_dbias=need_dbias)
        # the rest: features, scale, plan
        return (dq if need_dq else None, dk if need_dk else None, dv if need_dv else None, dbias, None, None, None)


class NoKeys(torch.autograd.Function):
    """Attention with nothing to attend over (Lk == 0 or an empty q): zeros out, zero gradients."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def run(plan, q4, k4, v4, features: CallFeatures, softmax_scale: float):
    """(out, lse) of `plan.forward` on 4-D views, recording the graph for `plan.backward` when a gradient flows."""
    forward = plan.forward
    if forward.differentiable:
        return forward.run(q4, k4, v4, features, softmax_scale)
    bias = features.attn_bias
    if torch.is_grad_enabled() and (q4.requires_grad or k4.requires_grad or v4.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _KernelAttention.apply(q4, k4, v4, bias, features, softmax_scale, plan)
    # Inference: skip autograd's bookkeeping, a measurable share of host time on small problems.
    return forward.run(q4, k4, v4, features, softmax_scale)


def forward(plan, extras: tuple | None = None):
    """(out, lse) of a planned dense or packed call, shaped as the problem's q (lse: q.shape[:-1]). `extras`: the
    `(mask, slopes, bias)` leading views of `problem.dense_problem`, for leading dims that cannot merge."""
    problem = plan.problem
    q, k = problem.q, problem.k
    if q.numel() == 0 or k.shape[-2] == 0:
        # Nothing to attend over (or nobody asking): zero output, -inf log-sum-exp; still differentiable.
        out = NoKeys.apply(q, k, problem.v)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # as the reference's
        return out, torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype, device=q.device)
    if problem.q4 is not None and problem.k4 is not None and problem.v4 is not None:
        out4, lse4 = run(plan, problem.q4, problem.k4, problem.v4, problem.features, problem.softmax_scale)
        return out4.view(q.shape), lse4.view(q.shape[:-1])
    # Leading dims whose strides cannot merge into one batch dim: run each leading index on its own (no input
    # copies; the outputs are stacked).
    mask, slopes, bias = extras
    outs, lses = [], []
    for index in itertools.product(*(range(n) for n in q.shape[:-4])):
        features = features_4d(mask, slopes, bias, index)
        o, l = run(plan, q[index], k[index], problem.v[index], features, problem.softmax_scale)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs).view(q.shape), torch.stack(lses).view(q.shape[:-1])


def backward(plan, out4, lse4, grad4):
    """(dq, dk, dv, dbias) of a planned call from a given out and lse on the problem's 4-D views (no autograd): the
    reference's textbook backward after a reference plan, else the planned backward kernels."""
    problem = plan.problem
    args = (problem.q4, problem.k4, problem.v4, out4, lse4, grad4)
    if plan.forward.differentiable:
        return plan.backward.run(*args, problem.features, problem.softmax_scale)
    check_triton_layout(out4, grad4, grad4, names=("out", "grad_out", "grad_out"))
    return kernel_backward(*args[:4], lse4.contiguous(), grad4, problem.features, problem.softmax_scale,
                           step=plan.backward, deterministic=problem.deterministic_now())
