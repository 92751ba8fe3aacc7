"""flash_attention_decode's Triton kernels on the GPU against the float64 oracle on the gathered cache.

Run on the H200: `PYTHONPATH=src python -m pytest -q -m gpu tests/attention/test_decode_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from decode_helpers import DecodeCase, assert_decode_close, captured, make_case, run_and_check
from flashmoe_science import flash_attention_decode

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _lengths(batch: int, capacity: int, block: int, num_new: int = 0) -> list[int]:
    """1, odd, a block boundary, full (after the append), then random."""
    top = capacity - num_new
    fixed = [1, 1001 if top > 1001 else top // 2 | 1, min(3 * block, top), top]
    return (fixed + torch.randint(0, top + 1, (batch,)).tolist())[:batch]


@pytest.mark.parametrize("block_size", [None, 16, 64, 256], ids=["contiguous", "paged16", "paged64", "paged256"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("lq", [1, 4])
def test_lengths_layouts_gqa(block_size, group, lq):
    capacity = 4096
    case = make_case(_lengths(6, capacity, block_size or 64), lq=lq, hq=2 * group, hkv=2, d=128,
                     dtype=torch.bfloat16, device=CUDA, block_size=block_size, capacity=capacity)
    run_and_check(case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_dtypes_and_head_dims(dtype, head_dim):
    case = make_case(_lengths(4, 2048, 64), lq=2, hq=8, hkv=2, d=head_dim, dtype=dtype, device=CUDA, block_size=64,
                     capacity=2048)
    run_and_check(case)


@pytest.mark.parametrize("splits", [1, 5, 128, "auto"])
def test_num_splits(splits):
    case = make_case(_lengths(3, 8192, 64), lq=1, hq=32, hkv=8, d=128, dtype=torch.bfloat16, device=CUDA,
                     block_size=64, capacity=8192)
    run_and_check(case, num_splits=splits)


@pytest.mark.parametrize("block_size", [None, 16, 256], ids=["contiguous", "paged16", "paged256"])
@pytest.mark.parametrize("rotary,interleaved", [(False, False), (True, False), (True, True)],
                         ids=["append", "rotary", "rotary-interleaved"])
@pytest.mark.parametrize("lq", [1, 4])
def test_append_and_rotary(block_size, rotary, interleaved, lq):
    case = make_case(_lengths(5, 2048, block_size or 64, num_new=lq), lq=lq, hq=16, hkv=4, d=128,
                     dtype=torch.bfloat16, device=CUDA, block_size=block_size, capacity=2048, num_new=lq,
                     rotary=rotary)
    run_and_check(case, rotary_interleaved=interleaved)


@pytest.mark.parametrize("mask", [dict(window=(256, 0)), dict(window=(100, 50), causal=False), dict(softcap=30.0),
                                  dict(alibi=True), dict(window=(700, 0), softcap=20.0, alibi=True)],
                         ids=["window", "window-noncausal", "softcap", "alibi", "all"])
@pytest.mark.parametrize("block_size", [None, 64], ids=["contiguous", "paged64"])
def test_masks(mask, block_size):
    mask = dict(mask)
    case = make_case(_lengths(4, 4096, 64), lq=4, hq=16, hkv=2, d=128, dtype=torch.bfloat16, device=CUDA,
                     block_size=block_size, capacity=4096, alibi=mask.pop("alibi", False))
    run_and_check(case, **mask)


def test_cuda_graph_capture_and_replay():
    """Captured once with an append (k_new + rotary) and split-KV; replayed with new lengths, queries and tokens
    written into the static inputs: each replay equals an eager call on the same values."""
    case = make_case([100, 1500, 3000, 4000], lq=2, hq=32, hkv=8, d=128, dtype=torch.bfloat16, device=CUDA,
                     block_size=64, capacity=4096, num_new=2, rotary=True)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    kwargs = case.kwargs(return_lse=True)

    def call():
        return flash_attention_decode(case.q, k_cache, v_cache, case.cache_seqlens, **kwargs)

    graph, (out, lse) = captured(call)
    for step in range(3):
        case.cache_seqlens.copy_(torch.tensor([7 + step, 2000 - step, 33, 4094], dtype=torch.int32))
        case.q.copy_(torch.randn_like(case.q))
        case.k_new.copy_(torch.randn_like(case.k_new))
        k_eager, v_eager = k_cache.clone(), v_cache.clone()
        graph.replay()
        expected_out, expected_lse = flash_attention_decode(case.q, k_eager, v_eager, case.cache_seqlens, **kwargs)
        torch.cuda.synchronize()
        assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
        assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged256"])
def test_one_million_token_context(paged):
    """B=1, Hkv=8, D=128, 1M keys (2**30 elements per cache), appending the last token. Paged: the blocks are
    scattered over a pool of 2.25M tokens, so block offsets pass 2**31 elements."""
    capacity = 1 << 20
    torch.cuda.empty_cache()
    case = make_case([capacity - 1], lq=1, hq=32, hkv=8, d=128, dtype=torch.bfloat16, device=CUDA,
                     block_size=256 if paged else None, capacity=capacity, num_new=1,
                     spare_blocks=(capacity // 256 + 1024) if paged else 0)
    if paged:
        assert case.block_table.max().item() * case.k_cache[0].numel() >= 2**31
    out, lse = flash_attention_decode(case.q, case.k_cache, case.v_cache, case.cache_seqlens,
                                      **case.kwargs(return_lse=True))
    torch.cuda.synchronize()
    # The oracle takes the cache as it stands after the append (no second copy of 8 GiB of keys and values).
    after = DecodeCase(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache,
                       cache_seqlens=case.cache_seqlens + 1, block_table=case.block_table)
    assert_decode_close(after, out, lse)
    new_row = (case.block_table[0, -1].long(), 255) if paged else (0, capacity - 1)
    assert torch.equal(case.k_cache[new_row], case.k_new[0, 0])
