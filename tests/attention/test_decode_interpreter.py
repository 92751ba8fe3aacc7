"""The decode kernels (append + rotary, split-KV, LSE combine) on the CPU under TRITON_INTERPRET=1, vs float64.

TRITON_INTERPRET must be set before triton is first imported (see test_triton_interpreter.py), so a normal run
collects only `test_decode_interpreter_in_subprocess`, which runs this file in a child pytest with the variable
set. Sizes are tiny (the interpreter runs tiles as numpy arrays): 16-key tiles, block size 16, D=32; fp16 and fp32
only (the interpreter's bf16 dot is broken). To see the cases:
`TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest tests/attention/test_decode_interpreter.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from decode_helpers import assert_decode_close, make_case, run_varlen_case
from flashmoe_science import flash_attention_decode
from interpreter_driver import interpreter_suite, run_marked_suite

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
DRIVER = "test_decode_interpreter_in_subprocess"


@pytest.mark.slow
@interpreter_suite(__file__)
def test_decode_interpreter_in_subprocess(request):
    if IN_INTERPRETER:
        pytest.skip("already under TRITON_INTERPRET=1: the cases run in this process")
    print(f"TRITON_INTERPRET=1 child: {run_marked_suite(request)}")


def _run(case, backend="triton", **options):
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out, lse = flash_attention_decode(case.q, k_cache, v_cache, case.cache_seqlens,
                                      **case.kwargs(return_lse=True, backend=backend, **options))
    mask = {name: options[name] for name in ("causal", "window", "softcap", "rotary_interleaved") if name in options}
    appended = case.k_new is not None
    assert_decode_close(case, out, lse, k_cache if appended else None, v_cache if appended else None, **mask)
    return out, lse


# Lengths per row: empty, 1, odd, a block boundary, full (capacity 48 = 3 blocks of 16)
LENGTHS = [0, 1, 17, 32, 48]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("splits", [1, 3, "auto"])
def test_lengths_and_splits(block_size, splits, dtype):
    case = make_case(LENGTHS, lq=1, hq=4, hkv=2, d=32, dtype=dtype, block_size=block_size, capacity=48)
    out, lse = _run(case, num_splits=splits)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # the empty sequence


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("lq", [1, 4])
def test_gqa_and_new_tokens(group, lq):
    # group 8 x 4 tokens = 32 rows: two 16-row tiles per KV head
    case = make_case([4, 23, 40], lq=lq, hq=2 * group, hkv=2, d=32, block_size=16, capacity=48)
    _run(case, num_splits=2)


@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("rotary,interleaved", [(False, False), (True, False), (True, True)],
                         ids=["plain", "rotary", "rotary-interleaved"])
def test_append(block_size, rotary, interleaved):
    case = make_case([0, 13, 44], lq=4, hq=4, hkv=2, d=32, block_size=block_size, capacity=48, num_new=4,
                     rotary=rotary)
    _run(case, num_splits=2, rotary_interleaved=interleaved)


def test_append_non_causal_rotary_rotates_q_at_cache_seqlens():
    case = make_case([5, 30], lq=2, hq=4, hkv=2, d=32, capacity=40, num_new=2, rotary=True)
    _run(case, causal=False)


@pytest.mark.parametrize("mask", [dict(window=(5, 0)), dict(window=(20, 3), causal=False), dict(softcap=2.5),
                                  dict(alibi=True), dict(window=(9, 0), softcap=4.0, alibi=True)],
                         ids=["window", "window-noncausal", "softcap", "alibi", "all"])
def test_masks(mask):
    mask = dict(mask)
    case = make_case([1, 19, 37], lq=3, hq=4, hkv=2, d=32, block_size=16, capacity=48, alibi=mask.pop("alibi", False))
    _run(case, num_splits=3, **mask)


@pytest.mark.parametrize("d", [40, 59])
def test_head_dim_padding(d):
    # D=40 and 59 run as 64 with masked columns (59: flash_attn's odd head dim, with an append and rotary)
    case = make_case([7, 33], lq=2, hq=2, hkv=1, d=d, capacity=40, num_new=2 if d == 59 else 0, rotary=d == 59)
    _run(case, num_splits=2)


def test_bad_values_give_nan_and_never_leave_the_cache():
    """check_values=False (what a CUDA graph needs): a length past the cache, a block-table entry outside the pool and
    a cache row out of range each make their own sequence's output NaN (never another sequence's keys); the good
    sequence is exact; no block outside the sequences' own is written, and nothing for the bad sequences."""
    case = make_case([5, 20, 9], lq=1, hq=2, hkv=1, d=32, block_size=16, capacity=32, num_new=1)
    case.block_table[1, 1] = 1000
    case.cache_seqlens[0] = 10**6
    k_cache = case.k_cache.clone()
    out = flash_attention_decode(case.q, k_cache, case.v_cache.clone(), case.cache_seqlens,
                                 **case.kwargs(backend="triton", check_values=False, num_splits=2))
    assert torch.isnan(out[:2]).all() and torch.isfinite(out[2]).all()
    good = make_case([9], lq=1, hq=2, hkv=1, d=32, block_size=16, capacity=32, num_new=1)
    good.q, good.k_cache, good.v_cache = case.q[2:], case.k_cache, case.v_cache
    good.block_table, good.k_new, good.v_new = case.block_table[2:], case.k_new[2:], case.v_new[2:]
    assert_decode_close(good, out[2:])
    changed = {block for block in range(k_cache.shape[0]) if not torch.equal(k_cache[block], case.k_cache[block])}
    assert changed == {int(case.block_table[2, 0])}


def test_bad_cache_rows_and_leftpad_give_nan():
    case = make_case([5, 20, 9], lq=3, hq=4, hkv=2, d=32, capacity=32, batch_idx=True, leftpad=True)
    case.cache_batch_idx[0] = 6
    case.cache_leftpad[1] = 21  # past the sequence's end
    out = flash_attention_decode(case.q, case.k_cache, case.v_cache, case.cache_seqlens,
                                 **case.kwargs(backend="triton", check_values=False))
    assert torch.isnan(out[:2]).all() and torch.isfinite(out[2]).all()


@pytest.mark.parametrize("block_size,lq,rotary", [(None, 24, False), (16, 19, True)],
                         ids=["contiguous", "paged16-rotary"])
def test_chunked_prefill(block_size, lq, rotary):
    """A prefill chunk of lq tokens appended to and attending its cache: several row tiles per KV head."""
    case = make_case([0, 40], lq=lq, hq=4, hkv=2, d=32, block_size=block_size, capacity=64, num_new=lq,
                     rotary=rotary)
    _run(case, num_splits=2)


@pytest.mark.parametrize("mask", [dict(window=(9, 0)), dict(window=(11, 4), causal=False), dict(softcap=3.0, alibi=True)],
                         ids=["window", "window-noncausal", "softcap-alibi"])
def test_chunked_prefill_masks(mask):
    mask = dict(mask)
    case = make_case([3, 45], lq=18, hq=6, hkv=2, d=32, block_size=16, capacity=64,
                     alibi=mask.pop("alibi", False))
    _run(case, num_splits=3, **mask)


@pytest.mark.parametrize("lq,num_new", [(1, 0), (4, 4), (17, 17)])
def test_leftpad_and_cache_batch_idx(lq, num_new):
    case = make_case([6, 30], lq=lq, hq=4, hkv=2, d=32, capacity=64, num_new=num_new, rotary=num_new > 0,
                     leftpad=True, batch_idx=True, alibi=True)
    _run(case, num_splits=2, window=(12, 0))


@pytest.mark.parametrize("block_size,lq,num_new", [(None, 1, 1), (None, 3, 0), (16, 1, 1), (16, 17, 17)],
                         ids=["contiguous-decode", "contiguous-read", "paged16-decode", "paged16-chunk"])
def test_fp8_cache(block_size, lq, num_new):
    """e4m3 caches with per-KV-head scales, appended from fp16 k_new/v_new (bit-exact e4m3 codes), against float64
    attention over the dequantised cache."""
    case = make_case([0, 40], lq=lq, hq=4, hkv=2, d=32, dtype=torch.float16, block_size=block_size,
                     capacity=64, num_new=num_new, fp8=True)
    _run(case, num_splits=2)


@pytest.mark.parametrize("mask", [dict(softcap=2.5), dict(softcap=3.0, window=(9, 0), alibi=True)],
                         ids=["softcap", "softcap-window-alibi"])
def test_fp8_cache_with_softcap(mask):
    """The key scale is folded into the softcap's scale (inside the tanh), not the log2 scalar."""
    mask = dict(mask)
    case = make_case([7, 40], lq=2, hq=4, hkv=2, d=32, dtype=torch.float16, block_size=16, capacity=64, num_new=2,
                     fp8=True, alibi=mask.pop("alibi", False))
    _run(case, num_splits=2, **mask)


def test_fp8_cache_rotary_matches_the_reference():
    """With rotary, the rotated k_new is rounded to its dtype before quantisation, by the kernel and the reference."""
    case = make_case([5, 40], lq=2, hq=4, hkv=2, d=32, dtype=torch.float16, block_size=16, capacity=64, num_new=2,
                     fp8=True, rotary=True)
    results = []
    for backend in ("triton", "reference"):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        out = flash_attention_decode(case.q, k_cache, v_cache, case.cache_seqlens, **case.kwargs(backend=backend))
        results.append((out.float(), k_cache.view(torch.uint8), v_cache.view(torch.uint8)))
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][2], results[1][2])
    assert (results[0][0] - results[1][0]).abs().max() < 2e-3


VARLEN_MASKS = [dict(causal=True), dict(causal=False), dict(causal=True, window=(6, 0)), dict(causal=True, softcap=4.0)]


@pytest.mark.parametrize("mask", VARLEN_MASKS, ids=["causal", "full", "window", "softcap"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged16", "seqused_k"])
def test_varlen_against_cache(paged, mask):
    run_varlen_case(paged, torch.float32, 1e-5, backend="triton", **mask)


# A prefill chunk (group 4 x 20 tokens = 80 rows > DECODE_ROWS) on a contiguous cache: the dense forward over the
# cache's views (`decode.DenseChunk`), against float64; cache_seqlens per row include an empty cache, an odd length
# and a row filled to the last position.
@pytest.mark.parametrize("mask", [dict(), dict(window=(7, 0)), dict(window=(12, 4), causal=False), dict(softcap=2.5),
                                  dict(rotary=True)], ids=["causal", "window", "window-noncausal", "softcap", "rotary"])
def test_dense_chunk_matches_float64(mask):
    rotary = mask.pop("rotary", False)
    case = make_case([0, 13, 44], lq=20, hq=8, hkv=2, d=32, capacity=64, num_new=20, rotary=rotary)
    out, lse = _run_dense(case, **mask)
    assert torch.isfinite(lse).all()


def test_dense_chunk_without_new_keys_and_rows_that_see_no_key():
    """Lq > Lk: bottom-right causal leaves the first rows of the short sequence without a key (0, lse -inf)."""
    case = make_case([5, 40], lq=20, hq=8, hkv=2, d=32, capacity=48)
    out, lse = _run_dense(case)
    assert (out[0, :15] == 0).all() and torch.isneginf(lse[0, :, :15]).all()


def test_dense_chunk_out_of_range_sequence_is_nan_without_checks():
    case = make_case([3, 30], lq=20, hq=8, hkv=2, d=32, capacity=48, num_new=20)
    case.cache_seqlens[1] = 40  # 40 + 20 new tokens overflow the 48 rows
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = flash_attention_decode(case.q, k_cache, v_cache, case.cache_seqlens, backend="dense", check_values=False,
                                 **case.kwargs())
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    assert torch.equal(k_cache[1], case.k_cache[1])  # nothing written for the bad row


def _run_dense(case, **options):
    from flashmoe_science.attention.record import recording

    with recording() as log:
        result = _run(case, backend="dense", **options)
    assert ("forward", "dense", "decode.dense_chunk") in log, log
    return result


if not IN_INTERPRETER:
    for _name in [n for n in list(globals()) if n.startswith("test_") and n != DRIVER]:
        del globals()[_name]
