"""Attention in plain PyTorch: the specification, the CPU path and the test oracle.

Two versions of the same function:

* `attention_reference` materialises the (Lq, Lk) score matrix. It is the definition every kernel is tested
  against and the CPU path of the public API (autograd works through it).
* `attention_tiled` walks the keys in tiles with an online softmax, the algorithm the GPU kernels implement,
  written so a reader can follow it line by line. It never holds more than one (Lq, block_n) tile of scores.

Both take 4-D tensors: q `(B, Hq, Lq, D)`, k and v `(B, Hkv, Lk, D)` with `Hq % Hkv == 0`, and return
`(out, lse)`: out in q's dtype, lse the natural-log log-sum-exp of the scaled scores in float32 (float64 for
float64 inputs), `-inf` for a query row that sees no key (its output row is zero).
"""

from __future__ import annotations

import math

import torch

from flashmoe_science.attention.features import CallFeatures, as_features
from flashmoe_science.attention.mask import make_mask, score_mods, visibility
from flashmoe_science.attention.mods import apply_mods

CAUSAL = make_mask(True)


def causal_visibility(lq: int, lk: int, device: torch.device | str | None = None,
                      key_start: int = 0, key_stop: int | None = None) -> torch.Tensor:
    """Boolean (Lq, keys) mask over keys [key_start, key_stop) (default: all Lk), True where query i may see key j.

    Causal attention is aligned bottom-right, as in flash-attn: query i sees key j iff ``j <= i + Lk - Lq``.
    When Lq == Lk this is the usual lower triangle (what SDPA's ``is_causal`` means). The rule lives in
    `mask.visibility`, with the window rules every kernel shares.
    """
    return visibility(lq, lk, CAUSAL, device, key_start, key_stop)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    # GQA: query head h reads key/value head h // group. A readable repeat is fine in the reference.
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _modified_scores(qc: torch.Tensor, kc: torch.Tensor, features: CallFeatures, softmax_scale: float,
                     alibi_slopes, attn_bias, b0: int = 0) -> torch.Tensor:
    """Scaled scores q kᵀ · scale with the call's softcap, ALiBi, bias and mask applied (mask.score_mods), then the
    user's score_mod and mask_mod (mods.apply_mods: batch indices from b0, a packed sequence's own)."""
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * softmax_scale
    scores = score_mods(scores, features.mask, qc.shape[2], kc.shape[2], alibi_slopes, attn_bias)
    return apply_mods(scores, features.mods, b0)


def _softmax_rows(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, row_sum, row_max) of the stable softmax; rows that see no key get weights 0, row max 0."""
    # Shift by the row max for stability; a row that sees no key has max -inf, shift it by 0 instead so
    # exp gives exact zeros (not NaN). The shift cancels mathematically, so it carries no gradient.
    row_max = scores.amax(dim=-1, keepdim=True).detach() if scores.shape[-1] else scores.sum(-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    return weights, weights.sum(dim=-1, keepdim=True), row_max


def _dense_reference(q, k, v, features: CallFeatures, softmax_scale: float, alibi_slopes, attn_bias, b0: int = 0):
    group = q.shape[1] // k.shape[1]
    compute = _compute_dtype(q.dtype)
    qc, kc, vc = q.to(compute), _expand_kv_heads(k, group).to(compute), _expand_kv_heads(v, group).to(compute)
    scores = _modified_scores(qc, kc, features, softmax_scale, alibi_slopes, attn_bias, b0)
    weights, row_sum, row_max = _softmax_rows(scores)
    out = torch.matmul(weights, vc) / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    lse = (row_max + torch.log(row_sum)).squeeze(-1)
    return out.to(q.dtype), lse


def _sequences(features: CallFeatures):
    """(batch index, query rows, key rows) of each problem: one per packed sequence for varlen (the 4-D views
    are (1, H, total, D)), else the whole batch at once."""
    if features.varlen is None:
        yield slice(None), slice(None), slice(None)
        return
    cu_q = features.varlen.cu_seqlens_q.tolist()
    cu_k = features.varlen.cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        yield slice(b, b + 1), slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


def _slopes(features: CallFeatures, batch: slice):
    """The ALiBi slopes (B, H) of one problem of `_sequences` (None without ALiBi)."""
    return None if features.alibi_slopes is None else features.alibi_slopes[batch]


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialised attention: softmax(q kᵀ · scale, modified and masked) v, computed in float32 (float64 for
    float64). `causal` is a bool or a `features.CallFeatures` (window, softcap, ALiBi, bias, varlen); for varlen the
    4-D views are (1, H, total, D) and each packed sequence is attended on its own. Differentiable (also to the
    bias)."""
    features = as_features(causal)
    if features.varlen is None:
        return _dense_reference(q, k, v, features, softmax_scale, features.alibi_slopes, features.attn_bias)
    outs, lses = [], []
    for batch, q_rows, k_rows in _sequences(features):
        out, lse = _dense_reference(q[:, :, q_rows], k[:, :, k_rows], v[:, :, k_rows], features, softmax_scale,
                                    _slopes(features, batch), None, batch.start or 0)
        outs.append(out)
        lses.append(lse)
    padding = q.shape[2] - sum(o.shape[2] for o in outs)  # rows after the last sequence (unchecked cu_seqlens)
    if padding > 0:  # attended by no sequence: zeros, lse -inf (a row that sees no key)
        outs.append(q.new_zeros(*q.shape[:2], padding, v.shape[-1]))
        lses.append(torch.full((*q.shape[:2], padding), float("-inf"), dtype=_compute_dtype(q.dtype),
                               device=q.device))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def attention_backward_reference(q, k, v, out, lse, grad_out, causal, softmax_scale: float):
    """(dq, dk, dv, dbias) from a given out and lse (e.g. merged over a ring of key blocks), by the textbook
    formulas: P = exp(S - lse), dV = Pᵀ dO, dS = P ∘ (dO vᵀ − rowsum(dO ∘ O)), and dq, dk (and the bias's gradient)
    by autograd through S = score_mods(q kᵀ · scale) (so through softcap and the GQA expansion). dbias is None
    without a bias. Computed in float32 (float64 for float64), returned in the inputs' dtypes."""
    features = as_features(causal)
    compute = _compute_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=compute) for t in (q, k, v))
    bias = features.attn_bias
    dbias = torch.zeros_like(bias, dtype=compute) if bias is not None else None
    group = q.shape[1] // k.shape[1]
    for batch, q_rows, k_rows in _sequences(features):
        slopes = _slopes(features, batch)
        with torch.enable_grad():
            qc = q[:, :, q_rows].detach().to(compute).requires_grad_()
            kc = k[:, :, k_rows].detach().to(compute).requires_grad_()
            bc = bias.detach().to(compute).requires_grad_() if bias is not None else None
            scores = _modified_scores(qc, _expand_kv_heads(kc, group), features, softmax_scale, slopes, bc,
                                      batch.start or 0)
            lse_rows = lse[:, :, q_rows].to(compute).unsqueeze(-1)
            # rows that see no key (lse -inf) have all scores -inf: P is 0 there, not NaN
            p = torch.exp(scores - torch.where(torch.isinf(lse_rows), torch.zeros_like(lse_rows), lse_rows))
            do = grad_out[:, :, q_rows].to(compute)
            vc = _expand_kv_heads(v[:, :, k_rows], group).to(compute)
            delta = (do * out[:, :, q_rows].to(compute)).sum(-1, keepdim=True)
            ds = (p * (do @ vc.transpose(-1, -2) - delta)).detach()
            dv_rows = p.detach().transpose(-1, -2) @ do
            grads = torch.autograd.grad(scores, [t for t in (qc, kc, bc) if t is not None], ds)
        dq[:, :, q_rows] = grads[0]
        dk[:, :, k_rows] = grads[1]
        dv[:, :, k_rows] = dv_rows.unflatten(1, (k.shape[1], group)).sum(2)
        if bc is not None:
            dbias += grads[2]
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            dbias.to(bias.dtype) if dbias is not None else None)


def attention_tiled(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float, block_n: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax algorithm of the kernels, in PyTorch, one key tile at a time.

    Invariant after each tile: ``m`` is the running row max of the scaled scores, ``l`` the sum of
    ``exp(score - m)`` over keys seen so far, ``acc`` the matching ``exp(score - m)``-weighted sum of values.
    A new tile with a larger max rescales both by ``exp(m_old - m_new)``. The kernels do the same in base 2
    (``exp2`` with ``log2(e)`` folded into the scale), which is cheaper on the GPU.
    """
    group = q.shape[1] // k.shape[1]
    compute = _compute_dtype(q.dtype)
    qc = q.to(compute)
    kc, vc = _expand_kv_heads(k, group).to(compute), _expand_kv_heads(v, group).to(compute)
    lq, lk = q.shape[2], k.shape[2]

    m = torch.full(q.shape[:3], float("-inf"), dtype=compute, device=q.device)
    l = torch.zeros(q.shape[:3], dtype=compute, device=q.device)
    acc = torch.zeros(*q.shape[:3], v.shape[-1], dtype=compute, device=q.device)

    for start in range(0, lk, block_n):
        scores = torch.matmul(qc, kc[:, :, start : start + block_n].transpose(-1, -2)) * softmax_scale
        if causal:
            visible = causal_visibility(lq, lk, q.device, key_start=start, key_stop=start + block_n)
            scores = scores.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1))
        m_shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
        p = torch.exp(scores - m_shift.unsqueeze(-1))
        rescale = torch.exp(m - m_shift)
        l = l * rescale + p.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.matmul(p, vc[:, :, start : start + block_n])
        m = m_new

    out = acc / torch.where(l == 0, torch.ones_like(l), l).unsqueeze(-1)
    m_final = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    lse = m_final + torch.log(l)
    return out.to(q.dtype), lse


def default_softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
