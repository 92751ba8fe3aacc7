"""Shared helpers for the attention tests: input makers, the float64 oracle, error metrics and the tolerance rule.

The tolerance rule (ARCHITECTURE.md, "Tests that can fail"): our error against float64 must be at most
2 x PyTorch's own error in the same dtype (SDPA run in that dtype on the CPU) plus a small absolute slack.
The oracle is written here from scratch (float64 SDPA with an explicit boolean mask, `repeat_interleave` for
GQA, `torch.logsumexp` for the LSE), so it shares no code with `flashmoe_science.attention.reference`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}

# Absolute slack on top of 2 x PyTorch's error, per output dtype: a fraction of an output ulp near |x| ~ 1
OUT_SLACK = {torch.bfloat16: 1e-3, torch.float16: 1e-4, torch.float32: 1e-6, torch.float64: 1e-12}
# The LSE is always computed in float32 (float64 for float64 inputs); its slack is relative to max(1, |lse|).
LSE_SLACK = {torch.bfloat16: 1e-6, torch.float16: 1e-6, torch.float32: 1e-6, torch.float64: 1e-12}


def dtype_id(dtype: torch.dtype) -> str:
    return DTYPE_IDS[dtype]


def randn(*shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Fresh standard-normal values (never zeros), rounded once to `dtype`."""
    t = torch.randn(shape, dtype=torch.float64) * scale
    assert t.numel() == 0 or t.abs().max() > 0
    return t.to(dtype)


def make_qkv(q_shape, kv_shape, dtype=torch.float32, scale: float = 1.0):
    """q of `q_shape`, k and v of `kv_shape`, all fresh random in `dtype`; `scale` multiplies q and k (logits)."""
    q = randn(*q_shape, dtype=dtype, scale=scale)
    k = randn(*kv_shape, dtype=dtype, scale=scale)
    v = randn(*kv_shape, dtype=dtype)
    return q, k, v


def visibility(lq: int, lk: int, causal: bool) -> torch.Tensor:
    """(Lq, Lk) boolean: bottom-right causal (query i sees key j iff j <= i + Lk - Lq), or all True."""
    mask = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        for i in range(lq):
            mask[i, max(0, i + lk - lq + 1) :] = False
    return mask


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """(..., H, L, D) or (L, D) as (N, H, L, D) (a copy is fine in the oracle)."""
    if t.dim() == 2:
        return t.reshape(1, 1, *t.shape)
    return t.reshape(-1, *t.shape[-3:])


def _expand(q4: torch.Tensor, kv4: torch.Tensor) -> torch.Tensor:
    return kv4.repeat_interleave(q4.shape[1] // kv4.shape[1], dim=1)


def oracle(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """float64 attention of the inputs as given (already rounded to their dtype): (out, lse) in float64.

    out has q's shape; lse has shape q.shape[:-1]. Rows that see no key: out 0 and lse -inf.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    q4, k4, v4 = (_heads_view(t).to(torch.float64) for t in (q, k, v))
    k4, v4 = _expand(q4, k4), _expand(q4, v4)
    lq, lk = q4.shape[-2], k4.shape[-2]
    mask = visibility(lq, lk, causal)
    if lk == 0:
        out = torch.zeros_like(q4)
    else:
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
        dead = ~mask.any(dim=-1)
        out = out.masked_fill(dead[:, None], 0.0)  # SDPA already gives 0 here; make the definition explicit
    scores = (q4 @ k4.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if lk else torch.full(scores.shape[:-1], float("-inf"), dtype=torch.float64)
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def torch_same_dtype(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """PyTorch's own attention in q's dtype on the CPU (SDPA, explicit mask, repeated k/v): its out, q's shape."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    q4, k4, v4 = (_heads_view(t) for t in (q, k, v))
    k4, v4 = _expand(q4, k4), _expand(q4, v4)
    lq, lk = q4.shape[-2], k4.shape[-2]
    if lk == 0:
        return torch.zeros(q.shape, dtype=q.dtype)
    mask = visibility(lq, lk, causal)
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
    return out.reshape(q.shape)


def torch_same_dtype_lse(q, k, causal: bool = False, softmax_scale: float | None = None):
    """PyTorch's log-sum-exp computed in float32 (float64 for float64), for the LSE tolerance."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    q4, k4 = _heads_view(q).to(compute), _heads_view(k).to(compute)
    k4 = _expand(q4, k4)
    scores = (q4 @ k4.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visibility(q4.shape[-2], k4.shape[-2], causal), float("-inf"))
    if scores.shape[-1] == 0:
        return torch.full(q.shape[:-1], float("-inf"), dtype=compute)
    return torch.logsumexp(scores, dim=-1).reshape(q.shape[:-1])


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; equal infinities (the -inf LSE of an empty row) count as no error."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:
        return 0.0
    same_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())
    if torch.isnan(diff).any():
        return float("inf")
    return diff.max().item()


def assert_out_close(ours, q, k, v, causal=False, softmax_scale=None, *, ref=None, slack=None, what="out"):
    """ours vs the float64 oracle, within 2 x PyTorch's same-dtype error + slack."""
    assert ours.shape == q.shape, f"{what}: shape {tuple(ours.shape)} != q's {tuple(q.shape)}"
    assert ours.dtype == q.dtype, f"{what}: dtype {ours.dtype} != q's {q.dtype}"
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    if ref is None:
        ref, _ = oracle(q, k, v, causal, softmax_scale)
    ours_err = max_abs_err(ours, ref)
    torch_err = max_abs_err(torch_same_dtype(q, k, v, causal, softmax_scale), ref)
    bound = 2 * torch_err + (OUT_SLACK[q.dtype] if slack is None else slack)
    assert ours_err <= bound, f"{what}: error {ours_err:.3e} > {bound:.3e} (2 x torch's {torch_err:.3e} + slack)"
    return ours_err, torch_err


def assert_lse_close(lse, q, k, v, causal=False, softmax_scale=None, *, ref_lse=None):
    """lse: float32 `(..., Hq, Lq)`, natural log, -inf exactly where a row sees no key."""
    assert lse.shape == q.shape[:-1], f"lse shape {tuple(lse.shape)} != {tuple(q.shape[:-1])}"
    expected_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    assert lse.dtype == expected_dtype, f"lse dtype {lse.dtype} != {expected_dtype}"
    if ref_lse is None:
        _, ref_lse = oracle(q, k, v, causal, softmax_scale)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf rows differ from the oracle"
    assert not torch.isnan(lse).any() and not torch.isposinf(lse).any(), "lse: NaN or +inf"
    finite = torch.isfinite(ref_lse)
    if not finite.any():
        return
    ours_err = max_abs_err(lse[finite], ref_lse[finite])
    torch_err = max_abs_err(torch_same_dtype_lse(q, k, causal, softmax_scale)[finite], ref_lse[finite])
    magnitude = max(1.0, ref_lse[finite].abs().max().item())
    bound = 2 * torch_err + LSE_SLACK[q.dtype] * magnitude
    assert ours_err <= bound, f"lse: error {ours_err:.3e} > {bound:.3e} (2 x torch's {torch_err:.3e} + slack)"
