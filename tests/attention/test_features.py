"""Window, softcap, ALiBi, bias and varlen on the CPU (the PyTorch reference, the CPU path): semantics against the
independent oracle (feature_oracle.py), varlen == per-sequence dense calls, the lse functions, the input checks,
and what describe_dispatch says. The Triton kernels' cases are in test_features_interpreter.py."""

from __future__ import annotations

import pytest
import torch

from feature_oracle import feature_attention, varlen_feature_attention
from flashmoe_science import flash_attention_science, flash_attention_varlen
from flashmoe_science.attention.api import attention_backward_lse, attention_forward_lse, describe_dispatch
from flashmoe_science.attention.varlen import describe_varlen_dispatch
from helpers import max_abs_err, randn

MASKS = [
    dict(),
    dict(causal=True),
    dict(window=(3, 2)),
    dict(window=(0, 0)),
    dict(window=(4, -1)),
    dict(window=(-1, 1)),
    dict(window=(5, 7), causal=True),
    dict(softcap=1.5),
    dict(causal=True, softcap=0.7, window=(6, -1)),
]


def _close(a, b, tol=1e-10):
    assert max_abs_err(a, b) <= tol, max_abs_err(a, b)


@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("lq,lk", [(9, 9), (7, 13), (13, 7), (1, 5)], ids=str)
def test_reference_masks_and_softcap(mask, lq, lk):
    q, k, v = randn(2, 4, lq, 16, dtype=torch.float64), randn(2, 2, lk, 16, dtype=torch.float64), randn(
        2, 2, lk, 16, dtype=torch.float64)
    out, lse = flash_attention_science(q, k, v, return_lse=True, **mask)
    ref, ref_lse = feature_attention(q, k, v, **mask)
    _close(out, ref)
    _close(lse, ref_lse)


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)], ids=str)
@pytest.mark.parametrize("bias_shape", [None, (13,), (4, 1, 13), (2, 1, 7, 1), (2, 4, 7, 13)], ids=str)
def test_reference_alibi_and_bias_with_gradients(slopes_shape, bias_shape):
    q, k, v = (randn(2, 4, 7, 16, dtype=torch.float64), randn(2, 2, 13, 16, dtype=torch.float64),
               randn(2, 2, 13, 16, dtype=torch.float64))
    slopes = torch.rand(slopes_shape, dtype=torch.float32)
    bias = randn(*bias_shape, dtype=torch.float64) if bias_shape else None
    kwargs = dict(window=(4, 1), softcap=2.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v) + ((bias,) if bias is not None else ())]
    out = flash_attention_science(*leaves[:3], alibi_slopes=slopes, attn_bias=leaves[3] if bias is not None
                                  else None, **kwargs)
    oracle_leaves = [t.clone().requires_grad_() for t in leaves]
    ref, _ = feature_attention(*oracle_leaves[:3], alibi=slopes, bias=oracle_leaves[3] if bias is not None else None,
                               **kwargs)
    _close(out, ref)
    grad = randn(*out.shape, dtype=torch.float64)
    for ours, theirs in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, oracle_leaves, grad)):
        _close(ours, theirs)


def _ragged(lengths_q, lengths_k, hq=4, hkv=2, d=16, dtype=torch.float64):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(int(cu_q[-1]), hq, d, dtype=dtype)
    k, v = randn(int(cu_k[-1]), hkv, d, dtype=dtype), randn(int(cu_k[-1]), hkv, d, dtype=dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(2, 1), softcap=1.0)], ids=str)
def test_varlen_reference_equals_per_sequence_dense_calls(mask):
    q, k, v, cu_q, cu_k = _ragged([5, 0, 1, 9, 3], [5, 4, 0, 11, 2])
    slopes = torch.rand(5, 4)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 9, 11, alibi_slopes=slopes, return_lse=True, **mask)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    ref, ref_lse = varlen_feature_attention(q, k, v, cu_q.tolist(), cu_k.tolist(), alibi=slopes, **mask)
    _close(out, ref)
    _close(lse, ref_lse)
    for b in range(5):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        dense, dense_lse = flash_attention_science(q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
                                                   alibi_slopes=slopes[b], return_lse=True, **mask)
        _close(out[qs], dense.transpose(0, 1))
        _close(lse[:, qs], dense_lse)


def test_varlen_reference_gradients():
    q, k, v, cu_q, cu_k = _ragged([3, 0, 6], [4, 2, 6])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention_varlen(*leaves, cu_q, cu_k, 6, 6, causal=True, softcap=3.0)
    oracle_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = varlen_feature_attention(*oracle_leaves, cu_q.tolist(), cu_k.tolist(), causal=True, softcap=3.0)
    grad = randn(*out.shape, dtype=torch.float64)
    for ours, theirs in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, oracle_leaves, grad)):
        _close(ours, theirs)


@pytest.mark.parametrize("mask", [dict(), dict(causal=True, window=(3, -1)), dict(softcap=1.0)], ids=str)
def test_lse_functions_match_autograd(mask):
    q, k, v = randn(2, 4, 9, 16, dtype=torch.float64), randn(2, 2, 11, 16, dtype=torch.float64), randn(
        2, 2, 11, 16, dtype=torch.float64)
    slopes = torch.rand(4)
    out, lse = attention_forward_lse(q, k, v, alibi_slopes=slopes, **mask)
    assert not out.requires_grad
    grad = randn(*out.shape, dtype=torch.float64)
    dq, dk, dv = attention_backward_lse(q, k, v, out, lse, grad, alibi_slopes=slopes, **mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attention_science(*leaves, alibi_slopes=slopes, **mask)
    for ours, theirs in zip((dq, dk, dv), torch.autograd.grad(ref, leaves, grad)):
        _close(ours, theirs)


def test_lse_backward_of_two_merged_key_blocks_sums_to_the_whole():
    """Ring attention's use: the backward of each key block, with the merged out and lse, sums to the full one."""
    q, k, v = randn(1, 2, 8, 16, dtype=torch.float64), randn(1, 2, 12, 16, dtype=torch.float64), randn(
        1, 2, 12, 16, dtype=torch.float64)
    out, lse = attention_forward_lse(q, k, v)
    grad = randn(*out.shape, dtype=torch.float64)
    full = attention_backward_lse(q, k, v, out, lse, grad)
    first = attention_backward_lse(q, k[:, :, :5], v[:, :, :5], out, lse, grad)
    second = attention_backward_lse(q, k[:, :, 5:], v[:, :, 5:], out, lse, grad)
    _close(first[0] + second[0], full[0])
    _close(torch.cat([first[1], second[1]], 2), full[1])
    _close(torch.cat([first[2], second[2]], 2), full[2])


# --------------------------------------------------------------------------------------------------------------
# Input checks


def _qkv():
    return randn(2, 4, 7, 16), randn(2, 2, 9, 16), randn(2, 2, 9, 16)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(window=(-2, 0)), ValueError, r"window values must be >= -1"),
    (dict(window=(3,)), TypeError, r"window must be a \(left, right\) pair"),
    (dict(window=(1.5, 2)), TypeError, r"window"),
    (dict(softcap=-1.0), ValueError, r"softcap must be finite and > 0"),
    (dict(softcap=float("inf")), ValueError, r"softcap"),
    (dict(alibi_slopes=torch.rand(3)), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
    (dict(alibi_slopes=torch.rand(4, dtype=torch.float64)), TypeError, r"alibi_slopes must be float32"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, r"alibi_slopes must be a torch.Tensor"),
    (dict(alibi_slopes=torch.rand(4, requires_grad=True)), ValueError, r"alibi_slopes must not require grad"),
    (dict(attn_bias=torch.randn(7, 8)), ValueError, r"attn_bias of shape \(7, 8\) does not broadcast"),
    (dict(attn_bias=torch.randn(3, 4, 7, 9)), ValueError, r"attn_bias .* does not broadcast to \(2, 4, 7, 9\)"),
    (dict(attn_bias=torch.ones(7, 9, dtype=torch.bool)), TypeError, r"attn_bias must be a floating-point"),
])
def test_dense_feature_checks(kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attention_science(*_qkv(), **kwargs)


def _varlen_args(**changes):
    q, k, v, cu_q, cu_k = _ragged([3, 0, 4], [2, 5, 4], dtype=torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=5)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,error,match", [
    (dict(cu_seqlens_q=torch.tensor([0, 3, 3, 7])), TypeError, r"cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 7, 11], dtype=torch.int32)[None]), ValueError, r"cu_seqlens_k must be 1-D"),
    (dict(cu_seqlens_q=torch.tensor([1, 3, 3, 7], dtype=torch.int32)), ValueError, r"cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 3, 7], dtype=torch.int32)), ValueError, r"cu_seqlens_q must be non-decr"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 7, 10], dtype=torch.int32)), ValueError,
     r"cu_seqlens_k's last entry \(10\) must equal the number of packed tokens \(11\)"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 11], dtype=torch.int32)), ValueError, r"the same length"),
    (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q \(3\) is smaller than the longest sequence \(4\)"),
    (dict(max_seqlen_k=4), ValueError, r"max_seqlen_k \(4\) is smaller"),
    (dict(max_seqlen_k=4.0), TypeError, r"max_seqlen_k must be a non-negative int"),
    (dict(q=torch.randn(2, 7, 4, 16)), ValueError, r"q must be packed \(total_tokens, heads, head_dim\)"),
    (dict(k=torch.randn(11, 3, 16), v=torch.randn(11, 3, 16)), ValueError, r"multiple of k's head count"),
])
def test_varlen_checks(changes, error, match):
    args = _varlen_args(**changes)
    with pytest.raises(error, match=match):
        flash_attention_varlen(**args)


def test_varlen_values_checked_once_per_cu_seqlens(monkeypatch):
    """The host copy of the value check runs once per pair of cu_seqlens tensors (a model's layers share them);
    an in-place write, a new tensor or other bounds check again."""
    from flashmoe_science.attention import checks

    calls = []
    check_values = checks._check_cu_seqlens_values
    monkeypatch.setattr(checks, "_check_cu_seqlens_values", lambda *a: calls.append(a) or check_values(*a))
    args = _varlen_args()
    flash_attention_varlen(**args)
    flash_attention_varlen(**args)
    assert len(calls) == 1
    flash_attention_varlen(**dict(args, max_seqlen_k=6))  # other bounds: checked again
    assert len(calls) == 2
    args["cu_seqlens_q"][1] = 5  # in place: no longer non-decreasing
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        flash_attention_varlen(**args)
    fresh = _varlen_args()
    flash_attention_varlen(**fresh)
    assert len(calls) == 4
    with torch.inference_mode():  # inference tensors have no version counter: checked on every call
        fresh = _varlen_args()
        flash_attention_varlen(**fresh)
        flash_attention_varlen(**fresh)
    assert len(calls) == 6


def test_varlen_alibi_shape_names_the_batch():
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) or \(3, 4\)"):
        flash_attention_varlen(**_varlen_args(), alibi_slopes=torch.rand(2, 4))


def test_varlen_empty_batch_and_empty_sequences():
    q, k, v, cu_q, cu_k = _ragged([0, 0], [0, 3], dtype=torch.float32)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 0, 3, return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    q, k, v, cu_q, cu_k = _ragged([2, 3], [0, 3], dtype=torch.float32)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 3, 3, return_lse=True)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isneginf(lse[:, :2]).all()
    assert torch.isfinite(lse[:, 2:]).all()


def test_describe_dispatch_names_the_features():
    q, k, v = _qkv()
    d = describe_dispatch(q, k, v, causal=True, window=(8, 0), softcap=2.0, alibi_slopes=torch.rand(4))
    assert d.backend == "reference" and "alibi, causal, softcap, window" in d.reason
    args = _varlen_args()
    d = describe_varlen_dispatch(*args.values(), causal=True)
    assert d.backend == "reference" and "causal, varlen" in d.reason


def test_each_backend_declares_its_features_in_one_place():
    from flashmoe_science.attention.features import FEATURES
    from flashmoe_science.attention.hopper import backend as hopper

    assert hopper.FORWARD_FEATURES <= set(FEATURES) and hopper.BACKWARD_FEATURES <= set(FEATURES)
    absent = hopper.missing(frozenset({"causal", "varlen", "window"}), hopper.FORWARD_FEATURES)
    assert absent == [name for name in ("causal", "window", "varlen") if name not in hopper.FORWARD_FEATURES]


@pytest.mark.parametrize("bias_shape", [(7, 9), (2, 1, 4, 7, 9), (3, 4, 1, 9)], ids=str)
def test_five_dim_inputs_index_the_extras_per_leading_index(bias_shape):
    """Leading dims that cannot merge (a transposed 5-D view) run per index: the slopes and bias follow."""
    q = randn(3, 2, 4, 7, 16, dtype=torch.float64).transpose(0, 1)
    k, v = (randn(3, 2, 2, 9, 16, dtype=torch.float64).transpose(0, 1) for _ in range(2))
    slopes, bias = torch.rand(2, 3, 4), randn(*bias_shape, dtype=torch.float64)
    out = flash_attention_science(q, k, v, attn_bias=bias, alibi_slopes=slopes, causal=True)
    full_bias = bias.expand(2, 3, 4, 7, 9)
    for i in range(2):
        for j in range(3):
            ref, _ = feature_attention(q[i, j][None], k[i, j][None], v[i, j][None], alibi=slopes[i, j],
                                       bias=full_bias[i, j][None], causal=True)
            _close(out[i, j], ref[0])
