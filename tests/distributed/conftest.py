import functools

import pytest

from dist_spawn import run_cases
import moe_cases
import ring_cases

CASES = [f"ring_cases.{name}" for name in ring_cases.CASES] + [f"moe_cases.{name}" for name in moe_cases.CASES]


@functools.lru_cache(maxsize=None)
def _results(world_size: int) -> dict:
    # every case of one world size in one spawn: ring attention and expert-parallel MoE share the start-up cost
    return run_cases(CASES, world_size)


@pytest.fixture
def distributed_case():
    """``distributed_case(world_size, "module.case")`` fails the test with the case's error on any rank."""

    def check(world_size: int, name: str) -> None:
        error = _results(world_size)[name]
        if error is not None:
            pytest.fail(f"world size {world_size}, {name}: {error}", pytrace=False)

    return check
