"""Ring attention in 2 and 4 CPU processes (gloo): outputs and gradients equal the single-process result on the full
sequence (ring_cases.py; all cases of a world size run in one spawn, conftest.py)."""

import re

import pytest

import ring_cases
import torch

from flashmoe_science.distributed.ring_attention import Block, _plan_step, _Ring, coalesce
from flashmoe_science.distributed.zigzag import (chunk_starts, sequence_shards, shard_chunks, shard_lengths,
                                                zigzag_positions)


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("case", ring_cases.CASES)
def test_ring_attention(distributed_case, world_size, case):
    distributed_case(world_size, f"ring_cases.{case}")


def test_zigzag_layout():
    assert chunk_starts(10, 2) == [0, 3, 6, 8, 10]
    assert [(c.global_start, c.length) for c in shard_chunks(10, 2, 0)] == [(0, 3), (8, 2)]
    assert [(c.local_start, c.global_start, c.length) for c in shard_chunks(10, 2, 1)] == [(0, 3, 3), (3, 6, 2)]
    assert shard_lengths(3, 2) == [1, 2]
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert sorted(sum((zigzag_positions(13, 3, r).tolist() for r in range(3)), [])) == list(range(13))
    with pytest.raises(ValueError, match="rank"):
        shard_chunks(8, 2, 2)


def test_zigzag_layout_varlen():
    # two sequences (10 and 3 tokens) over 2 ranks: each split on its own, packed sequence after sequence
    assert shard_lengths([10, 3], 2) == [6, 7]
    (a0, a1), (b0, b1) = sequence_shards([10, 3], 2, 1)
    assert [(c.local_start, c.global_start, c.length) for c in (a0, a1, b0, b1)] == [
        (0, 3, 3), (3, 6, 2), (5, 11, 1), (6, 12, 1)]
    assert zigzag_positions(None, 2, 1, cu_seqlens=[0, 10, 13]).tolist() == [3, 4, 5, 6, 7, 1, 2]
    with pytest.raises(ValueError, match="cu_seqlens"):
        zigzag_positions(None, 2, 0, cu_seqlens=[0, 5, 3])


def test_causal_steps_are_one_call_each():
    # zig-zag causal: own shard causal, an earlier shard seen whole by both chunks, a later one by the second chunk
    mine, earlier, later = (shard_chunks(16, 4, r) for r in (1, 0, 2))
    (own,) = _plan_step(mine, mine, True, None, True)
    assert own.causal and own.q_rows == slice(0, 4) and own.k_rows == slice(0, 4)
    (before,) = _plan_step(mine, earlier, True, None, False)
    assert not before.causal and before.q_rows == slice(0, 4) and before.k_rows == slice(0, 2)
    (after,) = _plan_step(mine, later, True, None, False)
    assert not after.causal and after.q_rows == slice(2, 4) and after.k_rows == slice(0, 4)
    assert _plan_step(mine, earlier, False, (0, 0), False) == []  # a diagonal window sees no other shard


@pytest.mark.slow
def test_ring_attention_triton_kernels_interpreted():
    # a spawn of its own: TRITON_INTERPRET=1 must be set before triton is imported
    from dist_spawn import run_cases

    error = run_cases(["ring_interpreter_cases.ring_triton_kernels"], 2, env={"TRITON_INTERPRET": "1"})[
        "ring_interpreter_cases.ring_triton_kernels"]
    if error is not None:
        pytest.fail(error, pytrace=False)


def _visible_pairs(block: Block) -> int:
    """(query, key) pairs a kernel call attends to: its rectangle under its bottom-right aligned mask."""
    rows, keys = block.q_rows.stop - block.q_rows.start, block.k_rows.stop - block.k_rows.start
    offset = torch.arange(keys).unsqueeze(0) - torch.arange(rows).unsqueeze(1) - (keys - rows)  # j - i - diagonal
    left, right = block.window if block.window is not None else (-1, -1)
    right = 0 if block.causal else right
    seen = torch.ones(rows, keys, dtype=torch.bool)
    if right >= 0:
        seen &= offset <= right
    if left >= 0:
        seen &= offset >= -left
    return int(seen.sum())


@pytest.mark.parametrize("world_size", (2, 3, 4, 8))
def test_zigzag_balances_every_ring_step(world_size):
    # causal, L a multiple of 2W: at every step every rank attends to the same number of pairs (2c^2, c the
    # chunk length) with one kernel call; the pairs over all ranks and steps are the causal triangle's
    chunk = 5
    seqlen = 2 * world_size * chunk
    rings = [_Ring(None, r, world_size, (seqlen,), True, None, 1.0, "auto") for r in range(world_size)]
    total = 0
    for step in range(world_size):
        plans = [ring.plan(step) for ring in rings]
        assert all(len(plan) == 1 for plan in plans), plans
        pairs = [sum(_visible_pairs(b) for b in plan) for plan in plans]
        assert pairs == [2 * chunk * chunk + (chunk if step == 0 else 0)] * world_size, (step, pairs)
        total += sum(pairs)
    assert total == seqlen * (seqlen + 1) // 2


@pytest.mark.parametrize("world_size", (2, 4, 8))
def test_gathered_forward_calls(world_size):
    # the all-gather forward: the own shard (one causal call) and, for equal chunks, at most three calls over
    # contiguous key ranges of the gathered buffer, covering exactly the pairs of the ring's other steps; with
    # unequal chunks (padded slots, never read) more calls
    for seqlen, rank in ((2 * world_size * 6 + extra, rank) for extra in (0, 1, world_size + 1)
                         for rank in range(world_size)):
        ring = _Ring(None, rank, world_size, (seqlen,), True, None, 1.0, "auto")
        gathered = ring.gathered_blocks()
        assert len(ring.plan(0)) == 1 and (seqlen % (2 * world_size) or len(gathered) <= 3)
        ring_pairs = sum(_visible_pairs(b) for step in range(1, world_size) for b in ring.plan(step))
        assert sum(_visible_pairs(b) for b in gathered) == ring_pairs
        valid = {row for source in range(world_size) if source != rank
                 for _, rows in ring.gathered_rows(source, slice(0, ring.length(source))) for row in range(
                     rows.start, rows.stop)}
        assert all(set(range(b.k_rows.start, b.k_rows.stop)) <= valid for b in gathered)


def test_coalesce_merges_only_unmasked_neighbours():
    a, b = Block(slice(0, 4), slice(0, 8), False, None), Block(slice(0, 4), slice(8, 12), False, None)
    c = Block(slice(4, 8), slice(0, 12), False, None)
    assert coalesce([b, a, c]) == [Block(slice(0, 8), slice(0, 12), False, None)]
    masked = Block(slice(0, 4), slice(12, 16), True, None)
    assert masked in coalesce([a, b, masked]) and len(coalesce([a, b, masked])) == 2
    gap = Block(slice(0, 4), slice(13, 16), False, None)
    assert len(coalesce([a, gap])) == 2


def test_ring_checks_its_shards_as_the_single_gpu_front_door():
    """A rank's shards get attention.checks' errors (one set of checks), then the ring's own: one sequence."""
    import importlib

    from flashmoe_science.attention.checks import check_inputs

    ring = importlib.import_module("flashmoe_science.distributed.ring_attention")  # the package exports the function

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 8, 16, generator=g), torch.randn(2, 2, 8, 16, generator=g)
    bad = [((q.int(), k, k, None), TypeError), ((q, k[:, :, :, :8], k[:, :, :, :8], None), ValueError),
           ((q[:, :3], k, k, None), ValueError), ((q, k, k, -1.0), ValueError), ((q, k, k, "0.1"), TypeError)]
    for args, error in bad:
        with pytest.raises(error) as expected:
            check_inputs(*args)
        with pytest.raises(error, match=re.escape(str(expected.value))):
            ring._check_local(*args, "auto")
    with pytest.raises(ValueError, match="same positions"):
        ring._check_local(q, k[:, :, :4], k[:, :, :4], None, "auto")
    with pytest.raises(ValueError, match="backend"):
        ring._check_local(q, k, k, None, "fastest")
