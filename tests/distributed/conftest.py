import functools

import pytest

from all_cases import cases_for
from dist_spawn import run_cases


@functools.lru_cache(maxsize=None)
def _results(world_size: int, backend: str, device: str) -> dict:
    # every case of one setting in one spawn: ring attention and expert-parallel MoE share the start-up cost
    return run_cases(cases_for(device), world_size, backend, device)


@pytest.fixture
def distributed_case():
    """``distributed_case(world_size, "module.case", backend, device)`` fails the test with the case's error on any
    rank (default: gloo on CPU)."""

    def check(world_size: int, name: str, backend: str = "gloo", device: str = "cpu") -> None:
        error = _results(world_size, backend, device)[name]
        if error is not None:
            pytest.fail(f"world size {world_size}, {name}: {error}", pytrace=False)

    return check
