"""Ring attention in 2 and 4 CPU processes (gloo): outputs and gradients equal the single-process result on the full
sequence (ring_cases.py; all cases of a world size run in one spawn, conftest.py)."""

import pytest

import ring_cases
from flashmoe_science.distributed.ring_attention import _plan_step
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


def test_ring_attention_triton_kernels_interpreted():
    # a spawn of its own: TRITON_INTERPRET=1 must be set before triton is imported
    from dist_spawn import run_cases

    error = run_cases(["ring_interpreter_cases.ring_triton_kernels"], 2, env={"TRITON_INTERPRET": "1"})[
        "ring_interpreter_cases.ring_triton_kernels"]
    if error is not None:
        pytest.fail(error, pytrace=False)
