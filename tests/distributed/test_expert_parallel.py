"""Expert-parallel MoE in 2 and 4 CPU processes (gloo): outputs and gradients equal the whole layer run in one
process on every rank's tokens (moe_cases.py; ragged token counts, a rank without tokens, a rank that receives none)."""

import pytest

import moe_cases
from flashmoe_science.distributed import expert_bounds


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("case", moe_cases.CASES)
def test_expert_parallel(distributed_case, world_size, case):
    distributed_case(world_size, f"moe_cases.{case}")


def test_expert_bounds():
    assert expert_bounds(8, 4) == [0, 2, 4, 6, 8]
    assert expert_bounds(7, 4) == [0, 2, 4, 6, 7]
