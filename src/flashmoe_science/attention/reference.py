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

from flashmoe_science.attention.mask import make_mask, visibility

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


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialised attention: softmax(q kᵀ · scale, masked) v, computed in float32 (float64 for float64)."""
    group = q.shape[1] // k.shape[1]
    compute = _compute_dtype(q.dtype)
    qc, kc, vc = q.to(compute), _expand_kv_heads(k, group).to(compute), _expand_kv_heads(v, group).to(compute)

    scores = torch.matmul(qc, kc.transpose(-1, -2)) * softmax_scale
    if causal:
        scores = scores.masked_fill(~causal_visibility(q.shape[2], k.shape[2], q.device), float("-inf"))

    # Shift by the row max for stability; a row that sees no key has max -inf, shift it by 0 instead so
    # exp gives exact zeros (not NaN). The shift cancels mathematically, so it carries no gradient.
    row_max = scores.amax(dim=-1, keepdim=True).detach() if scores.shape[-1] else scores.sum(-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, vc) / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    lse = (row_max + torch.log(row_sum)).squeeze(-1)
    return out.to(q.dtype), lse


def attention_reference_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
    causal: bool, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `attention_reference` without autograd (for callers that run where autograd is off, such as a
    custom op's implementation), in float32 (float64 for float64), returned in the inputs' dtypes.

    With P = exp(S - lse) the probabilities: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - rowsum(dO ∘ O)),
    dQ = scale · dS K, dK = scale · dSᵀ Q; a GQA key head sums the gradients of its query heads.
    """
    group = q.shape[1] // k.shape[1]
    compute = _compute_dtype(q.dtype)
    qc, kc, vc = q.to(compute), _expand_kv_heads(k, group).to(compute), _expand_kv_heads(v, group).to(compute)
    dout = grad_out.to(compute)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * softmax_scale
    if causal:
        scores = scores.masked_fill(~causal_visibility(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse_c = lse.to(compute).unsqueeze(-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse_c), torch.zeros_like(lse_c), lse_c))  # rows seeing no key: 0
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    delta = (dout * out.to(compute)).sum(dim=-1, keepdim=True)
    dscores = probs * (torch.matmul(dout, vc.transpose(-1, -2)) - delta) * softmax_scale
    dq = torch.matmul(dscores, kc)
    dk = torch.matmul(dscores.transpose(-1, -2), qc)
    if group > 1:  # query heads h*group .. h*group+group-1 read key head h
        dk = dk.unflatten(1, (k.shape[1], group)).sum(dim=2)
        dv = dv.unflatten(1, (k.shape[1], group)).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


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
