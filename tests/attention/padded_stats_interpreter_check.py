"""Under TRITON_INTERPRET=1 (tests/attention/test_padded_stats.py's driver runs this file in its child): a packed
batch's per-row statistics in their padded layout. `seqlen.padded_row_start`, as the kernels compute it, gives every
sequence an aligned run of rows that no other sequence's meets, within `seqlen.padded_stat_rows` rows per head; and
`bwd_prep.padded_stats_kernel` writes Δ = rowsum(dO ∘ O) (against float64) and the forward's lse at each row's slot,
0 and +inf in every padding slot, and zeroes the packed dQ workspace and the padded counters."""

import random

import pytest
import torch
import triton
import triton.language as tl

from flashmoe_science.attention import bwd_prep, seqlen


@triton.jit
def _starts(CU, OUT, BLOCK: tl.constexpr):
    seq = tl.arange(0, BLOCK)
    tl.store(OUT + seq, seqlen.padded_row_start(tl.load(CU + seq), seq))


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _draw(rng, count):
    return [rng.choice((0, 1, 2, 3, 4, 5, 63, 64, 65, rng.randint(1, 300))) for _ in range(count)]


def padded_starts(lengths):
    """padded_row_start of each sequence, computed by a kernel."""
    cu = _cu(lengths)
    block = triton.next_power_of_2(len(lengths))
    padded_cu = torch.zeros(block, dtype=torch.int32)
    padded_cu[:len(lengths)] = cu[:-1]
    out = torch.empty(block, dtype=torch.int32)
    _starts[(1,)](padded_cu, out, block)
    return out[:len(lengths)].tolist()


@pytest.mark.parametrize("seed", range(4))
def test_padded_starts_are_aligned_and_disjoint(seed):
    rng = random.Random(seed)
    for _ in range(10):
        lengths = _draw(rng, rng.randint(1, 40))
        starts = padded_starts(lengths)
        rows = seqlen.padded_stat_rows(sum(lengths), len(lengths))
        assert rows % 4 == 0 and all(start % 4 == 0 for start in starts)
        ends = [start + length for start, length in zip(starts, lengths)]
        assert all(end <= nxt for end, nxt in zip(ends, starts[1:])) and ends[-1] <= rows, (lengths, starts)


def _reference(o, do, lse, lengths, rows):
    """float64 (Δ, lse) in the padded layout: each sequence's rows at its padded start, 0 and +inf elsewhere."""
    heads = o.shape[1]
    delta = torch.zeros(heads, rows, dtype=torch.float64)
    lse_padded = torch.full((heads, rows), float("inf"), dtype=torch.float64)
    real = torch.zeros(rows, dtype=torch.bool)
    first = 0
    for start, length in zip(padded_starts(lengths), lengths):
        packed = slice(first, first + length)
        delta[:, start:start + length] = (o[0, :, packed].double() * do[0, :, packed].double()).sum(-1)
        lse_padded[:, start:start + length] = lse[0, :, packed].double()
        real[start:start + length] = True
        first += length
    return delta, lse_padded, real


@pytest.mark.parametrize("head_dim,dtype", [(72, torch.float16), (128, torch.float32)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_preprocess_writes_the_padded_layout(head_dim, dtype, deterministic):
    rng = random.Random(head_dim + deterministic)
    torch.manual_seed(head_dim)
    lengths = [0, 1, 70, 3, 0, 129, 4] + _draw(rng, 6)
    total, heads, block_d = sum(lengths), 3, 128
    rows = seqlen.padded_stat_rows(total, len(lengths))
    # grad_out in a (1, L, H, D) buffer seen as (1, H, L, D): the launch reads the strides it is given
    o = torch.randn(1, heads, total, head_dim).to(dtype)
    do = torch.randn(1, total, heads, head_dim).to(dtype).transpose(1, 2)
    lse = torch.randn(1, heads, total)
    lse[0, 1, 2] = float("-inf")  # a dead row's lse is copied as it is
    lse_padded = torch.full((1, heads, rows), float("nan"))
    delta_padded = torch.full((1, heads, rows), float("nan"))
    dq_accum = torch.full((1, heads, total, block_d), float("nan"))
    semaphores = torch.full((1, heads, rows), -7, dtype=torch.int32) if deterministic else None
    kernel, grid, bound, options = bwd_prep.padded_stats_launch(o, do, lse, lse_padded, delta_padded, dq_accum,
                                                                _cu(lengths), False, semaphores)
    kernel[grid](**bound, **options)
    delta, lse_ref, real = _reference(o, do, lse, lengths, rows)
    torch.testing.assert_close(delta_padded[0].double(), delta, atol=1e-5 * head_dim, rtol=1e-5)
    assert torch.equal(lse_padded[0].double(), lse_ref)  # a copy, +inf in the padding slots
    assert torch.all(delta_padded[0][:, ~real] == 0)
    assert torch.all(dq_accum == 0)
    if deterministic:
        assert torch.all(semaphores == 0)
