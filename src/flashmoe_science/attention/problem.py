"""A checked attention call: the inputs normalised once, in the terms every backend and kernel reads.

The front doors (`api`, `varlen`) and the custom ops (`attention.ops`) build an `AttentionProblem` here, once per
call: every user-facing check runs in `dense_problem` / `packed_problem` and nowhere after. The planner
(`attention.plan`) decides the kernels from it; the execute layer (`attention.autograd`) runs them on its 4-D views.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashmoe_science.attention.checks import (
    check_alibi_slopes,
    check_attn_bias,
    check_flags,
    check_inputs,
    check_scale,
    check_varlen,
)
from flashmoe_science.attention.features import PLAIN, CallFeatures, feature_names
from flashmoe_science.attention.mask import make_mask
from flashmoe_science.attention.mods import check_mods
from flashmoe_science.attention.reference import default_softmax_scale


@dataclass(frozen=True, eq=False)
class AttentionProblem:
    """One checked call.

    q, k, v: what the plan reads (device, dtype, strides for TMA): the caller's tensors of a dense call, the
    `(1, H, total, D)` views of a packed one. q4, k4, v4: the kernels' `(B, H, L, D)` views (None where the caller's
    leading dims cannot merge without a copy: the front door then runs each leading index on its own, under the same
    plan). features: mask, score modifiers, bias and packed layout over the 4-D views. backend: the one asked for
    ("auto" or a backend's name). deterministic: the call's flag (`deterministic_now` adds PyTorch's global one).
    bias_grad: the bias records a gradient (the dQ kernel forms it).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q4: torch.Tensor | None
    k4: torch.Tensor | None
    v4: torch.Tensor | None
    softmax_scale: float
    features: CallFeatures = PLAIN
    backend: str = "auto"
    deterministic: bool = False
    bias_grad: bool = False

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def seqlen_q(self) -> int:
        """Query rows of the longest sequence (a packed batch's max_seqlen_q)."""
        varlen = self.features.varlen
        return self.q.shape[-2] if varlen is None else varlen.max_seqlen_q

    def feature_names(self) -> frozenset[str]:
        """The call's feature words (`features.FEATURES`), which each backend checks against what it takes."""
        return feature_names(self.features, self.head_dim, self.bias_grad)

    def deterministic_now(self) -> bool:
        """Determinism asked for by the call or by `torch.use_deterministic_algorithms`, read when the backward is
        planned: for autograd, when the forward runs (autograd.backward_plan), so a training step's backward reads
        no flag."""
        return self.deterministic or torch.are_deterministic_algorithms_enabled()


def as_4d(t: torch.Tensor) -> torch.Tensor | None:
    """A `(B, H, L, D)` view of `(..., H, L, D)` without copying, or None when the leading dims cannot merge."""
    if t.dim() == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if t.dim() == 3:
        return t.unsqueeze(0)
    if t.dim() == 4:
        return t
    try:
        return t.view(-1, *t.shape[-3:])
    except RuntimeError:
        return None


def leading_views(q, k, alibi_slopes, attn_bias) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The checked slopes as `(*batch, H)` and the bias with q's rank, its leading (batch) dims broadcast to q's
    (views, no copies)."""
    num_heads = q.shape[-3] if q.dim() >= 3 else 1
    batch_shape = tuple(q.shape[:-3])
    slopes = check_alibi_slopes(alibi_slopes, batch_shape, num_heads, q.device)
    target = (*q.shape[:-1], k.shape[-2])
    bias = check_attn_bias(attn_bias, target, q.dtype, q.device)
    if bias is not None:
        bias = bias.view((1,) * (len(target) - bias.dim()) + tuple(bias.shape))
        bias = bias.expand(*batch_shape, *bias.shape[-3:])  # stride 0 where it broadcasts over the batch
    return slopes, bias


def features_4d(mask, slopes, bias, index: tuple = ()) -> CallFeatures:
    """The features over 4-D views: the whole (merged) batch, or one leading index of the per-index loop."""
    if slopes is not None:
        slopes = slopes[index].reshape(-1, slopes.shape[-1])  # (B, H); B merged from the leading dims
    if bias is not None:
        bias = bias[index] if bias.dim() > 3 and index else bias
        lead = bias.shape[:-3]
        if all(size == 1 for size in lead):
            bias = bias.reshape(1, *bias.shape[-3:])
        else:  # a bias that varies over several unmergeable leading dims of a >4-D q: reshape may copy it
            bias = bias.reshape(-1, *bias.shape[-3:])
    return CallFeatures(mask=mask, alibi_slopes=slopes, attn_bias=bias)


def _records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def dense_problem(q, k, v, *, causal=False, softmax_scale=None, window=None, softcap=None, alibi_slopes=None,
                  attn_bias=None, backend="auto", deterministic=False, mask_mod=None, score_mod=None,
                  **flags) -> tuple[AttentionProblem, tuple]:
    """The checked problem of a dense call `(..., H, L, D)`, and the leading views of its extras `(mask, slopes,
    bias)` for the per-index loop. `flags`: the call's other bools, checked here (return_lse)."""
    check_inputs(q, k, v, softmax_scale)
    check_flags(causal=causal, deterministic=deterministic, **flags)
    mask = make_mask(causal, window, softcap)
    scale = float(softmax_scale) if softmax_scale is not None else default_softmax_scale(q.shape[-1])
    slopes, bias = leading_views(q, k, alibi_slopes, attn_bias)
    mods = check_mods(mask_mod, score_mod, q, softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias,
                      records_grad=_records_grad(q, k, v, attn_bias))
    if mods is not None and not all(as_4d(t) is not None for t in (q, k, v)):
        raise ValueError("mask_mod and score_mod need q, k, v whose leading dims merge into one batch dim (the "
                         "mods' b indexes it)")
    features = replace(features_4d(mask, slopes, bias), mods=mods)
    bias_grad = bias is not None and bias.requires_grad and torch.is_grad_enabled()
    problem = AttentionProblem(q, k, v, as_4d(q), as_4d(k), as_4d(v), scale, features, backend, deterministic,
                               bias_grad)
    return problem, (mask, slopes, bias)


def packed_as_4d(t: torch.Tensor) -> torch.Tensor:
    """(total, H, D) -> a (1, H, total, D) view (no copy)."""
    return t.permute(1, 0, 2).unsqueeze(0)


def packed_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                   softmax_scale=None, window=None, softcap=None, alibi_slopes=None, backend="auto",
                   deterministic=False, check_values=None, mask_mod=None, score_mod=None,
                   **flags) -> AttentionProblem:
    """The checked problem of a packed call (flash-attn's varlen layout: q `(total_q, Hq, D)`, k/v
    `(total_k, Hkv, D)`), over `(1, H, total, D)` views; `check_values` as `checks.check_varlen`'s."""
    varlen = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_values)
    check_scale(softmax_scale)
    check_flags(causal=causal, deterministic=deterministic, **flags)
    mask = make_mask(causal, window, softcap)
    slopes = check_alibi_slopes(alibi_slopes, (varlen.num_seqs,), q.shape[1], q.device)
    scale = float(softmax_scale) if softmax_scale is not None else default_softmax_scale(q.shape[-1])
    mods = check_mods(mask_mod, score_mod, q, softcap=softcap, alibi_slopes=alibi_slopes,
                      records_grad=_records_grad(q, k, v))
    features = CallFeatures(mask=mask, alibi_slopes=slopes, varlen=varlen, mods=mods)
    q4, k4, v4 = packed_as_4d(q), packed_as_4d(k), packed_as_4d(v)
    return AttentionProblem(q4, k4, v4, q4, k4, v4, scale, features, backend, deterministic)


def new_outputs(q, features=None, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernels' out and lse for 4-D views q. out: the given one, else a packed call's (`features.varlen`)
    as (1, H, total, D) view of a (total, H, D) buffer, flash-attn's packed layout, whatever q's strides (the caller
    then gets it without a copy: `call.packed_outputs`), else one that keeps q's strides when q is dense (e.g. a
    transposed (B, L, H, D) buffer)."""
    if out is None:
        if features is not None and features.varlen is not None:
            out = packed_as_4d(q.new_empty(q.shape[2], q.shape[1], q.shape[3]))
        else:
            out = torch.empty_like(q)
    return out, torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
