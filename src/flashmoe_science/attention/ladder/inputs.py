"""The one contract every rung of the ladder keeps, checked in one place.

Each rung is called as ``attention(q, k, v, causal=False, softmax_scale=None) -> out`` with

* q of shape (B, H, Lq, D) and k, v of shape (B, H, Lk, D): one head of keys per head of queries (the ladder
  teaches the algorithm; GQA and the other features live behind the library's front door),
* one dtype (float16, bfloat16 or float32) and one device for all three, a unit stride in the last dim,
* ``causal`` bottom-right aligned as everywhere in the library: query i sees key j iff ``j <= i + Lk - Lq``,
* ``softmax_scale`` defaulting to ``1 / sqrt(D)``,

and returns out of q's shape and dtype. A query that sees no key gets a zero row.
"""

from __future__ import annotations

import torch

from flashmoe_science.attention.reference import default_softmax_scale

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None) -> float:
    """Raise ValueError/TypeError naming the argument that breaks the contract; return the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dim, got strides {t.stride()}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, _, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
        raise ValueError(f"k must be (B, H, Lk, D) = ({b}, {h}, Lk, {d}) to match q, got {tuple(k.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if d == 0:
        raise ValueError("q's head dim D must be at least 1")
    if softmax_scale is None:
        return default_softmax_scale(d)
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a number or None, got {type(softmax_scale).__name__}")
    return float(softmax_scale)
