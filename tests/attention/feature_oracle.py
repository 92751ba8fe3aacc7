"""The oracle of the masked/modified attention (window, softcap, ALiBi, bias, varlen), written from the issue's
definitions and sharing no code with `flashmoe_science` (its reference or mask module).

`feature_attention` computes out and lse in any dtype with an explicit softmax: float64 is the oracle, q's own dtype
is "PyTorch's same-dtype error" for the tolerance rule (helpers.py: ours <= 2 x torch's + slack). It is
differentiable (autograd gives the float64 gradients, exact zeros for rows that see no key).
"""

from __future__ import annotations

import math

import torch

from helpers import OUT_SLACK, max_abs_err

GRAD_SLACK = {torch.bfloat16: 2e-3, torch.float16: 5e-4, torch.float32: 1e-5, torch.float64: 1e-10}


def window_visibility(lq: int, lk: int, causal: bool, window) -> torch.Tensor:
    """query i sees key j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right (-1: unbounded); causal: right = 0."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    seen = torch.ones(lq, lk, dtype=torch.bool)
    for i in range(lq):
        for j in range(lk):
            d = i + lk - lq
            if right != -1 and j > d + right:
                seen[i, j] = False
            if left != -1 and j < d - left:
                seen[i, j] = False
    return seen


def feature_attention(q, k, v, *, causal=False, window=None, softcap=None, alibi=None, bias=None,
                      scale=None, dtype=torch.float64):
    """(out, lse) of 4-D q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D) computed in `dtype`. alibi: (Hq,) or (B, Hq);
    bias broadcastable to (B, Hq, Lq, Lk)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    qx, kx, vx = q.to(dtype), k.to(dtype).repeat_interleave(group, 1), v.to(dtype).repeat_interleave(group, 1)
    lq, lk = q.shape[2], k.shape[2]
    s = (qx @ kx.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        slopes = alibi.to(dtype).expand(q.shape[0], q.shape[1])
        dist = (torch.arange(lq)[:, None] + lk - lq - torch.arange(lk)[None, :]).abs().to(dtype)
        s = s - slopes[:, :, None, None] * dist
    if bias is not None:
        s = s + bias.to(dtype)
    seen = window_visibility(lq, lk, causal, window)
    alive = seen.any(-1, keepdim=True)
    s = s.masked_fill(~seen & alive, float("-inf"))  # a dead row keeps finite scores and is multiplied by 0
    weights = torch.softmax(s, dim=-1) * alive
    lse = torch.where(alive, torch.logsumexp(s.masked_fill(~seen, float("-inf")), -1, keepdim=True),
                      torch.full_like(s[..., :1], float("-inf"))).squeeze(-1) if lk else s.sum(-1) - math.inf
    return weights @ vx, lse


def varlen_feature_attention(q, k, v, cu_q, cu_k, *, alibi=None, dtype=torch.float64, **kwargs):
    """Packed (total, H, D) inputs: each sequence through `feature_attention` on its own; lse (H, total_q)."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        o, l = feature_attention(q[qs].transpose(0, 1)[None], k[ks].transpose(0, 1)[None],
                                 v[ks].transpose(0, 1)[None], alibi=slopes, dtype=dtype, **kwargs)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def assert_within_rule(name, ours, ref64, same_dtype, dtype, slack_table=OUT_SLACK, relative=False):
    """ours vs float64 within 2 x (PyTorch's same-dtype error) + slack (relative to max |ref| when asked)."""
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(ours).any(), f"{name}: NaN"
    ours_err, torch_err = max_abs_err(ours, ref64), max_abs_err(same_dtype, ref64)
    finite = ref64[torch.isfinite(ref64)]
    magnitude = max(1.0, finite.abs().max().item()) if relative and finite.numel() else 1.0
    bound = 2 * torch_err + slack_table[dtype] * magnitude
    assert ours_err <= bound, f"{name}: error {ours_err:.3e} > {bound:.3e} (2 x torch's {torch_err:.3e} + slack)"
