"""User mods of the tests (`@triton.jit` mask_mod / score_mod, attention/mods.py) and their torch twins.

Each case: a builder of (mask_mod, score_mod, twin) for a call's shape, where `twin(b, h, i, j)` is the boolean
visibility and `score_twin(s)` the modified score in torch, so the float64 oracle (`mod_oracle`) never runs the
Triton functions the kernels and the reference run.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashmoe_science.attention.mods import MaskMod, ScoreMod
from flashmoe_science.bench.mask_mods import head_windows as head_window, prefix_lm  # the suite's masks, tested here


@triton.jit
def document_window(b, h, q_idx, kv_idx, doc, WINDOW: tl.constexpr = 9):
    """Same document, causal, at most 9 keys back."""
    same = tl.load(doc + q_idx) == tl.load(doc + kv_idx)
    return same & (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)


@triton.jit
def document_window_mod(b, h, q_idx, kv_idx, doc):
    return document_window(b, h, q_idx, kv_idx, doc)  # a mod may call other jit functions


@triton.jit
def neighbours(b, h, q_idx, kv_idx, table, K: tl.constexpr):
    """Atom q_idx attends to itself and to the atoms of its row of the neighbour list `table` (n, K), -1 = none."""
    seen = q_idx == kv_idx
    for n in tl.static_range(K):
        seen = seen | (tl.load(table + q_idx * K + n) == kv_idx)
    return seen


@triton.jit
def neighbours_4(b, h, q_idx, kv_idx, table):
    return neighbours(b, h, q_idx, kv_idx, table, 4)


@triton.jit
def tanh_softcap(score, b, h, q_idx, kv_idx):
    """4 · tanh(score / 4) through exp (no libdevice: the interpreter runs it)."""
    return 4.0 * (1.0 - 2.0 / (tl.exp(score * 0.5) + 1.0))


@triton.jit
def tanh_softcap_grad(score, b, h, q_idx, kv_idx):
    t = 1.0 - 2.0 / (tl.exp(score * 0.5) + 1.0)
    return 1.0 - t * t


@triton.jit
def head_slope(score, b, h, q_idx, kv_idx, slopes):
    """ALiBi written as a score_mod with a per-head slope table: its derivative is 1."""
    return score - tl.load(slopes + h) * tl.abs(q_idx - kv_idx).to(tl.float32)


@triton.jit
def unit_grad(score, b, h, q_idx, kv_idx, slopes):
    """1 in score's shape and layout (tl.full would need a layout inside a Gluon kernel)."""
    return score * 0.0 + 1.0


def _positions(lq, lk):
    return torch.arange(lq)[:, None], torch.arange(lk)[None, :]


def case(name: str, batch: int, heads: int, lq: int, lk: int, device="cpu"):
    """(mask_mod, score_mod, seen (batch, heads, lq, lk) bool or None, score twin or None) of a named case."""
    i, j = _positions(lq, lk)
    gen = torch.Generator().manual_seed(7)
    if name == "document_window":
        doc = torch.sort(torch.randint(0, 3, (max(lq, lk),), generator=gen)).values.to(torch.int32)
        seen = (doc[:lq, None] == doc[None, :lk]) & (j <= i) & (i - j <= 9)
        return MaskMod(document_window_mod, doc.to(device)), None, seen.expand(batch, heads, lq, lk), None
    if name == "prefix_lm":
        prefix = torch.randint(0, lk + 1, (batch,), generator=gen).to(torch.int32)
        seen = (j[None] < prefix[:, None, None]) | (j <= i)[None]
        return MaskMod(prefix_lm, prefix.to(device)), None, seen[:, None].expand(batch, heads, lq, lk), None
    if name == "head_window":
        windows = torch.randint(0, 12, (heads,), generator=gen).to(torch.int32)
        seen = (j <= i)[None] & ((i - j)[None] <= windows[:, None, None])
        return MaskMod(head_window, windows.to(device)), None, seen[None].expand(batch, heads, lq, lk), None
    if name == "neighbours":
        n = max(lq, lk)
        table = torch.randint(-1, lk, (n, 4), generator=gen).to(torch.int32)
        seen = (i == j) | (table[:lq, :, None] == j[0][None, None, :]).any(1)
        return MaskMod(neighbours_4, table.to(device)), None, seen.expand(batch, heads, lq, lk), None
    if name == "softcap_mod":
        return None, ScoreMod(tanh_softcap, grad=tanh_softcap_grad), None, lambda s: 4.0 * torch.tanh(s / 4.0)
    if name == "alibi_mod_and_window":
        slopes = (torch.rand(heads, generator=gen) * 0.3).float()
        dist = (i - j).abs()

        def twin(s):  # the mod multiplies in float32
            return s - (slopes[None, :, None, None] * dist.float()).to(s)

        seen = (j <= i) & (i - j <= 6)
        return (MaskMod(head_window, torch.full((heads,), 6, dtype=torch.int32, device=device)),
                ScoreMod(head_slope, slopes.to(device), grad=unit_grad), seen.expand(batch, heads, lq, lk), twin)
    raise KeyError(name)


CASES = ("document_window", "prefix_lm", "head_window", "neighbours", "softcap_mod", "alibi_mod_and_window")


def mod_oracle(q, k, v, seen, score_twin, *, scale=None, dtype=torch.float64):
    """(out, lse) of 4-D q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D) in `dtype` with a boolean visibility `seen` (None:
    all) and a torch score function (None: identity). A row that sees nothing gives zeros and lse -inf."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    qx, kx, vx = q.to(dtype), k.to(dtype).repeat_interleave(group, 1), v.to(dtype).repeat_interleave(group, 1)
    s = (qx @ kx.transpose(-1, -2)) * scale
    if score_twin is not None:
        s = score_twin(s)
    if seen is None:
        seen = torch.ones(s.shape, dtype=torch.bool)
    seen = seen.to(s.device)
    alive = seen.any(-1, keepdim=True)
    s = s.masked_fill(~seen & alive, float("-inf"))
    weights = torch.softmax(s, dim=-1) * alive
    lse = torch.where(alive, torch.logsumexp(s.masked_fill(~seen, float("-inf")), -1, keepdim=True),
                      torch.full_like(s[..., :1], float("-inf"))).squeeze(-1)
    return weights @ vx, lse


def packed_prefix_oracle(q, k, v, cu, lengths, prefix, heads, dtype, window_left=None):
    """(out (total, H, D), lse (H, total)) of packed q, k, v with a prefix-LM per sequence (prefix[b]), ANDed with a
    left window bound when given, through `mod_oracle` one sequence at a time."""
    outs, lses = [], []
    for b, n in enumerate(lengths):
        if n == 0:  # adds no rows
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        seen = (j < prefix[b]) | (j <= i)
        if window_left is not None:
            seen = seen & (j >= i - window_left)
        out, lse = mod_oracle(*(t[rows].transpose(0, 1)[None] for t in (q, k, v)), seen.expand(1, heads, n, n),
                              None, dtype=dtype)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)
