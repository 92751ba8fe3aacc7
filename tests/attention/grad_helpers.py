"""Gradient oracles for the attention backward tests (CPU and GPU).

The tolerance rule is the forward's (helpers.py): our gradient error against float64 must be at most 2 x PyTorch's
own error in the same dtype (SDPA's backward in that dtype, explicit bottom-right mask, repeated k/v for GQA) plus a
small slack relative to the gradient's magnitude. The float64 oracle is written out by hand (explicit softmax) so it
shares no code with `flashmoe_science.attention.reference` and has exact zero gradients for rows that see no key.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Slack on top of 2 x torch's error, relative to max(1, max |gradient|).
GRAD_SLACK = {torch.bfloat16: 2e-3, torch.float16: 5e-4, torch.float32: 1e-5, torch.float64: 1e-10}


def bottom_right_visibility(lq: int, lk: int, causal: bool, device=None) -> torch.Tensor:
    """(Lq, Lk) boolean: query i sees key j iff j <= i + Lk - Lq (causal), else all True."""
    rows = torch.arange(lq, device=device)[:, None]
    cols = torch.arange(lk, device=device)[None, :]
    return (cols <= rows + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool, device=device)


def _grads(fn, q, k, v, grad_out, compute_dtype):
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, grad_out.to(compute_dtype))


def oracle_grads(q, k, v, grad_out, causal=False, softmax_scale=None):
    """float64 (dq, dk, dv) of 4-D `(B, H, L, D)` inputs as given. Rows that see no key have zero gradients."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    mask = bottom_right_visibility(q.shape[2], k.shape[2], causal, q.device)
    alive = mask.any(dim=-1, keepdim=True)

    def attention(q64, k64, v64):
        k64, v64 = k64.repeat_interleave(group, dim=1), v64.repeat_interleave(group, dim=1)
        scores = (q64 @ k64.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask & alive, float("-inf"))  # a dead row keeps finite scores...
        weights = torch.softmax(scores, dim=-1) * alive  # ...and is multiplied by 0: exact zero gradients
        return weights @ v64

    return _grads(attention, q, k, v, grad_out, torch.float64)


def torch_same_dtype_grads(q, k, v, grad_out, causal=False, softmax_scale=None):
    """PyTorch's own (dq, dk, dv) in q's dtype: SDPA backward with an explicit bottom-right mask when causal."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    group = q.shape[1] // k.shape[1]
    # Causal with Lq > Lk: the first Lq - Lk queries see no key (zero gradient by definition). SDPA gets only the
    # other rows, so no kernel ever meets a fully masked row (some give NaN there).
    dead = max(q.shape[2] - k.shape[2], 0) if causal else 0
    lq, lk = q.shape[2] - dead, k.shape[2]

    def attention(qx, kx, vx):
        kx, vx = kx.repeat_interleave(group, dim=1), vx.repeat_interleave(group, dim=1)
        if causal and lq == lk:
            return F.scaled_dot_product_attention(qx, kx, vx, is_causal=True, scale=scale)
        mask = bottom_right_visibility(lq, lk, causal, q.device) if causal else None
        return F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask, scale=scale)

    dq, dk, dv = _grads(attention, q[:, :, dead:], k, v, grad_out[:, :, dead:], q.dtype)
    dq = torch.cat([torch.zeros_like(q[:, :, :dead]), dq], dim=2)
    return dq, dk, dv


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    if a.numel() == 0:
        return 0.0
    diff = (a - b).abs()
    return float("inf") if torch.isnan(diff).any() else diff.max().item()


def assert_grads_close(ours, q, k, v, grad_out, causal=False, softmax_scale=None, *, names=("dq", "dk", "dv"),
                       baseline=None):
    """Each gradient in `ours` (None to skip) vs float64, within 2 x torch's same-dtype error + slack.

    `q, k, v, grad_out` are 4-D `(B, H, L, D)` (any strides). `baseline` overrides torch's same-dtype gradients
    (e.g. TF32 is not what SDPA does in float32)."""
    ref = oracle_grads(q, k, v, grad_out, causal, softmax_scale)
    base = torch_same_dtype_grads(q, k, v, grad_out, causal, softmax_scale) if baseline is None else baseline
    report = {}
    for name, g, r, b, x in zip(names, ours, ref, base, (q, k, v)):
        if g is None:
            continue
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {g.shape}/{g.dtype} != {x.shape}/{x.dtype}"
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        ours_err, torch_err = max_abs_err(g, r), max_abs_err(b, r)
        bound = 2 * torch_err + GRAD_SLACK[x.dtype] * max(1.0, r.abs().max().item())
        assert ours_err <= bound, f"{name}: error {ours_err:.3e} > {bound:.3e} (2 x torch's {torch_err:.3e} + slack)"
        report[name] = (ours_err, torch_err)
    return report
