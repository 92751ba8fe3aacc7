"""The serving calls on the GPU against float64 oracles: chunked prefill (hundreds of new tokens) into paged and
contiguous caches, cache_leftpad / cache_batch_idx, e4m3 caches, paged and seqused_k varlen, out-of-range values
under CUDA-graph capture, and FlashAttention's own kvcache test grid (tests/test_flash_attn.py's
test_flash_attn_kvcache parameters, a subset) through the flash_attn-shaped call.

Run on a GPU: `PYTHONPATH=src python -m pytest -q -m gpu tests/attention/test_cache_serving_gpu.py`.
"""

from __future__ import annotations

import math

import pytest
import torch

from decode_helpers import assert_decode_close, captured, make_case, run_and_check, run_varlen_case
from flashmoe_science import flash_attention_decode
from flashmoe_science.integrations.flash_attn_interface import flash_attn_with_kvcache

pytestmark = pytest.mark.gpu
CUDA = "cuda"


# Each case is a few kernel specialisations to compile (seconds each on the GPU): the parameters are paired rather
# than crossed, so that the file runs in about a minute while every value is met.
@pytest.mark.parametrize("block_size", [None, 16, 256], ids=["contiguous", "paged16", "paged256"])
@pytest.mark.parametrize("lq,group", [(17, 1), (512, 4)])
def test_chunked_prefill(block_size, lq, group):
    case = make_case([0, 1000, 2048 - lq, 300], lq=lq, hq=2 * group, hkv=2, d=128, dtype=torch.bfloat16, device=CUDA,
                     block_size=block_size, capacity=2048, num_new=lq, rotary=True)
    run_and_check(case)


@pytest.mark.parametrize("mask", [dict(window=(200, 0)), dict(window=(100, 30), causal=False), dict(softcap=30.0),
                                  dict(alibi=True)], ids=["window", "window-noncausal", "softcap", "alibi"])
def test_chunked_prefill_masks(mask):
    mask = dict(mask)
    case = make_case([100, 1500, 3000], lq=256, hq=16, hkv=4, d=128, dtype=torch.bfloat16, device=CUDA,
                     block_size=64, capacity=4096, alibi=mask.pop("alibi", False))
    run_and_check(case, **mask)


@pytest.mark.parametrize("lq,num_new", [(1, 1), (128, 128)])
def test_leftpad_and_batch_idx(lq, num_new):
    case = make_case([200, 1000, 1800], lq=lq, hq=16, hkv=4, d=128, dtype=torch.bfloat16, device=CUDA, capacity=2048,
                     num_new=num_new, rotary=num_new > 0, leftpad=True, batch_idx=True)
    run_and_check(case)


@pytest.mark.parametrize("block_size,lq,num_new,dtype", [
    (None, 1, 1, torch.bfloat16), (64, 1, 1, torch.float16), (64, 4, 4, torch.bfloat16),
    (None, 128, 128, torch.float16), (64, 128, 128, torch.bfloat16)])
def test_fp8_cache(block_size, lq, num_new, dtype):
    case = make_case([0, 700, 3000, 4096 - num_new], lq=lq, hq=32, hkv=8, d=128, dtype=dtype, device=CUDA,
                     block_size=block_size, capacity=4096, num_new=num_new, fp8=True)
    run_and_check(case)


@pytest.mark.parametrize("q_scale", [3e5, 1e-6], ids=["past-fp16-max", "tiny"])
def test_fp8_cache_bf16_queries_outside_float16_range(q_scale):
    """bf16 queries against an e4m3 cache run their products in float16 after a power-of-two shift: queries past
    float16's largest value (65504) or below its normal range give the float64 answer, not inf or zeros (large
    queries make the softmax one-hot, tiny ones uniform)."""
    case = make_case([0, 700, 3000], lq=4, hq=32, hkv=8, d=128, dtype=torch.bfloat16, device=CUDA, block_size=64,
                     capacity=4096, num_new=4, fp8=True)
    case.q = (case.q.float() * q_scale).to(torch.bfloat16)
    run_and_check(case)


@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=False), dict(causal=True, window=(40, 0))],
                         ids=["causal", "full", "window"])
@pytest.mark.parametrize("paged,dtype,atol", [(True, torch.bfloat16, 2e-2), (False, torch.float16, 3e-3)],
                         ids=["paged64-bf16", "seqused_k-fp16"])
def test_varlen_against_cache(paged, mask, dtype, atol):
    run_varlen_case(paged, dtype, atol, device=CUDA, hq=16, hkv=4, d=128, block_size=64,
                    q_lengths=(0, 1, 100, 513, 64), k_lengths=(30, 1, 900, 513, 0), **mask)


def test_capture_skips_the_check_and_bad_rows_are_nan():
    """Captured with good values (the eager warm-up checks them); replayed with a length past block_table's capacity
    in row 0 and a block outside the pool in row 1: those rows are NaN, rows 2-3 equal an eager call on their own."""
    case = make_case([100, 1500, 3000, 33], lq=2, hq=32, hkv=8, d=128, dtype=torch.bfloat16, device=CUDA,
                     block_size=64, capacity=4096, num_new=2)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()

    def call():
        return flash_attention_decode(case.q, k_cache, v_cache, case.cache_seqlens, **case.kwargs())

    graph, out = captured(call)
    case.cache_seqlens.copy_(torch.tensor([4095, 1500, 3000, 33], dtype=torch.int32))
    case.block_table[1, 3] = k_cache.shape[0] + 5
    before = k_cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[:2]).all() and torch.isfinite(out[2:]).all()
    changed = (k_cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    # rows 1-3 append into their own blocks (row 1's bad entry is not where it appends); row 0 writes nothing
    assert set(changed) <= {int(case.block_table[b, (int(case.cache_seqlens[b]) + t) // 64]) for b in (1, 2, 3)
                            for t in range(2)}
    with pytest.raises(ValueError, match="block_table's capacity"):
        call()


# FlashAttention's test_flash_attn_kvcache grid (a subset), through the flash_attn-shaped call, against the float64
# oracle (2x PyTorch's own error + slack, the rule of every decode test here; flash_attn allows 3x, 5x with ALiBi).
# Every layout with every variant once; each of flash_attn's (seqlen_q, seqlen_k) shapes twice, once per head dim.
FA_CASES = [  # (seqlen_q, seqlen_k, d, layout, variant)
    (1, 128, 128, "contiguous", "causal-rotary"),
    (1, 339, 59, "paged256", "causal-rotary"),
    (3, 1024, 128, "leftpad-batch_idx", "causal-rotary"),
    (64, 800, 59, "contiguous", "local-alibi"),
    (16, 20000, 128, "paged256", "local-alibi"),
    (1, 128, 59, "leftpad-batch_idx", "local-alibi"),
    (128, 128, 128, "contiguous", "full-newkv-interleaved"),
    (3, 1024, 59, "paged256", "full-newkv-interleaved"),
    (64, 800, 128, "leftpad-batch_idx", "full-newkv-interleaved"),
    (16, 20000, 59, "contiguous", "mqa-noappend"),
    (1, 339, 128, "paged256", "mqa-noappend"),
    (128, 128, 59, "leftpad-batch_idx", "mqa-noappend"),
]


@pytest.mark.parametrize("seqlen_q,seqlen_k,d,layout,variant", FA_CASES)
def test_flash_attn_kvcache_grid(seqlen_q, seqlen_k, d, layout, variant):
    torch.manual_seed(hash((seqlen_q, seqlen_k, d, layout, variant)) % 2**31)
    new_kv = variant != "mqa-noappend"
    if seqlen_q > seqlen_k and new_kv:
        pytest.skip("flash_attn skips new keys longer than the cache")
    causal = variant == "causal-rotary"
    local = variant == "local-alibi"
    rotary = new_kv and variant in ("causal-rotary", "full-newkv-interleaved")
    hkv = 1 if variant == "mqa-noappend" else 3
    seqlen_new = seqlen_q if variant != "full-newkv-interleaved" else max(1, seqlen_q // 2)
    num_new = seqlen_new if new_kv else 0
    top = seqlen_k - (seqlen_q if (causal or local) and rotary else num_new)
    lengths = torch.randint(0 if new_kv else 1, top + 1, (2,)).tolist()
    case = make_case(lengths, lq=seqlen_q, hq=6, hkv=hkv, d=d, dtype=torch.float16, device=CUDA,
                     block_size=256 if layout == "paged256" else None,
                     capacity=math.ceil(seqlen_k / 256) * 256 if layout == "paged256" else seqlen_k, num_new=num_new,
                     rotary=rotary, alibi=local, leftpad=layout == "leftpad-batch_idx",
                     batch_idx=layout == "leftpad-batch_idx")
    window = tuple(torch.randint(0, seqlen_k, (2,)).tolist()) if local else (-1, -1)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = flash_attn_with_kvcache(case.q, k_cache, v_cache, case.k_new, case.v_new, case.rotary_cos, case.rotary_sin,
                                  case.cache_seqlens, case.cache_batch_idx, case.cache_leftpad, case.block_table,
                                  causal=causal, window_size=window, rotary_interleaved=variant.endswith("interleaved"),
                                  alibi_slopes=case.alibi_slopes)
    torch.cuda.synchronize()
    assert_decode_close(case, out, None, k_cache if new_kv else None, v_cache if new_kv else None, causal=causal,
                        window=window, rotary_interleaved=variant.endswith("interleaved"))


@pytest.mark.parametrize("append", [False, True])
def test_flash_attn_paged_bounds(append):
    """flash_attn's test_flash_attn_kvcache_paged_block_table_bounds: one 256-key block per sequence; 256 cached keys
    plus one new, or 257 without, must raise naming block_table; exactly 256 runs."""
    q = torch.randn(1, 1, 1, 64, device=CUDA, dtype=torch.float16)
    pool = torch.randn(4, 256, 1, 64, device=CUDA, dtype=torch.float16)
    table = torch.zeros(1, 1, dtype=torch.int32, device=CUDA)
    new = torch.randn(1, 1, 1, 64, device=CUDA, dtype=torch.float16) if append else None
    seqlens = torch.full((1,), 256 if append else 257, dtype=torch.int32, device=CUDA)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, pool, pool.clone(), new, new, cache_seqlens=seqlens, block_table=table)
    out = flash_attn_with_kvcache(q, pool, pool, cache_seqlens=torch.full((1,), 256, dtype=torch.int32, device=CUDA),
                                  block_table=table)
    assert out.shape == (1, 1, 1, 64) and not out.isnan().any()


@pytest.mark.parametrize("mask", [dict(), dict(window=(300, 0)), dict(softcap=30.0), dict(rotary=True)],
                         ids=["causal", "window", "softcap", "rotary"])
def test_contiguous_chunk_runs_the_dense_forward(mask):
    """A 512-token chunk on a contiguous cache goes to the dense forward over the cache's views (`DenseChunk`),
    exact against float64 with per-row lengths (an empty cache, odd lengths, a row filled to its last position)."""
    from flashmoe_science.attention.record import recording

    mask = dict(mask)
    case = make_case([0, 1000, 4096 - 512, 77], lq=512, hq=32, hkv=8, d=128, dtype=torch.bfloat16, device=CUDA,
                     capacity=4096, num_new=512, rotary=mask.pop("rotary", False))
    with recording() as log:
        run_and_check(case, **mask)
    assert ("forward", "dense", "decode.dense_chunk") in log, log


def test_dense_chunk_under_capture_bad_rows_are_nan():
    """Captured with good values, replayed with row 0's length past the cache: row 0 is NaN, row 1 equals an eager
    call on its own."""
    case = make_case([100, 900], lq=256, hq=32, hkv=8, d=128, dtype=torch.bfloat16, device=CUDA, capacity=2048,
                     num_new=256)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()

    def call():
        return flash_attention_decode(case.q, k_cache, v_cache, case.cache_seqlens, backend="dense", **case.kwargs())

    graph, out = captured(call)
    k_cache.copy_(case.k_cache)
    v_cache.copy_(case.v_cache)
    case.cache_seqlens[0] = 2000
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[0]).all()
    single = make_case([900], lq=256, hq=32, hkv=8, d=128, dtype=torch.bfloat16, device=CUDA, capacity=2048,
                       num_new=256)
    single.q, single.k_cache, single.v_cache = case.q[1:], case.k_cache[1:], case.v_cache[1:]
    single.k_new, single.v_new = case.k_new[1:], case.v_new[1:]
    want = flash_attention_decode(single.q, single.k_cache.clone(), single.v_cache.clone(), single.cache_seqlens,
                                  backend="dense", **single.kwargs())
    torch.testing.assert_close(out[1], want[0], rtol=0, atol=0)
