"""The cache kernels (append, split-KV attention, combine) compiled offline for sm_90 without a GPU, in the
configurations the interpreter cannot reach: key tiles wider than a page (per-row block-table reads), the prefill
tiles of a long chunk, e4m3 caches (fp8 loads and conversions), packed queries. The launches are recorded through
the real front door (`decode.triton_backend.TritonDecode.run`) and compiled as the JIT would specialise them. Numerics:
test_decode_interpreter.py, test_decode_gpu.py, test_cache_serving_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("compiles for sm_90; the interpreter runs the kernels elsewhere", allow_module_level=True)

from decode_helpers import make_case  # noqa: E402
from flashmoe_science.attention.tiles import forward_tiles  # noqa: E402
from flashmoe_science.attention.triton import decode as triton_decode  # noqa: E402
from flashmoe_science.attention.decode import checks, triton_backend  # noqa: E402
from flashmoe_science.attention.decode import problem as decode_problem  # noqa: E402
from flashmoe_science.attention.decode.tiles import decode_tiles  # noqa: E402
from test_features_build import H200, _compile, _Recorder  # noqa: E402


def _record(monkeypatch, call, problem, splits):
    recorders = {name: _Recorder(getattr(triton_decode, name))
                 for name in ("_append_kernel", "_decode_kernel", "_combine_kernel")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(triton_decode, name, recorder)
    tiles = decode_tiles(problem, H200)
    triton_backend.TritonDecode(tiles, splits).run(call, problem)
    return tiles, recorders


def _compile_all(recorders, expected):
    for name, recorder in recorders.items():
        assert len(recorder.calls) == (name in expected), name
        for bound, options in recorder.calls:
            assert _compile(recorder.kernel, bound, options).asm.get("cubin"), name


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("lq", [1, 300])
def test_paged_append_rotary_masks_compile(monkeypatch, fp8, lq):
    """Page 16 under 64-key tiles (per-row table reads, the outside-the-pool flag per tile), append with rotary,
    window + ALiBi, GQA 4, three splits; lq 300 takes the prefill tiles."""
    case = make_case([5, 700], lq=lq, hq=16, hkv=4, d=128, dtype=torch.bfloat16, block_size=16, capacity=1024,
                     num_new=lq, rotary=True, alibi=True, fp8=fp8)
    problem = checks.check_decode(case.q, case.k_cache, case.v_cache, case.cache_seqlens, case.block_table,
                                  case.k_new, case.v_new, case.rotary_cos, case.rotary_sin, True, None, (256, 0), None,
                                  case.alibi_slopes, k_scale=case.k_scale, v_scale=case.v_scale)
    call = decode_problem.CacheCall(case.q, case.k_cache, case.v_cache, case.cache_seqlens, None, None, case.block_table,
                            None, case.k_new, case.v_new, case.rotary_cos, case.rotary_sin, False, case.alibi_slopes,
                            case.k_scale, case.v_scale)
    tiles, recorders = _record(monkeypatch, call, problem, 3)
    assert tiles.block_n > 16  # wider than a page
    _compile_all(recorders, {"_append_kernel", "_decode_kernel", "_combine_kernel"})


def test_contiguous_leftpad_batch_idx_softcap_compile(monkeypatch):
    case = make_case([30, 900], lq=129, hq=8, hkv=8, d=64, dtype=torch.float16, capacity=1200, num_new=129,
                     leftpad=True, batch_idx=True)
    problem = checks.check_decode(case.q, case.k_cache, case.v_cache, case.cache_seqlens, None, case.k_new,
                                  case.v_new, None, None, True, None, None, 30.0, None,
                                  cache_batch_idx=case.cache_batch_idx, cache_leftpad=case.cache_leftpad)
    call = decode_problem.CacheCall(case.q, case.k_cache, case.v_cache, case.cache_seqlens, case.cache_leftpad,
                            case.cache_batch_idx, None, None, case.k_new, case.v_new)
    tiles, recorders = _record(monkeypatch, call, problem, 1)
    prefill = forward_tiles(64, torch.float16, True, H200)  # 129 tokens x group 1: the dense forward's tiles
    assert (tiles.block_m, tiles.block_n, tiles.num_warps) == (prefill.block_m, prefill.block_n, prefill.num_warps)
    _compile_all(recorders, {"_append_kernel", "_decode_kernel"})


def test_packed_queries_against_a_paged_cache_compile(monkeypatch):
    q = torch.randn(700, 16, 128).to(torch.bfloat16)
    pool = torch.randn(40, 64, 4, 128).to(torch.bfloat16)
    cu_q = torch.tensor([0, 1, 500, 700], dtype=torch.int32)
    table = torch.arange(39, dtype=torch.int32)[:39].view(3, 13)
    seqused = torch.tensor([800, 500, 600], dtype=torch.int32)
    problem = checks.check_cache_varlen(q, pool, pool, cu_q, 499, table, True, None, None, None, None)
    call = decode_problem.CacheCall(q, pool, pool, seqused, None, None, table, cu_q)
    _, recorders = _record(monkeypatch, call, problem, 2)
    _compile_all(recorders, {"_decode_kernel", "_combine_kernel"})


def _decode_step_build(monkeypatch, page):
    """The split-KV kernel of a serving decode step (GQA 32/8, D=128, bf16, one token, pages of `page`) built for
    sm_90: (shared memory bytes, cp.async count)."""
    case = make_case([300, 640], lq=1, hq=32, hkv=8, d=128, dtype=torch.bfloat16, block_size=page, capacity=1024)
    problem = checks.check_decode(case.q, case.k_cache, case.v_cache, case.cache_seqlens, case.block_table,
                                  None, None, None, None, True, None, (-1, -1), None, None)
    call = decode_problem.CacheCall(case.q, case.k_cache, case.v_cache, case.cache_seqlens, None, None,
                                    case.block_table)
    with monkeypatch.context() as patch:
        _, recorders = _record(patch, call, problem, 1)
    (bound, options), = recorders["_decode_kernel"].calls
    compiled = _compile(recorders["_decode_kernel"].kernel, bound, options)
    return compiled.metadata.shared, compiled.asm["ptx"].count("cp.async.cg") + compiled.asm["ptx"].count("cp.async.ca")


def test_a_tile_wider_than_its_page_keeps_the_pipeline(monkeypatch):
    """Pages of 16 under 64-key tiles read one table entry per key; read a tile ahead, the K/V loads pipeline as
    with one entry per tile (pages of 64): the same stages of shared memory and the same asynchronous copies. Read
    inside the iteration, the build held one buffer (39 KB against 72 KB)."""
    assert _decode_step_build(monkeypatch, 16) == _decode_step_build(monkeypatch, 64)
