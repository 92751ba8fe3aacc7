"""The layer below the public functions: checked problem -> plan -> execute, once per call.

The front doors (`api`, `varlen`) call these after their device and torch.compile routing; the custom ops
(`attention.ops`) call them as their real implementations, so a compiled call runs every check once. Each
returns `(out, lse)` (or the gradients) shaped as the public functions document.
"""

from __future__ import annotations

import torch

from flashmoe_science.attention import autograd
from flashmoe_science.attention.checks import resolve_check_values, values_checked
from flashmoe_science.attention.features import CallFeatures, Varlen, plain_call
from flashmoe_science.attention.fp8 import fp8_problem
from flashmoe_science.attention.plan import plan_attention, plan_fp8
from flashmoe_science.attention.problem import as_4d, dense_problem, packed_as_4d, packed_problem
from flashmoe_science.attention.tiles import autotune_enabled
from flashmoe_science.prepared_cache import prepared_table, remember, tensor_signature

# Calls whose signature ran before skip the checks, the plan and Triton's argument binding (host time per call:
# docs/perf-notes.md). Bounded (prepared_cache.CACHE_MAX). Plain calls only (no window, softcap, ALiBi or bias).
# Values: (the PreparedLaunch, the forward plan it repeats), or a Recorded for a call that records gradients.
PREPARED: dict[tuple, tuple | Recorded] = prepared_table("attention dense calls")


def prepared_key(q, k, v, causal, softmax_scale, return_lse, backend, deterministic) -> tuple | None:
    """Everything the checks, the plan and the kernel's specialisation read from a call, or None where the call must
    take the full path: arguments of types whose equality would hide a failing check (True == 1). A call that
    records gradients keys apart, with the determinism its backward is planned for."""
    if (causal.__class__ is not bool or return_lse.__class__ is not bool or deterministic.__class__ is not bool
            or not (softmax_scale is None or softmax_scale.__class__ is float) or backend.__class__ is not str
            or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor))):
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # last: None without a gradient, else whether the backward is deterministic (autograd.backward_key reads it)
    return (*map(tensor_signature, (q, k, v)), causal, softmax_scale, return_lse, backend, deterministic,
            (deterministic or torch.are_deterministic_algorithms_enabled()) if grad else None)


_LOOK_UP = object()  # dense_forward's default key: look the call up in PREPARED itself


class Recorded:
    """A repeated plain call that records gradients, as its signature's first call decided it: the forward's plan
    step (with its PreparedLaunch for a dense call; a packed call's step repeats its own launch, whose per-call
    tensors come from the call's cu_seqlens), and the BackwardPlan its backward runs (`autograd.backward_plan`).
    `features`: a dense call's, or a packed call's mask (its cu_seqlens are the call's own). `replay` runs it
    through `_KernelAttention`, with no checks, plan or key beyond the call's."""

    __slots__ = ("prepared", "step", "backward", "features", "softmax_scale")

    def __init__(self, prepared, step, backward, features, softmax_scale: float):
        self.prepared, self.step, self.backward = prepared, step, backward
        self.features, self.softmax_scale = features, softmax_scale

    def run(self, q, k, v, features):
        if self.prepared is None:
            return self.step.run(q, k, v, features, self.softmax_scale)
        return self.step.launch(self.prepared, q, k, v)


def replay(entry, q, k, v):
    """(out, lse) of a call whose signature ran before (`PREPARED[key]`): checks and plan as then; a Recorded one
    with autograd's graph."""
    if entry.__class__ is Recorded:
        return autograd.replay_recorded(entry, q, k, v, entry.features)
    prepared, step = entry
    return step.launch(prepared, q, k, v)


def dense_forward(q, k, v, *, causal=False, softmax_scale=None, window=None, softcap=None, alibi_slopes=None,
                  attn_bias=None, backend="auto", deterministic=False, return_lse=False, key=_LOOK_UP,
                  mask_mod=None, score_mod=None):
    """(out, lse) of a dense call (the arguments of `flash_attention_science`), with autograd where gradients flow.
    `key`: the call's `prepared_key` where the caller looked it up in PREPARED already (None: not a plain call)."""
    if key is _LOOK_UP:
        key = (prepared_key(q, k, v, causal, softmax_scale, return_lse, backend, deterministic)
               if plain_call(window, softcap, alibi_slopes, attn_bias, mask_mod, score_mod) else None)
        entry = PREPARED.get(key) if key is not None else None
        if entry is not None:
            return replay(entry, q, k, v)
    problem, extras = dense_problem(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                    softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias, backend=backend,
                                    deterministic=deterministic, return_lse=return_lse, mask_mod=mask_mod,
                                    score_mod=score_mod)
    plan = plan_attention(problem)
    out, lse = autograd.forward(plan, extras)
    step = plan.forward
    if (key is not None and not step.differentiable and q.is_cuda and q.dim() == 4 and q.numel() and k.shape[-2]
            and not autotune_enabled()):
        features, scale = problem.features, problem.softmax_scale
        prepared = step.prepare(q, k, v, out, lse, features, scale)
        if prepared is not None:
            if key[-1] is None:
                remember(PREPARED, key, (prepared, step))
            else:  # the forward took the signature's BackwardPlan already: the same key finds it
                backward = autograd.backward_plan(plan, q, k, v, out, lse, features)
                remember(PREPARED, key, Recorded(prepared, step, backward, features, scale))
    return out, lse


def _check_saved(q, out, lse, grad_out) -> None:
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    for name, t, shape, dtype in (("out", out, q.shape, q.dtype), ("grad_out", grad_out, q.shape, q.dtype),
                                  ("lse", lse, q.shape[:-1], lse_dtype)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != shape or t.dtype != dtype or t.device != q.device:
            raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)} on {q.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")


def dense_backward(q, k, v, out, lse, grad_out, *, causal=False, softmax_scale=None, window=None, softcap=None,
                   alibi_slopes=None, backend="auto", deterministic=False):
    """(dq, dk, dv) of a dense call from a given out and lse (the arguments of `attention_backward_lse`)."""
    problem, _ = dense_problem(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                               alibi_slopes=alibi_slopes, backend=backend, deterministic=deterministic)
    plan = plan_attention(problem)
    _check_saved(q, out, lse, grad_out)
    if problem.q4 is None or problem.k4 is None or problem.v4 is None:
        raise ValueError("attention_backward_lse needs q, k, v whose leading dims merge into one batch dim")
    out4, grad4 = as_4d(out), as_4d(grad_out)
    if out4 is None or grad4 is None:
        raise ValueError("out and grad_out must have leading dims that merge into one batch dim")
    if q.numel() == 0 or k.shape[-2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    lse4 = lse.reshape(*problem.q4.shape[:3])
    dq, dk, dv, _ = autograd.backward(plan, out4, lse4, grad4)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def packed_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse,
               backend, deterministic) -> tuple | None:
    """`prepared_key` of a packed call: also the cu_seqlens' signatures and the max lengths (the plan reads them),
    or None where the call must take the full path. Not their values: what a call derives from those (the value
    check, the kernels' work lists) is remembered per cu_seqlens tensor while it lives unwritten
    (`prepared_cache.TensorMemo`)."""
    key = prepared_key(q, k, v, causal, softmax_scale, return_lse, backend, deterministic)
    if (key is None or cu_seqlens_q.__class__ is not torch.Tensor or cu_seqlens_k.__class__ is not torch.Tensor
            or max_seqlen_q.__class__ is not int or max_seqlen_k.__class__ is not int):
        return None
    return (*key, tensor_signature(cu_seqlens_q), tensor_signature(cu_seqlens_k), max_seqlen_q, max_seqlen_k)


# Packed calls whose signature ran before (`packed_key`): the plan's forward step, the mask and the scale (seen
# once), a PackedLaunch (seen twice: the step's prepared launch), or for a call that records gradients its Recorded
# (the step and the BackwardPlan). A replay still asks checks.values_checked for the cu_seqlens pair (their values
# are not part of a signature) unless the call opts out of value checks: a model's layers share one pair per batch,
# so every layer after the first replays without a check, a plan or a device synchronisation.
PREPARED_PACKED: dict[tuple, tuple | PackedLaunch | Recorded] = prepared_table("attention packed calls")


class PackedLaunch:
    """A packed inference call's signature from its second call on: the forward step's PreparedLaunch (None where the
    step prepares none for packed calls: its `run` then), the mask and the scale. The packed key determines the
    step's own key (the 4-D views' and the fresh outputs' signatures follow from the call's), so a replay launches
    without computing it."""

    __slots__ = ("prepared", "step", "mask", "softmax_scale")

    def __init__(self, prepared, step, mask, softmax_scale: float):
        self.prepared, self.step, self.mask, self.softmax_scale = prepared, step, mask, softmax_scale

    def run(self, q4, k4, v4, features, out4=None):
        if self.prepared is None:
            return self.step.run(q4, k4, v4, features, self.softmax_scale, out4)
        return self.step.launch(self.prepared, q4, k4, v4, features, out4)


def packed_replay(entry, key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_values=None,
                  out4=None):
    """(out, lse) of a packed call whose signature ran before (`PREPARED_PACKED[key]`), or None where its cu_seqlens
    pair is to be checked (`checks.resolve_check_values`) and has not passed the value check (the full path checks
    it). An inference call's second replay of a signature keeps the step's prepared launch (`PackedLaunch`). out4:
    `packed_forward`'s out as a 4-D view, written by inference replays."""
    bounds = (q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    if resolve_check_values(check_values, q.device) and not values_checked(cu_seqlens_q, cu_seqlens_k, bounds):
        return None
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q4, k4, v4 = packed_as_4d(q), packed_as_4d(k), packed_as_4d(v)
    if entry.__class__ is Recorded:
        features = CallFeatures(mask=entry.features.mask, varlen=varlen)
        return packed_outputs(*autograd.replay_recorded(entry, q4, k4, v4, features))
    if entry.__class__ is PackedLaunch:
        return packed_outputs(*entry.run(q4, k4, v4, CallFeatures(mask=entry.mask, varlen=varlen), out4))
    step, mask, softmax_scale = entry
    features = CallFeatures(mask=mask, varlen=varlen)
    out4, lse4 = step.run(q4, k4, v4, features, softmax_scale, out4)  # the step prepares its launch on this call
    remember(PREPARED_PACKED, key, PackedLaunch(step.prepare(q4, k4, v4, out4, lse4, features, softmax_scale),
                                                step, mask, softmax_scale))
    return packed_outputs(out4, lse4)


def packed_outputs(out4, lse4):
    """(out (total_q, Hq, D), lse (Hq, total_q)) from the kernels' (1, H, total, D) output and (1, H, total) lse."""
    out = out4.squeeze(0).permute(1, 0, 2)  # back to (total_q, Hq, D): a view of the kernels' packed output
    if not out.is_contiguous():  # the reference's output is (1, H, total, D)-contiguous
        out = out.contiguous()
    return out, lse4.squeeze(0)


def packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                   softmax_scale=None, window=None, softcap=None, alibi_slopes=None, backend="auto",
                   deterministic=False, return_lse=False, check_values=None, mask_mod=None, score_mod=None, out=None):
    """(out (total_q, Hq, D), lse (Hq, total_q)) of a packed call (the arguments of `flash_attention_varlen`).

    out: a (total_q, Hq, D) buffer in q's dtype and flash-attn's packed layout (contiguous), which an inference
    call's repeated signature writes in place of a fresh output (an engine's output: no copy); the returned out is
    then a view of it. Other calls, or a buffer of another layout, return a fresh out (the caller copies)."""
    key = packed_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     return_lse, backend, deterministic) if plain_call(window, softcap, alibi_slopes, None, mask_mod,
                                                                       score_mod) else None
    entry = PREPARED_PACKED.get(key) if key is not None else None
    if entry is not None:
        takes_out = out is not None and entry.__class__ is not Recorded and _takes_out(out, q)
        out4 = packed_as_4d(out) if takes_out else None
        outputs = packed_replay(entry, key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                check_values, out4)
        if outputs is not None:
            return outputs
    problem = packed_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                             softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                             backend=backend, deterministic=deterministic, return_lse=return_lse,
                             check_values=check_values, mask_mod=mask_mod, score_mod=score_mod)
    plan = plan_attention(problem)
    out4, lse4 = autograd.run(plan, problem.q4, problem.k4, problem.v4, problem.features, problem.softmax_scale)
    step = plan.forward
    if key is not None and not step.differentiable and q.numel() and k.shape[0] and not autotune_enabled():
        features, scale = problem.features, problem.softmax_scale
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            remember(PREPARED_PACKED, key, (step, features.mask, scale))
        else:  # the forward took the signature's BackwardPlan already: the same key finds it
            backward = autograd.backward_plan(plan, problem.q4, problem.k4, problem.v4, out4, lse4, features)
            remember(PREPARED_PACKED, key, Recorded(None, step, backward, CallFeatures(mask=features.mask), scale))
    return packed_outputs(out4, lse4)


def _takes_out(out, q) -> bool:
    """Whether `packed_forward`'s out can take the kernels' packed output: its shape, dtype and device, contiguous
    and 16-byte aligned as a fresh one (`problem.new_outputs`: the prepared launches froze its signature), nothing
    recording its gradient."""
    return (out.__class__ is torch.Tensor and out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
            and out.is_contiguous() and out.data_ptr() % 16 == 0 and not out.requires_grad)


def packed_backward(q, k, v, out, lse, grad_out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    causal=False, softmax_scale=None, window=None, softcap=None, alibi_slopes=None, backend="auto",
                    deterministic=False, check_values=None):
    """(dq, dk, dv), packed as q, k, v, of a packed call from a given out `(total_q, Hq, D)` and lse `(Hq, total_q)`."""
    problem = packed_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                             softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                             backend=backend, deterministic=deterministic, check_values=check_values)
    plan = plan_attention(problem)
    grads = autograd.backward(plan, packed_as_4d(out), lse.unsqueeze(0), packed_as_4d(grad_out))
    return tuple(g.squeeze(0).permute(1, 0, 2) for g in grads[:3])


def fp8_forward(q, k, v, q_descale, k_descale, v_descale, *, causal=False, softmax_scale=None, backend="auto",
                deterministic=False, return_lse=False):
    """(out bf16, lse) of an FP8 call: the e4m3 kernel, else the dequantised inputs planned as a dense call."""
    problem = fp8_problem(q, k, v, q_descale, k_descale, v_descale, causal=causal, softmax_scale=softmax_scale,
                          backend=backend, return_lse=return_lse, deterministic=deterministic)
    return plan_fp8(problem).plan.run(problem)
