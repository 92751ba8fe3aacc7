"""The oracle of the masked/modified attention (window, softcap, ALiBi, bias, varlen), written from the
definitions in the front doors' docstrings and sharing no code with `flashmoe_science` (its reference or mask module).

`feature_attention` computes out and lse in any dtype with an explicit softmax: float64 is the oracle, q's own dtype
is "PyTorch's same-dtype error" for the tolerance rule (helpers.py: ours <= 2 x torch's + slack). It is
differentiable (autograd gives the float64 gradients, exact zeros for rows that see no key).
"""

from __future__ import annotations

import math

import torch

from helpers import LSE_SLACK, OUT_SLACK, max_abs_err

GRAD_SLACK = {torch.bfloat16: 2e-3, torch.float16: 5e-4, torch.float32: 1e-5, torch.float64: 1e-10}


def window_visibility(lq: int, lk: int, causal: bool, window, device=None) -> torch.Tensor:
    """query i sees key j iff i + Lk - Lq - left <= j <= i + Lk - Lq + right (-1: unbounded); causal: right = 0."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    seen = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if right != -1:
        seen &= j <= i + lk - lq + right
    if left != -1:
        seen &= j >= i + lk - lq - left
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
        slopes = alibi.to(device=q.device, dtype=dtype).expand(q.shape[0], q.shape[1])
        dist = (torch.arange(lq, device=q.device)[:, None] + lk - lq
                - torch.arange(lk, device=q.device)[None, :]).abs().to(dtype)
        s = s - slopes[:, :, None, None] * dist
    if bias is not None:
        s = s + bias.to(dtype)
    seen = window_visibility(lq, lk, causal, window, q.device)
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


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def check_forward_and_grads(run, oracle, inputs, dtype, names):
    """Our out, lse and gradients (`run(*leaves) -> (out, lse)`) against the float64 oracle
    (`oracle(*leaves, compute_dtype) -> (out, lse)`), within 2 x the oracle's own error in `dtype` + slack."""
    ours_leaves = _leaves(*inputs)
    out, lse = run(*ours_leaves)
    grad = torch.randn(out.shape, device=out.device).to(dtype)
    ours_grads = torch.autograd.grad(out, ours_leaves, grad)
    ref_leaves = _leaves(*(t.double() for t in inputs))
    ref, ref_lse = oracle(*ref_leaves, torch.float64)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad.double())
    same_leaves = _leaves(*inputs)
    same, same_lse = oracle(*same_leaves, dtype)
    same_grads = torch.autograd.grad(same, same_leaves, grad)
    assert_within_rule("out", out.cpu(), ref.cpu(), same.cpu(), dtype)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf rows differ"
    finite = torch.isfinite(ref_lse)
    assert_within_rule("lse", lse[finite].cpu(), ref_lse[finite].cpu(), same_lse.float()[finite].cpu(), dtype,
                       LSE_SLACK, relative=True)
    for name, g, r, s in zip(names, ours_grads, ref_grads, same_grads):
        assert_within_rule(name, g.cpu(), r.cpu(), s.cpu(), dtype, GRAD_SLACK, relative=True)


def assert_varlen_equals_dense(out, q, k, v, cu_q, cu_k, **kwargs):
    """Each packed sequence's rows of `out` equal, bit for bit, the dense call (flash_attention_science with
    `kwargs`) on that sequence alone (sequences without queries or keys are skipped)."""
    from flashmoe_science import flash_attention_science

    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qs.stop > qs.start and ks.stop > ks.start:
            dense = flash_attention_science(q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
                                            **kwargs)
            assert torch.equal(out[qs], dense.transpose(0, 1)), f"sequence {b}"


def assert_backward_bit_identical(fn, inputs):
    """Two backward passes of `fn(*inputs)` with the same incoming gradient give bit-identical gradients."""
    grad, runs = None, []
    for _ in range(2):
        leaves = _leaves(*inputs)
        out = fn(*leaves)
        grad = torch.randn(out.shape, device=out.device).to(out.dtype) if grad is None else grad
        runs.append(torch.autograd.grad(out, leaves, grad))
    for first, second in zip(*runs):
        assert torch.equal(first, second)
