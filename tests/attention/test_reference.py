"""The PyTorch reference (naive and tiled) and the public API on the CPU, against an independent float64 oracle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashmoe_science import flash_attention_science
from flashmoe_science.attention import reference
from flashmoe_science.attention.api import describe_dispatch
from flashmoe_science.attention.reference import attention_reference, attention_tiled, causal_visibility
from helpers import (
    DTYPES,
    OUT_SLACK,
    assert_lse_close,
    assert_out_close,
    dtype_id,
    make_qkv,
    max_abs_err,
    oracle,
    randn,
    visibility,
)

ODD_LENGTHS = (1, 17, 63, 65, 129)
HEAD_DIMS = (16, 40, 64, 80, 96, 128, 192, 256)
IMPLS = {"naive": attention_reference, "tiled": attention_tiled}


def _check_impl(fn, q, k, v, causal, scale, **kw):
    out, lse = fn(q, k, v, causal, scale, **kw)
    assert_out_close(out, q, k, v, causal, scale)
    assert_lse_close(lse, q, k, v, causal, scale)
    return out, lse


# --------------------------------------------------------------------------------------------------------------
# The mask itself


@pytest.mark.parametrize("lq,lk", [(1, 1), (5, 5), (3, 7), (7, 3), (0, 4), (4, 0), (1, 17), (17, 1)])
def test_causal_visibility_is_bottom_right(lq, lk):
    mask = causal_visibility(lq, lk)
    assert mask.dtype == torch.bool and mask.shape == (lq, lk)
    for i in range(lq):
        for j in range(lk):
            assert bool(mask[i, j]) == (j <= i + lk - lq), (i, j)
    assert torch.equal(mask, visibility(lq, lk, causal=True))


# --------------------------------------------------------------------------------------------------------------
# attention_reference / attention_tiled on 4-D tensors


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lk", ODD_LENGTHS)
@pytest.mark.parametrize("lq", ODD_LENGTHS)
def test_impl_odd_lengths(impl, lq, lk, causal):
    # Lq != Lk both ways; with causal and Lq > Lk the first Lq - Lk rows see no key (zeros, lse -inf)
    q, k, v = make_qkv((2, 2, lq, 64), (2, 2, lk, 64), torch.float32)
    out, lse = _check_impl(IMPLS[impl], q, k, v, causal, 0.125)
    if causal and lq > lk:
        dead = lq - lk
        assert torch.equal(out[:, :, :dead], torch.zeros_like(out[:, :, :dead]))
        assert torch.isneginf(lse[:, :, :dead]).all()
        assert torch.isfinite(lse[:, :, dead:]).all()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_impl_head_dims(impl, head_dim, causal):
    q, k, v = make_qkv((1, 4, 33, head_dim), (1, 2, 65, head_dim), torch.float32)
    _check_impl(IMPLS[impl], q, k, v, causal, 1 / math.sqrt(head_dim))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1), (6, 3), (8, 1)], ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_impl_gqa_mqa(impl, hq, hkv, causal):
    q, k, v = make_qkv((2, hq, 31, 32), (2, hkv, 47, 32), torch.float32)
    _check_impl(IMPLS[impl], q, k, v, causal, 1 / math.sqrt(32))
    # query head h reads kv head h // (hq // hkv): permuting the q heads of one group must not change the answer
    group = hq // hkv
    out, _ = IMPLS[impl](q, k, v, causal, 0.2)
    for h in range(hq):
        single, _ = IMPLS[impl](q[:, h : h + 1], k[:, h // group : h // group + 1], v[:, h // group : h // group + 1],
                                causal, 0.2)
        torch.testing.assert_close(out[:, h : h + 1], single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_impl_low_precision(impl, dtype, causal):
    q, k, v = make_qkv((2, 4, 65, 64), (2, 2, 63, 64), dtype)
    out, lse = _check_impl(IMPLS[impl], q, k, v, causal, 0.125)
    assert out.dtype == dtype and lse.dtype == torch.float32


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_impl_float64_tight(impl, causal):
    q, k, v = make_qkv((2, 3, 37, 48), (2, 3, 53, 48), torch.float64)
    out, lse = IMPLS[impl](q, k, v, causal, 0.3)
    ref_out, ref_lse = oracle(q, k, v, causal, 0.3)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert max_abs_err(out, ref_out) < 1e-12
    assert max_abs_err(lse, ref_lse) < 1e-12


@pytest.mark.parametrize("block_n", [1, 7, 16, 64, 100, 1000])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tiled_block_sizes_agree_with_naive(block_n, causal):
    q, k, v = make_qkv((1, 2, 70, 32), (1, 1, 129, 32), torch.float64)
    out_t, lse_t = attention_tiled(q, k, v, causal, 0.2, block_n=block_n)
    out_n, lse_n = attention_reference(q, k, v, causal, 0.2)
    assert max_abs_err(out_t, out_n) < 1e-12
    assert max_abs_err(lse_t, lse_n) < 1e-12


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_impl_no_keys(impl, causal):
    q, k, v = make_qkv((2, 2, 5, 16), (2, 1, 0, 16), torch.float32)
    out, lse = IMPLS[impl](q, k, v, causal, 0.25)
    assert torch.equal(out, torch.zeros_like(q))
    assert lse.shape == (2, 2, 5) and torch.isneginf(lse).all()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("logit_scale", [1e2, 1e3, 1e4])
def test_impl_large_logits_stay_finite(impl, dtype, logit_scale):
    # |scores| up to ~logit_scale: q and k scaled by sqrt(logit_scale), D = 64, scale 1/8 (scores ~ N(0, s^2))
    s = math.sqrt(logit_scale)
    q, k, v = make_qkv((1, 2, 33, 64), (1, 2, 47, 64), dtype, scale=s)
    for causal in (False, True):
        out, lse = IMPLS[impl](q, k, v, causal, 0.125)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_out_close(out, q, k, v, causal, 0.125)
        assert_lse_close(lse, q, k, v, causal, 0.125)


# --------------------------------------------------------------------------------------------------------------
# The public API on the CPU (auto -> reference)


def test_auto_dispatches_to_reference_on_cpu():
    q, k, v = make_qkv((1, 2, 8, 16), (1, 2, 8, 16), torch.float16)
    d = describe_dispatch(q, k, v)
    assert d.backend == "reference" and "cpu" in d.reason.lower()
    out_auto, lse_auto = flash_attention_science(q, k, v, causal=True, return_lse=True)
    out_ref, lse_ref = flash_attention_science(q, k, v, causal=True, return_lse=True, backend="reference")
    assert torch.equal(out_auto, out_ref) and torch.equal(lse_auto, lse_ref)


def _five_d_unmergeable(b0, b1, h, length, d, dtype):
    # (b0, b1, H, L, D) whose two leading dims are swapped in memory: `view(-1, H, L, D)` cannot merge them
    t = randn(b1, b0, h, length, d, dtype=dtype).transpose(0, 1)
    with pytest.raises(RuntimeError):
        t.view(-1, h, length, d)
    return t


def _layout(name, hq, hkv, lq, lk, d, dtype):
    """q, k, v in one of the user layouts the API accepts."""
    if name == "2d":
        return make_qkv((lq, d), (lk, d), dtype)
    if name == "3d":
        return make_qkv((hq, lq, d), (hkv, lk, d), dtype)
    if name == "4d":
        return make_qkv((2, hq, lq, d), (2, hkv, lk, d), dtype)
    if name == "5d":
        return make_qkv((2, 3, hq, lq, d), (2, 3, hkv, lk, d), dtype)
    if name == "5d-unmergeable":
        return tuple(_five_d_unmergeable(2, 3, h, n, d, dtype) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    if name == "strided-blhd":
        # (B, L, H, D) buffers seen as (B, H, L, D): no copy, non-contiguous
        q = randn(2, lq, hq, d, dtype=dtype).transpose(1, 2)
        k = randn(2, lk, hkv, d, dtype=dtype).transpose(1, 2)
        v = randn(2, lk, hkv, d, dtype=dtype).transpose(1, 2)
        assert not q.is_contiguous()
        return q, k, v
    if name == "packed-kv":
        # k and v are slices of one (B, L, 2, H, D) buffer
        q = randn(2, lq, hq, d, dtype=dtype).transpose(1, 2)
        kv = randn(2, lk, 2, hkv, d, dtype=dtype)
        return q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    raise AssertionError(name)


LAYOUTS = ("2d", "3d", "4d", "5d", "5d-unmergeable", "strided-blhd", "packed-kv")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lq,lk", [(17, 17), (17, 63), (65, 17)], ids=lambda x: str(x))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_api_layouts(layout, lq, lk, causal, dtype):
    hq, hkv = (1, 1) if layout == "2d" else (4, 2)
    q, k, v = _layout(layout, hq, hkv, lq, lk, 40, dtype)
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    out, lse = flash_attention_science(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert_out_close(out, q, k, v, causal)
    assert_lse_close(lse, q, k, v, causal)
    # inputs untouched
    assert torch.equal(q, q_before) and torch.equal(k, k_before) and torch.equal(v, v_before)
    # without return_lse: the same out, alone
    alone = flash_attention_science(q, k, v, causal=causal)
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_api_head_dims(head_dim, dtype):
    q, k, v = make_qkv((1, 2, 17, head_dim), (1, 1, 65, head_dim), dtype)
    for causal in (False, True):
        out, lse = flash_attention_science(q, k, v, causal=causal, return_lse=True)
        assert_out_close(out, q, k, v, causal)
        assert_lse_close(lse, q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("lq,lk", [(1, 129), (129, 1), (63, 65), (65, 63), (1, 1)], ids=lambda x: str(x))
def test_api_causal_bottom_right_dead_rows(lq, lk, dtype):
    q, k, v = make_qkv((2, 2, lq, 64), (2, 1, lk, 64), dtype)
    out, lse = flash_attention_science(q, k, v, causal=True, return_lse=True)
    assert_out_close(out, q, k, v, True)
    assert_lse_close(lse, q, k, v, True)
    dead = max(0, lq - lk)
    assert torch.equal(out[..., :dead, :], torch.zeros_like(out[..., :dead, :]))
    assert torch.isneginf(lse[..., :dead]).all() and torch.isfinite(lse[..., dead:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_api_lse_is_natural_log(dtype):
    q, k, v = make_qkv((1, 2, 9, 32), (1, 2, 13, 32), dtype)
    _, lse = flash_attention_science(q, k, v, return_lse=True, softmax_scale=0.3)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 0.3
    expected = torch.log(torch.exp(scores).sum(-1))  # natural log, written the long way
    assert max_abs_err(lse, expected) < 1e-4 * max(1.0, expected.abs().max().item())
    # lse lets a caller recover the attention weights: exp(s - lse) sums to 1 per row
    weights = torch.exp(scores - lse.double().unsqueeze(-1))
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("scale", [0.01, 0.37, 1.0, 3.0])
def test_api_custom_softmax_scale(scale, dtype):
    q, k, v = make_qkv((2, 4, 33, 64), (2, 2, 47, 64), dtype)
    for causal in (False, True):
        out, lse = flash_attention_science(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
        assert_out_close(out, q, k, v, causal, scale)
        assert_lse_close(lse, q, k, v, causal, scale)


def test_api_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = make_qkv((1, 2, 17, 80), (1, 2, 17, 80), torch.float64)
    assert reference.default_softmax_scale(80) == 1 / math.sqrt(80)
    default = flash_attention_science(q, k, v)
    explicit = flash_attention_science(q, k, v, softmax_scale=1 / math.sqrt(80))
    assert torch.equal(default, explicit)


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,), ids=dtype_id)
@pytest.mark.parametrize("length", [1, 17, 64, 129])
def test_api_matches_sdpa_is_causal_when_square(length, dtype):
    q, k, v = make_qkv((2, 4, length, 64), (2, 4, length, 64), dtype)
    ours = flash_attention_science(q, k, v, causal=True)
    sdpa64 = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    sdpa_same = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if dtype == torch.float64:
        assert max_abs_err(ours, sdpa64) < 1e-12
    else:
        err, torch_err = max_abs_err(ours, sdpa64), max_abs_err(sdpa_same, sdpa64)
        assert err <= 2 * torch_err + OUT_SLACK[dtype]


def test_api_matches_sdpa_enable_gqa():
    q, k, v = make_qkv((2, 8, 33, 64), (2, 2, 33, 64), torch.float64)
    for causal in (False, True):
        ours = flash_attention_science(q, k, v, causal=causal)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        assert max_abs_err(ours, sdpa) < 1e-12


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("logit_scale", [1e3, 1e4])
def test_api_large_logits_stay_finite(logit_scale, dtype):
    q, k, v = make_qkv((1, 2, 65, 64), (1, 1, 33, 64), dtype)
    # scores of magnitude ~logit_scale through softmax_scale (inputs stay O(1))
    scale = logit_scale / 8.0
    for causal in (False, True):
        out, lse = flash_attention_science(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
        assert torch.isfinite(out).all()
        assert not torch.isnan(lse).any() and not torch.isposinf(lse).any()
        assert_out_close(out, q, k, v, causal, scale)
        assert_lse_close(lse, q, k, v, causal, scale)


# --------------------------------------------------------------------------------------------------------------
# Autograd through the reference


@pytest.mark.parametrize("lq,lk", [(4, 4), (3, 5), (5, 3)], ids=lambda x: str(x))
def test_gradcheck_reference_causal_gqa(lq, lk):
    q = randn(1, 2, lq, 16, dtype=torch.float64).requires_grad_()
    k = randn(1, 1, lk, 16, dtype=torch.float64).requires_grad_()
    v = randn(1, 1, lk, 16, dtype=torch.float64).requires_grad_()

    def fn(q, k, v):
        out, lse = flash_attention_science(q, k, v, causal=True, return_lse=True, backend="reference")
        # dead rows (Lq > Lk) have lse -inf; their gradient through lse is not defined, so leave lse out there
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5)


def test_gradcheck_reference_layouts():
    # 3-D with a custom scale, and the 5-D unmergeable loop path
    q = randn(2, 5, 16, dtype=torch.float64).requires_grad_()
    k = randn(1, 4, 16, dtype=torch.float64).requires_grad_()
    v = randn(1, 4, 16, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention_science(q, k, v, softmax_scale=0.7, backend="reference"), (q, k, v),
        fast_mode=True,
    )
    q5, k5, v5 = (_five_d_unmergeable(2, 2, 1, 3, 16, torch.float64).requires_grad_() for _ in range(3))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention_science(q, k, v, causal=True), (q5, k5, v5), fast_mode=True
    )


def test_backward_matches_float64_sdpa():
    q, k, v = (t.requires_grad_() for t in make_qkv((2, 4, 19, 32), (2, 4, 23, 32), torch.float64))
    grad = randn(2, 4, 19, 32, dtype=torch.float64)
    mask = visibility(19, 23, causal=True)
    ours = torch.autograd.grad(flash_attention_science(q, k, v, causal=True), (q, k, v), grad)
    theirs = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), grad)
    for a, b in zip(ours, theirs):
        assert max_abs_err(a, b) < 1e-10
