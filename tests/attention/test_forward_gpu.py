"""Forward attention on the GPU against float64, with PyTorch's own same-dtype error as the yardstick.

Run on the H200: `PYTHONPATH=src python -m pytest -m gpu tests/attention/test_forward_gpu.py`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from flashmoe_science import flash_attention_science
from flashmoe_science.attention.reference import attention_reference, causal_visibility
from flashmoe_science.attention.hopper.tiles import sm90_cross_item_safe, sm90_smem_bytes
from flashmoe_science.attention.tiles import AttentionTiles, forward_tiles
from flashmoe_science.device import device_traits
from flashmoe_science.gluon.target import ARCH
from flashmoe_science.attention.triton.fwd import attention_forward

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


def _inputs(b, hq, hkv, lq, lk, d, dtype, layout="bhld", scale=1.0):
    def make(h, n):
        if layout == "blhd":  # (B, L, H, D) storage seen as (B, H, L, D): the no-copy transpose case
            return (torch.randn(b, n, h, d, device="cuda") * scale).to(dtype).transpose(1, 2)
        return (torch.randn(b, h, n, d, device="cuda") * scale).to(dtype)

    return make(hq, lq), make(hkv, lk), make(hkv, lk)


def _torch_same_dtype(q, k, v, causal, softmax_scale):
    """PyTorch's own attention in the inputs' dtype (SDPA with an explicit bottom-right mask when needed)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    lq, lk = q.shape[2], k.shape[2]
    if causal and lq == lk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale)
    mask = causal_visibility(lq, lk, q.device) if causal else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
    return torch.nan_to_num(out)  # rows that see no key: SDPA gives NaN, the contract is zeros


def _errors(out, ref):
    diff = (out.double() - ref).abs()
    return diff.max().item(), diff.pow(2).mean().sqrt().item()


def _assert_close_to_float64(out, q, k, v, causal, softmax_scale, dtype):
    ref, _ = attention_reference(q.double(), k.double(), v.double(), causal, softmax_scale)
    torch_out = _torch_same_dtype(q, k, v, causal, softmax_scale)
    ours_max, ours_rms = _errors(out, ref)
    torch_max, torch_rms = _errors(torch_out, ref)
    slack = 1e-5 if dtype == torch.float16 else 1e-4
    assert torch.isfinite(out).all(), "output has NaN/inf where the float64 reference is finite"
    assert ours_rms <= 2 * torch_rms + slack, f"rms error {ours_rms:.3g} vs torch {torch_rms:.3g}"
    assert ours_max <= 2 * torch_max + 10 * slack, f"max error {ours_max:.3g} vs torch {torch_max:.3g}"


def _poison_allocator():
    # Hand the caching allocator a NaN-filled block so a kernel that skips an element leaves NaN behind.
    torch.empty(64 << 20, dtype=torch.float32, device="cuda").fill_(float("nan"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen", [1, 17, 127, 128, 129, 1000, 4097])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths(dtype, seqlen, causal):
    q, k, v = _inputs(2, 4, 4, seqlen, seqlen, 64, dtype)
    _poison_allocator()
    out = flash_attention_science(q, k, v, causal=causal)
    _assert_close_to_float64(out, q, k, v, causal, 64**-0.5, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 24, 32, 40, 64, 80, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(dtype, head_dim, causal):
    q, k, v = _inputs(1, 3, 3, 300, 300, head_dim, dtype)
    _poison_allocator()
    out = flash_attention_science(q, k, v, causal=causal)
    _assert_close_to_float64(out, q, k, v, causal, head_dim**-0.5, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk", [(1, 1000), (17, 300), (300, 17), (129, 1000), (1000, 129), (64, 4097)])
@pytest.mark.parametrize("causal", [False, True])
def test_cross_lengths_with_lse(dtype, lq, lk, causal):
    q, k, v = _inputs(2, 2, 2, lq, lk, 128, dtype)
    _poison_allocator()
    out, lse = flash_attention_science(q, k, v, causal=causal, return_lse=True)
    _assert_close_to_float64(out, q, k, v, causal, 128**-0.5, dtype)
    _, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal, 128**-0.5)
    assert lse.dtype == torch.float32 and lse.shape == (2, 2, lq)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key must have lse -inf, the others finite"
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() < 2e-3
    assert (out[~seen.unsqueeze(-1).expand_as(out)] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_strided(dtype, hq, hkv, causal):
    q, k, v = _inputs(2, hq, hkv, 257, 385, 64, dtype, layout="blhd")
    assert not q.is_contiguous()
    _poison_allocator()
    out = flash_attention_science(q, k, v, causal=causal, softmax_scale=0.3)
    assert out.stride() == q.stride(), "output keeps the caller's (B, L, H, D) layout"
    _assert_close_to_float64(out, q, k, v, causal, 0.3, dtype)


@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_every_element_written(use_tma, head_dim):
    """Direct launch with NaN-poisoned outputs, both load paths, ragged tails."""
    q, k, v = _inputs(2, 4, 2, 333, 211, head_dim, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    base = forward_tiles(head_dim, q.dtype, True, device_traits(q.device))
    tiles = AttentionTiles(base.block_m, base.block_n, base.num_warps, base.num_stages, use_tma)
    attention_forward(q, k, v, out, lse, True, head_dim**-0.5, tiles)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    _assert_close_to_float64(out, q, k, v, True, head_dim**-0.5, torch.bfloat16)


@pytest.mark.parametrize("cross_item", [False, True])
@pytest.mark.parametrize("q_buffers", [1, 2])
@pytest.mark.parametrize("num_ctas", [None, 1, 7, 132])
@pytest.mark.parametrize("block_n,causal", [(128, False), (64, True), (128, True)])
@pytest.mark.parametrize("consumers,head_dim", [(2, 128), (3, 64)], ids=["two-consumers-d128", "three-consumers-d64"])
def test_sm90_work_sharing(num_ctas, block_n, causal, q_buffers, cross_item, consumers, head_dim):
    """The sm_90 kernel with any number of CTAs sharing the work items (None: one per query tile; 7: partial,
    snaking rounds), one or two Q buffers per consumer, consecutive items overlapped or not (ring stages as deep as
    causal overlap needs: tiles.sm90_cross_item_safe), two or three consumer warpgroups (128 or 192-row items),
    GQA, Lq > Lk and ragged tails, NaN-poisoned outputs."""
    if device_traits(torch.device("cuda")).arch != ARCH:
        pytest.skip("needs a Hopper GPU")
    from flashmoe_science.attention.hopper.fwd_sm90 import attention_forward_sm90

    if cross_item and q_buffers == 1:
        pytest.skip("overlapped items need two Q buffers (the launcher refuses one: test_launchers.py)")
    q, k, v = _inputs(3, 4, 2, 700, 333, head_dim, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    tiles = AttentionTiles(64 * consumers, block_n, 4 * consumers, 2, use_tma=True)
    while cross_item and not sm90_cross_item_safe(causal, tiles):
        tiles = replace(tiles, num_stages=tiles.num_stages + 1)
    if sm90_smem_bytes(tiles, head_dim, q_buffers) > device_traits(q.device).smem_per_block:
        pytest.skip("this ring and Q buffering do not fit the shared memory")
    scale = head_dim**-0.5
    attention_forward_sm90(q, k, v, out, lse, causal, scale, tiles, num_ctas, q_buffers, cross_item)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    _assert_close_to_float64(out, q, k, v, causal, scale, torch.bfloat16)
    _, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal, scale)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse))  # rows that see no key: lse -inf
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], atol=2e-2, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_autotune_mode(monkeypatch, causal):
    """FLASHMOE_AUTOTUNE=1: the Triton kernel searches tiles.forward_search_space, and stays exact."""
    from flashmoe_science.attention.triton.fwd import _autotuned_kernel

    monkeypatch.setenv("FLASHMOE_AUTOTUNE", "1")
    q, k, v = _inputs(2, 4, 2, 300, 333, 64, torch.bfloat16)
    _poison_allocator()
    out = flash_attention_science(q, k, v, causal=causal, backend="triton")
    _assert_close_to_float64(out, q, k, v, causal, 64**-0.5, torch.bfloat16)
    tuner = _autotuned_kernel(64, torch.bfloat16, device_traits(q.device))
    assert tuner.best_config is not None and len(tuner.configs) > 1


def test_shapes_2d_3d_5d():
    q2, k2, v2 = (torch.randn(70, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out2 = flash_attention_science(q2, k2, v2, causal=True)
    assert out2.shape == (70, 64)
    _assert_close_to_float64(out2[None, None], q2[None, None], k2[None, None], v2[None, None], True, 0.125, torch.bfloat16)
    q5 = torch.randn(2, 3, 4, 50, 32, device="cuda", dtype=torch.float16)
    k5 = torch.randn(2, 3, 2, 60, 32, device="cuda", dtype=torch.float16)
    v5 = torch.randn(2, 3, 2, 60, 32, device="cuda", dtype=torch.float16)
    out5, lse5 = flash_attention_science(q5, k5, v5, return_lse=True)
    assert out5.shape == q5.shape and lse5.shape == (2, 3, 4, 50)
    _assert_close_to_float64(out5.flatten(0, 1), q5.flatten(0, 1), k5.flatten(0, 1), v5.flatten(0, 1), False,
                             32**-0.5, torch.float16)


def test_float32_uses_tf32_accuracy():
    q, k, v = _inputs(2, 4, 4, 500, 500, 64, torch.float32)
    out = flash_attention_science(q, k, v, causal=True)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), True, 0.125)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert out.dtype == torch.float32 and rel < 2e-3, rel


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_logits_stay_finite(dtype):
    # q·k up to ~1e4 after scaling: the online softmax must not overflow.
    q, k, v = _inputs(1, 2, 2, 513, 513, 64, dtype, scale=12.0)
    out = flash_attention_science(q, k, v, causal=True, softmax_scale=1.0)
    assert torch.isfinite(out).all()
    _assert_close_to_float64(out, q, k, v, True, 1.0, dtype)


def test_empty_inputs():
    q = torch.randn(2, 4, 0, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 4, 10, 64, device="cuda", dtype=torch.bfloat16)
    assert flash_attention_science(q, k, k).shape == q.shape
    q = torch.randn(2, 4, 10, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 4, 0, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attention_science(q, k, k, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_one_head_of_131072_tokens_without_quadratic_memory():
    lq = 131072
    q, k, v = _inputs(1, 1, 1, lq, lq, 128, torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = flash_attention_science(q, k, v, causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 4 * q.numel() * q.element_size(), f"extra memory {extra / 2**20:.0f} MiB is not O(L)"
    # check a spread of rows against float64, the keys in full
    rows = torch.tensor([0, 1, 4095, 65536, lq - 1], device="cuda")
    scores = (q[0, 0, rows].double() @ k[0, 0].double().T) / math.sqrt(128)
    scores = scores.masked_fill(torch.arange(lq, device="cuda")[None, :] > rows[:, None], float("-inf"))
    ref = torch.softmax(scores, -1) @ v[0, 0].double()
    assert (out[0, 0, rows].double() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("backend,head_dim,dtype", [("auto", 128, torch.bfloat16), ("triton", 80, torch.float16),
                                                    ("triton", 64, torch.float32)])
def test_repeated_signature_takes_the_prepared_launch(causal, layout, backend, head_dim, dtype):
    """The second call of a signature skips the checks, the plan and Triton's binding (call.PREPARED): same
    output bit for bit as the full path, and exact on new data of that signature."""
    if backend == "auto" and device_traits(torch.device("cuda")).arch != ARCH:
        pytest.skip("needs a Hopper GPU")
    from flashmoe_science.attention import call

    def inputs():
        return _inputs(2, 8, 2, 700, 900, head_dim, dtype, layout)

    call.PREPARED.clear()
    q, k, v = inputs()
    first, first_lse = flash_attention_science(q, k, v, causal=causal, return_lse=True, backend=backend)
    assert call.prepared_key(q, k, v, causal, None, True, backend, False) in call.PREPARED
    again, again_lse = flash_attention_science(q, k, v, causal=causal, return_lse=True, backend=backend)
    assert torch.equal(first, again) and torch.equal(first_lse, again_lse)
    q2, k2, v2 = inputs()
    _poison_allocator()
    out2 = flash_attention_science(q2, k2, v2, causal=causal, backend=backend)
    assert out2.stride() == first.stride() and len(call.PREPARED) == 2  # (return_lse differs)
    _assert_close_to_float64(out2, q2, k2, v2, causal, head_dim**-0.5, dtype)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_device_that_is_not_current():
    """Triton launches on the current device; the API makes it the tensors' device for the call."""
    q, k, v = (t.to("cuda:1") for t in _inputs(1, 4, 4, 300, 300, 64, torch.bfloat16))
    with torch.cuda.device(0):
        for _ in range(2):  # full path, then the prepared launch
            out = flash_attention_science(q, k, v, causal=True)
    assert out.device == q.device
    _assert_close_to_float64(out, q, k, v, True, 64**-0.5, torch.bfloat16)
