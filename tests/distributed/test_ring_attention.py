"""Ring attention on CPU processes (gloo): outputs and gradients equal the single-process result."""

import pytest

from dist_spawn import run_cases
from flashmoe_science.distributed.zigzag import chunk_starts, shard_chunks, shard_lengths, zigzag_positions
import ring_cases

WORLD_SIZES = (2, 3, 4)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ring_results(request):
    return request.param, run_cases("ring_cases", ring_cases.CASES, request.param)


@pytest.mark.parametrize("case", ring_cases.CASES)
def test_ring_attention(ring_results, case):
    world_size, results = ring_results
    if results[case] is not None:
        pytest.fail(f"world size {world_size}, {case}: {results[case]}")


def test_zigzag_layout():
    assert chunk_starts(10, 2) == [0, 3, 6, 8, 10]
    assert [(c.global_start, c.length) for c in shard_chunks(10, 2, 0)] == [(0, 3), (8, 2)]
    assert [(c.local_start, c.global_start, c.length) for c in shard_chunks(10, 2, 1)] == [(0, 3, 3), (3, 6, 2)]
    assert shard_lengths(3, 2) == [1, 2]
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert sorted(sum((zigzag_positions(13, 3, r).tolist() for r in range(3)), [])) == list(range(13))
    with pytest.raises(ValueError, match="rank"):
        shard_chunks(8, 2, 2)
