"""The symmetric-memory exchange on every GPU of the host, one NCCL rank each (symm_cases.py): against the NCCL
exchange and the one-GPU layer, captured in CUDA graphs, a forced overflow. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 in the ranks' environment)."""

import functools

import pytest
import torch

import symm_cases
from dist_spawn import run_cases

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@functools.lru_cache(maxsize=None)
def _results(world_size: int) -> dict:
    # every case in one spawn: the ranks' start-up and Triton compilations once
    names = [f"symm_cases.{case}" for case in symm_cases.CASES]
    return run_cases(names, world_size, "nccl", "cuda", env=MULTICAST_OFF)


@pytest.mark.parametrize("case", symm_cases.CASES)
def test_symm_exchange(case):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        pytest.skip(f"needs 2 or more GPUs (one per NCCL rank), found {count}")
    error = _results(count)[f"symm_cases.{case}"]
    if error is not None:
        pytest.fail(f"{count} GPUs, {case}: {error}", pytrace=False)
