"""The execute layer: run a plan's forward and backward on checked 4-D views, with autograd where gradients flow.

`run` executes `plan.forward` (through `_KernelAttention` when a gradient is recorded); the reference's forward is
differentiated by autograd itself. A kernel forward's backward is decided when the forward runs: `backward_plan`
gives the `BackwardPlan` of the call's signature (cached), whose call runs `plan.backward` or, from the second
backward of a grad_out layout on, the step's prepared launch sequence. Plans come from `attention.plan`; nothing
here decides a kernel.
"""

from __future__ import annotations

import itertools

import torch

from flashmoe_science.attention.checks import check_triton_layout
from flashmoe_science.attention.features import CallFeatures
from flashmoe_science.attention.problem import features_4d
from flashmoe_science.attention.record import ran
from flashmoe_science.attention.tiles import autotune_enabled
from flashmoe_science.prepared_cache import SEEN_ONCE, prepared_table, remember, tensor_signature

# The BackwardPlan of each forward signature (`backward_key`), so that a training step's backward neither plans nor
# checks again (host time: docs/perf-notes.md). Bounded (prepared_cache.CACHE_MAX).
BACKWARD_PLANS: dict[tuple, BackwardPlan] = prepared_table("attention backward plans")
_NEW = object()  # a grad_out layout no backward of this plan has had


class BackwardPlan:
    """The backward of one forward signature, decided once, when the forward ran: `step` (the plan's backward half,
    chosen with the determinism asked for then: the call's flag or `torch.use_deterministic_algorithms`), the
    scale, and per grad_out layout (strides, 16-byte alignment) the step's prepared launch sequence
    (`step.prepare`; for the sm_90 one pass: the preprocess Δ = rowsum(dO·O), the main kernel and the dQ
    conversion as PreparedLaunches), made on the second backward of that layout and repeated from the third on.

    Called with the forward's 4-D views, out, lse, the incoming gradient and the call's features (a packed call's
    cu_seqlens are per call); returns (dq, dk, dv, dbias), None for what is not needed. A call whose three
    gradients are wanted and whose layout was prepared allocates the gradients (`empty_like`, keeping the inputs'
    strides) and launches: no checks, no plan, no key beyond grad_out's layout."""

    __slots__ = ("step", "softmax_scale", "deterministic", "launches")

    def __init__(self, step, softmax_scale: float, deterministic: bool):
        self.step, self.softmax_scale, self.deterministic = step, softmax_scale, deterministic
        self.launches: dict[tuple, object] = {}  # grad_out layout -> SEEN_ONCE, a prepared sequence, or None

    def __call__(self, q, k, v, out, lse, grad_out, features: CallFeatures, need_dq=True, need_dkdv=True,
                 need_dbias=False):
        if grad_out.stride(-1) != 1:  # e.g. the stride-0 gradient of out.sum(): the kernels need unit last stride
            grad_out = grad_out.contiguous()
        every = need_dq and need_dkdv and not need_dbias
        layout = launch = None
        if every:
            layout = tensor_signature(grad_out)[1:]
            launch = self.launches.get(layout, _NEW)
            if launch is not _NEW and launch is not SEEN_ONCE and launch is not None:
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                delta = torch.empty_like(lse)
                ran("backward", self.step.backend, self.step.kernel)
                launch(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features)
                return dq, dk, dv, None
        need_dq = need_dq or need_dbias  # the dQ kernel forms the bias's gradient
        dq = torch.empty_like(q) if need_dq else None  # empty_like keeps the input's strides when it is dense
        dk = torch.empty_like(k) if need_dkdv else None
        dv = torch.empty_like(v) if need_dkdv else None
        if not (need_dq or need_dkdv):
            return dq, dk, dv, None
        delta = torch.empty_like(lse)
        grads = self.step.run(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, self.softmax_scale,
                              self.deterministic, need_dbias)
        if launch is _NEW or launch is SEEN_ONCE:
            # prepared on the second backward of a layout: preparing costs about one more binding, which a layout
            # seen once never repays; None where the step cannot repeat this call
            remember(self.launches, layout, SEEN_ONCE if launch is _NEW else self.step.prepare(
                q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, self.softmax_scale))
        return grads


def backward_key(plan, q, k, v, out, lse, features: CallFeatures) -> tuple | None:
    """Everything the backward's choice and its launches read from a kernel forward's call: the forward's plan and
    the backend asked for, each tensor's signature (a packed call's cu_seqlens too, and its maximal lengths), the
    mask, the scale and the determinism asked for. None where the call's features carry per-call tensors the choice
    reads (ALiBi slopes, a bias, the user's mods), for a leading index of the per-index loop (its plan was made for the whole
    tensor) and under FLASHMOE_AUTOTUNE."""
    problem = plan.problem
    if q is not problem.q4 or features.per_call_tensors or autotune_enabled():
        return None
    varlen = features.varlen
    packed = () if varlen is None else (tensor_signature(varlen.cu_seqlens_q), tensor_signature(varlen.cu_seqlens_k),
                                        varlen.max_seqlen_q, varlen.max_seqlen_k)
    return (plan.forward, problem.backend, *map(tensor_signature, (q, k, v, out, lse)), *packed, features.mask,
            problem.softmax_scale, problem.deterministic_now())


def backward_plan(plan, q, k, v, out, lse, features: CallFeatures) -> BackwardPlan:
    """The BackwardPlan of a kernel forward's call (`plan.forward` not differentiable), from BACKWARD_PLANS where its
    signature (`backward_key`) ran before; made here otherwise, which walks the backward halves (`plan.backward`)."""
    key = backward_key(plan, q, k, v, out, lse, features)
    backward = BACKWARD_PLANS.get(key) if key is not None else None
    if backward is None:
        problem = plan.problem
        backward = BackwardPlan(plan.backward, problem.softmax_scale, problem.deterministic_now())
        if key is not None:
            remember(BACKWARD_PLANS, key, backward)
    return backward


class _KernelAttention(torch.autograd.Function):
    """Forward through `plan.forward`, backward through the call's `BackwardPlan` (decided here, in the forward;
    a repeated call's `recorded` brings both, its prepared forward launch and its BackwardPlan).
    Keeps the inputs, out and lse (O(L) memory; the bias's gradient is O(bias), see
    `triton.backend.bias_grad_buffer`), the BackwardPlan and the features (a packed call's cu_seqlens are per
    call). `bias` is `features.attn_bias`, passed on its own so autograd sees it."""

    @staticmethod
    def forward(ctx, q, k, v, bias, features, softmax_scale, plan, recorded=None):
        if recorded is None:
            out, lse = plan.forward.run(q, k, v, features, softmax_scale)
            ctx.backward_plan = backward_plan(plan, q, k, v, out, lse, features)
        else:  # a repeated call (call.Recorded): its forward launch and BackwardPlan as its first call decided
            out, lse = recorded.run(q, k, v, features)
            ctx.backward_plan = recorded.backward
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.features = features
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's gradient stays None instead of a zeros tensor (and its launch)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # double backward raises "trying to differentiate twice ..."
    def backward(ctx, grad_out, grad_lse):
        # grad_lse is None: lse is marked non-differentiable; grad_out is set (out is the only differentiable output).
        need_dq, need_dk, need_dv, need_dbias = ctx.needs_input_grad[:4]
        dq, dk, dv, dbias = ctx.backward_plan(*ctx.saved_tensors, grad_out, ctx.features, need_dq, need_dk or need_dv,
                                              need_dbias)
        # the rest: features, scale, plan, recorded
        return (dq if need_dq else None, dk if need_dk else None, dv if need_dv else None, dbias, None, None, None,
                None)


def replay_recorded(recorded, q, k, v, features: CallFeatures):
    """(out, lse) of a repeated plain call that records gradients (`call.Recorded`), through `_KernelAttention`;
    `features`: the call's (a packed call's carry its own cu_seqlens)."""
    return _KernelAttention.apply(q, k, v, None, features, recorded.softmax_scale, None, recorded)


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
    q4, k4, v4, features = problem.q4, problem.k4, problem.v4, problem.features
    if plan.forward.differentiable:
        return plan.backward.run(q4, k4, v4, out4, lse4, grad4, features, problem.softmax_scale)
    check_triton_layout(out4, grad4, grad4, names=("out", "grad_out", "grad_out"))
    lse4 = lse4.contiguous()
    return backward_plan(plan, q4, k4, v4, out4, lse4, features)(q4, k4, v4, out4, lse4, grad4, features)
