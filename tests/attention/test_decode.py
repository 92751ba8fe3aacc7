"""flash_attention_decode on the CPU: the reference against an independent float64 oracle, and bad input.

The Triton kernels run on the CPU in test_decode_interpreter.py and on the GPU in test_decode_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from decode_helpers import make_case, oracle, run_varlen_case
from flashmoe_science import flash_attention_decode
from flashmoe_science.attention.decode.checks import check_decode
from flashmoe_science.attention.decode.dense_backend import dense_chunk_refusal
from flashmoe_science.attention.decode.reference import apply_rotary
from flashmoe_science.attention.decode.tiles import DecodeTiles, choose_num_splits
from helpers import oracle as dense_oracle


def _gathered(case, k_cache, v_cache, b, lk):
    pos = torch.arange(lk)
    if case.block_table is None:
        return k_cache[b, :lk], v_cache[b, :lk]
    bs = k_cache.shape[1]
    blocks = case.block_table[b, pos // bs].long()
    return k_cache[blocks, pos % bs], v_cache[blocks, pos % bs]


@pytest.mark.parametrize("block_size", [None, 16, 512, 384], ids=["contiguous", "paged16", "paged512", "paged384"])
@pytest.mark.parametrize("lq,num_new", [(1, 0), (3, 0), (4, 4), (2, 5), (20, 20), (24, 0)])
def test_reference_matches_dense_oracle_on_gathered_cache(block_size, lq, num_new):
    """Causal decode = bottom-right causal attention of the new tokens over each row's gathered keys; the append
    writes k_new/v_new at cache_seqlens (into the caller's cache also where pages above 256 rows are read as
    smaller ones: `decode.pages`)."""
    case = make_case([0 if num_new else 1, 17, 32, 40], lq=lq, hq=6, hkv=2, d=32, dtype=torch.float64,
                     block_size=block_size, capacity=64, num_new=num_new)
    before_k = case.k_cache.clone()
    out, lse = flash_attention_decode(case.q, case.k_cache, case.v_cache, case.cache_seqlens,
                                      **case.kwargs(return_lse=True))
    for b, start in enumerate(case.cache_seqlens.tolist()):
        lk = start + num_new
        keys, values = _gathered(case, case.k_cache, case.v_cache, b, lk)
        if num_new:
            torch.testing.assert_close(keys[start:], case.k_new[b], rtol=0, atol=0)
            old_keys, _ = _gathered(case, before_k, before_k, b, start)
            torch.testing.assert_close(keys[:start], old_keys, rtol=0, atol=0)
        if lk == 0:
            assert (out[b] == 0).all() and torch.isneginf(lse[b]).all()
            continue
        q = case.q[b].transpose(0, 1)
        ref_out, ref_lse = dense_oracle(q, keys.transpose(0, 1), values.transpose(0, 1), causal=True)
        torch.testing.assert_close(out[b], ref_out.transpose(0, 1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[b], ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_reference_is_a_complex_rotation(interleaved):
    x = torch.randn(2, 3, 4, 32, dtype=torch.float64)
    angles = torch.randn(10, 8, dtype=torch.float64)  # rotary_dim 16 of 32
    positions = torch.tensor([[0, 1, 2], [7, 8, 9]])
    got = apply_rotary(x, angles.cos(), angles.sin(), positions, interleaved)
    rot = x[..., :16]
    pairs = torch.complex(rot[..., 0::2], rot[..., 1::2]) if interleaved else torch.complex(rot[..., :8], rot[..., 8:])
    turned = pairs * torch.polar(torch.ones((), dtype=torch.float64), angles[positions]).unsqueeze(2).to(pairs.dtype)
    expected = (torch.stack((turned.real, turned.imag), -1).flatten(-2) if interleaved
                else torch.cat((turned.real, turned.imag), -1))
    torch.testing.assert_close(got[..., :16], expected)
    torch.testing.assert_close(got[..., 16:], x[..., 16:], rtol=0, atol=0)


def test_window_softcap_alibi_reference_formula():
    """One row written out by hand: softcap, then ALiBi by distance, then the window; keys past Lk unseen."""
    case = make_case([9], lq=2, hq=2, hkv=1, d=16, dtype=torch.float64, capacity=12, alibi=True)
    out, lse = flash_attention_decode(case.q, case.k_cache, case.v_cache, case.cache_seqlens, causal=True,
                                      window=(3, 0), softcap=2.0, alibi_slopes=case.alibi_slopes, return_lse=True)
    lk, lq = 9, 2
    for h in range(2):
        for i in range(lq):
            row = i + lk - lq
            keys = list(range(row - 3, row + 1))
            s = case.q[0, i, h] @ case.k_cache[0, keys, 0].T / 4.0
            s = 2.0 * torch.tanh(s / 2.0) - case.alibi_slopes[0, h] * torch.tensor([row - j for j in keys])
            torch.testing.assert_close(lse[0, h, i], torch.logsumexp(s, 0))
            torch.testing.assert_close(out[0, i, h], torch.softmax(s, 0) @ case.v_cache[0, keys, 0])


def test_float32_reference_matches_float64_oracle():
    case = make_case([5, 31], lq=4, hq=8, hkv=2, d=32, block_size=16, capacity=48, num_new=4, rotary=True)
    out = flash_attention_decode(case.q, case.k_cache.clone(), case.v_cache.clone(), case.cache_seqlens,
                                 **case.kwargs())
    ref_out, *_ = oracle(case)
    assert (out.double() - ref_out).abs().max() < 1e-5


def _problem(batch, capacity):
    shape = (batch, capacity, 8, 128)
    return check_decode(torch.empty(batch, 1, 32, 128), torch.empty(shape), torch.empty(shape),
                        torch.zeros(batch, dtype=torch.int32), None, None, None, None, None, True, None, None, None,
                        None)


# The split counts that measured best on the H200 (132 SMs; docs/perf-notes.md, 2026-11-24), then two cases
# with nothing to split (too short; enough programs already)
MEASURED_BEST_SPLITS = [(1, 8192, 16), (32, 8192, 1), (1, 32768, 16), (8, 32768, 4), (1, 131072, 33),
                        (2, 131072, 16), (1, 1 << 20, 33), (1, 300, 1), (64, 4096, 1)]


@pytest.mark.parametrize("batch,capacity,splits", MEASURED_BEST_SPLITS)
def test_split_heuristic_from_shapes(batch, capacity, splits):
    assert choose_num_splits(_problem(batch, capacity), DecodeTiles(16, 64, 4, 3), 132) == splits


# ----------------------------------------------------------------------------------------------------------------
# Bad input


def _args(**change):
    case = make_case([3, 5], lq=2, hq=4, hkv=2, d=32, block_size=16, capacity=32, num_new=2)
    args = dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, cache_seqlens=case.cache_seqlens,
                block_table=case.block_table, k_new=case.k_new, v_new=case.v_new)
    args.update(change)
    return args


def _call(args):
    args = dict(args)
    return flash_attention_decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                  args.pop("cache_seqlens"), **args)


BAD_INPUTS = [
    ("q", lambda a: dict(q=a["q"][:, :, :, :24].contiguous()[..., :16]), "k_cache's head dim"),
    ("q_tokens", lambda a: dict(q=torch.randn(2, 0, 4, 32)), "at least one new token"),
    ("heads", lambda a: dict(q=torch.randn(2, 2, 3, 32)), "multiple of the cache"),
    ("dtype", lambda a: dict(k_cache=a["k_cache"].half()), "k_cache must be torch.float32"),
    ("table_dtype", lambda a: dict(block_table=a["block_table"].long()), "block_table must be torch.int32"),
    ("table_rows", lambda a: dict(block_table=a["block_table"][:1]), "block_table must have q's batch size"),
    ("seqlens_dtype", lambda a: dict(cache_seqlens=a["cache_seqlens"].long()), "cache_seqlens must be torch.int32"),
    ("seqlens_len", lambda a: dict(cache_seqlens=a["cache_seqlens"][:1]), "cache_seqlens must have"),
    ("new_pair", lambda a: dict(v_new=None), "k_new and v_new must be given together"),
    ("new_heads", lambda a: dict(k_new=a["k_new"][:, :, :1], v_new=a["v_new"][:, :, :1]), "k_new must have shape"),
    ("block_size", lambda a: dict(k_cache=torch.randn(9, 8, 2, 32), v_cache=torch.randn(9, 8, 2, 32)),
     "block size"),
    ("block_size_prime", lambda a: dict(k_cache=torch.randn(9, 257, 2, 32), v_cache=torch.randn(9, 257, 2, 32)),
     "or a multiple of such a size"),
    ("pages_apart", lambda a: dict(k_cache=torch.randn(9, 600, 2, 32)[:, :512], v_cache=torch.randn(9, 512, 2, 32)),
     "adjacent to the next page's"),
    ("strided", lambda a: dict(q=torch.randn(2, 2, 4, 64)[..., ::2]), "q must have unit stride"),
    ("rotary_alone", lambda a: dict(rotary_cos=torch.ones(40, 8), rotary_sin=torch.ones(40, 8), k_new=None,
                                    v_new=None), "pass k_new and v_new"),
    ("rotary_dim", lambda a: dict(rotary_cos=torch.ones(40, 20), rotary_sin=torch.ones(40, 20)), "rotary_dim"),
    ("alibi", lambda a: dict(alibi_slopes=torch.ones(3)), "alibi_slopes must be float32 of shape"),
    ("splits", lambda a: dict(num_splits=0), "num_splits"),
    ("backend", lambda a: dict(backend="cuda"), "backend must be one of"),
    ("window", lambda a: dict(window=(2,)), "window must be"),
    # value checks (on by default for CPU tensors)
    ("table_range", lambda a: dict(block_table=a["block_table"].clone().fill_(99)), r"block_table\[0, 0\] = 99"),
    ("capacity", lambda a: dict(cache_seqlens=torch.tensor([3, 31], dtype=torch.int32)), "k_new overflows"),
    ("negative", lambda a: dict(cache_seqlens=torch.tensor([3, -1], dtype=torch.int32)), ">= 0"),
    ("over", lambda a: dict(cache_seqlens=torch.tensor([3, 33], dtype=torch.int32), k_new=None, v_new=None),
     "exceeds the cache's capacity"),
    ("rotary_short", lambda a: dict(rotary_cos=torch.ones(4, 8), rotary_sin=torch.ones(4, 8)), "rotary_cos has 4"),
    ("paged_leftpad", lambda a: dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), "contiguous caches only"),
    ("paged_batch_idx", lambda a: dict(cache_batch_idx=torch.zeros(2, dtype=torch.int32)), "contiguous caches only"),
    ("leftpad_past_end", lambda a: dict(block_table=None, k_cache=torch.randn(2, 32, 2, 32), v_cache=torch.randn(2, 32, 2, 32),
                                        cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)), r"cache_leftpad"),
    ("batch_idx_range", lambda a: dict(block_table=None, k_cache=torch.randn(3, 32, 2, 32), v_cache=torch.randn(3, 32, 2, 32),
                                       cache_batch_idx=torch.tensor([0, 3], dtype=torch.int32)), r"cache_batch_idx\[1\] = 3"),
    ("fp8_scale", lambda a: dict(k_cache=a["k_cache"].to(torch.float8_e4m3fn), v_cache=a["v_cache"].to(torch.float8_e4m3fn)),
     "k_scale is required"),
    ("scale_16bit", lambda a: dict(k_scale=torch.ones(2), v_scale=torch.ones(2)), "float8_e4m3fn caches only"),
    ("check_values", lambda a: dict(check_values=1), "check_values must be a bool"),
]


@pytest.mark.parametrize("name,change,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_the_argument(name, change, message):
    args = _args()
    args.update(change(args))
    with pytest.raises((ValueError, TypeError), match=message):
        _call(args)


def test_unused_table_entries_are_not_checked():
    """Only the blocks a sequence uses must be valid (vLLM pads tables with garbage)."""
    args = _args()
    table = args["block_table"].clone()
    table[0, 1] = -7  # row 0 holds 3 + 2 keys: block 0 only
    args["block_table"] = table
    assert math.isfinite(_call(args).abs().sum().item())


def test_table_capacity_is_checked_and_exactly_full_is_not():
    """flash_attn's paged bounds case: one block of 16 per sequence; 16 cached keys + 1 new overflow block_table's
    capacity (ValueError naming it), 17 without new keys likewise; exactly 16 runs."""
    q, pool = torch.randn(1, 1, 1, 32), torch.randn(4, 16, 1, 32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    new = torch.randn(1, 1, 1, 32)
    for seqlens, extra in ((16, dict(k_new=new, v_new=new)), (17, {})):
        with pytest.raises(ValueError, match="block_table's capacity"):
            flash_attention_decode(q, pool, pool.clone(), torch.tensor([seqlens], dtype=torch.int32),
                                   block_table=table, causal=False, **extra)
    out = flash_attention_decode(q, pool, pool, torch.tensor([16], dtype=torch.int32), block_table=table)
    assert torch.isfinite(out).all()


def test_unchecked_bad_lengths_give_nan_rows_on_the_reference():
    case = make_case([3, 5, 9], lq=2, hq=4, hkv=2, d=32, dtype=torch.float64, block_size=16, capacity=32)
    case.cache_seqlens[1] = 40
    case.block_table[2, 0] = -1
    out = flash_attention_decode(case.q, case.k_cache, case.v_cache, case.cache_seqlens,
                                 **case.kwargs(check_values=False))
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1:]).all()


@pytest.mark.parametrize("lq,num_new", [(1, 0), (5, 5), (20, 0)])
def test_leftpad_batch_idx_fp8_reference_against_gathered_oracle(lq, num_new):
    """cache_leftpad / cache_batch_idx / e4m3 caches on the reference = dense float64 bottom-right attention over each
    sequence's keys [leftpad, end) of its cache row, dequantised."""
    case = make_case([6, 30, 17], lq=lq, hq=4, hkv=2, d=32, dtype=torch.float64, capacity=48, num_new=num_new,
                     leftpad=True, batch_idx=True, fp8=True)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = flash_attention_decode(case.q, k_cache, v_cache, case.cache_seqlens, **case.kwargs())
    for b in range(3):
        row, start = int(case.cache_batch_idx[b]), int(case.cache_leftpad[b])
        end = int(case.cache_seqlens[b]) + num_new
        if num_new:
            expected = (case.k_new[b].float() / case.k_scale.view(1, 2, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(k_cache[row, end - num_new : end].view(torch.uint8), expected.view(torch.uint8))
        if end == start:  # every key is padding
            assert (out[b] == 0).all()
            continue
        keys = k_cache[row, start:end].to(torch.float64) * case.k_scale.double().view(1, 2, 1)
        values = v_cache[row, start:end].to(torch.float64) * case.v_scale.double().view(1, 2, 1)
        ref, _ = dense_oracle(case.q[b].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), causal=True)
        torch.testing.assert_close(out[b], ref.transpose(0, 1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "seqused_k"])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_against_cache_reference(paged, causal):
    run_varlen_case(paged, torch.float64, 1e-12, backend="reference", causal=causal)


def test_varlen_paged_bad_cu_seqlens_q_is_named():
    from flashmoe_science import flash_attention_varlen

    q, pool = torch.randn(5, 4, 32), torch.randn(6, 16, 2, 32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seqused = torch.tensor([9, 20], dtype=torch.int32)
    for cu_q in ([0, 3, 6], [0, 4, 2], [1, 2, 5]):
        with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
            flash_attention_varlen(q, pool, pool, torch.tensor(cu_q, dtype=torch.int32), None, 4, 20,
                                   block_table=table, seqused_k=seqused)


def _chunk_problem(case, **options):
    return check_decode(case.q, case.k_cache, case.v_cache, case.cache_seqlens, case.block_table, case.k_new,
                        case.v_new, case.rotary_cos, case.rotary_sin, options.get("causal", True), None,
                        options.get("window"), options.get("softcap"), case.alibi_slopes,
                        cache_batch_idx=case.cache_batch_idx, cache_leftpad=case.cache_leftpad, k_scale=case.k_scale,
                        v_scale=case.v_scale)


@pytest.mark.parametrize("change,reason", [
    (dict(lq=16), "a decode step"), (dict(block_size=16), "paged cache"), (dict(fp8=True), "e4m3"),
    (dict(leftpad=True), "cache_leftpad"), (dict(batch_idx=True), "cache_leftpad or cache_batch_idx"),
    (dict(alibi=True), "ALiBi"), (dict(), None), (dict(rotary=True), None), (dict(lq=17), None)])
def test_which_chunks_run_the_dense_forward(change, reason):
    """The routing rule: contiguous-cache chunks of more than DECODE_ROWS rows per KV head (group 4 x Lq) with what
    the dense forward computes exactly go to it; the rest stay on the cache kernel."""
    options = dict(lq=32, hq=8, hkv=2, d=32, capacity=96, num_new=32)
    options.update(change)
    options["num_new"] = options["lq"]
    case = make_case([5, 40], **options)
    refusal = dense_chunk_refusal(_chunk_problem(case), "auto")
    assert (refusal is None) if reason is None else (reason in refusal), refusal


def test_dense_chunk_refuses_explicit_splits_and_strided_caches():
    case = make_case([5, 40], lq=32, hq=8, hkv=2, d=32, capacity=96, num_new=32)
    assert "num_splits" in dense_chunk_refusal(_chunk_problem(case), 4)
    case.k_cache = case.k_cache.transpose(0, 1).contiguous().transpose(0, 1)  # rows of one sequence not adjacent
    assert "contiguous" in dense_chunk_refusal(_chunk_problem(case), "auto")


def test_e4m3_tiles_and_splits_are_chosen_on_bytes():
    """An e4m3 key is half a bf16 key's bytes: 128-key decode tiles on a contiguous cache (64 within a 64-row page),
    and the split thresholds in bytes (B=1 8k: 16 splits of 512 bf16 keys, 8 splits of 1024 e4m3 keys)."""
    from flashmoe_science.attention.decode.tiles import decode_tiles
    from flashmoe_science.device import DeviceTraits

    h200 = DeviceTraits((9, 0), 132, 232448)
    for paged, block_n in ((None, 128), (64, 64), (256, 128)):
        case = make_case([40], hq=32, hkv=8, d=128, fp8=True, block_size=paged, capacity=512)
        assert decode_tiles(_chunk_problem(case), h200).block_n == block_n
    fp8 = make_case([8192], hq=32, hkv=8, d=128, fp8=True, capacity=8192)
    tiles = DecodeTiles(16, 128, 4, 3)
    assert choose_num_splits(_problem(1, 8192), DecodeTiles(16, 64, 4, 3), 132) == 16
    assert choose_num_splits(_chunk_problem(fp8), tiles, 132) == 8192 // 1024


def test_large_pages_are_read_as_smaller_ones():
    """`decode.pages.split_pages`: a page of B rows is B / s pages of s rows (s the largest size in [16, 256]
    dividing B), the table's entries expanded in place of each page and negative entries kept negative; views of
    the same storage. Pages in range, or that no size divides, or not adjacent in memory, are left as they are."""
    from flashmoe_science.attention.decode.pages import page_split, split_pages

    assert [page_split(b) for b in (16, 256, 512, 384, 1000, 257)] == [16, 256, 256, 192, 250, None]
    k, v = torch.randn(3, 512, 2, 8), torch.randn(3, 512, 2, 8)
    table = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    k2, v2, table2 = split_pages(k, v, table)
    assert k2.shape == (6, 256, 2, 8) and k2.data_ptr() == k.data_ptr() and v2.data_ptr() == v.data_ptr()
    assert table2.dtype == torch.int32 and table2.tolist() == [[4, 5, 0, 1], [2, 3, -1, -1]]
    assert torch.equal(k2[table2[0].long()].flatten(0, 1), k[table[0].long()].flatten(0, 1))
    for cache in (torch.randn(3, 128, 2, 8), torch.randn(3, 257, 2, 8), torch.randn(3, 600, 2, 8)[:, :512]):
        assert split_pages(cache, cache, table)[0] is cache
