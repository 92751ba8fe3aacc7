"""The symmetric-memory exchange on every GPU of the host, one NCCL rank each (symm_cases.py): against the NCCL
exchange and the one-GPU layer, captured in CUDA graphs, a forced overflow; and the expert-parallel cases of
moe_cases.py (float32 against one process: ragged tokens, a rank without tokens, a rank receiving none), which
take the symmetric-memory exchange by default on such a group. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 in the ranks' environment)."""

import functools

import pytest
import torch

import moe_cases
import symm_cases
from dist_spawn import run_cases

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@functools.lru_cache(maxsize=None)
def _results(world_size: int) -> dict:
    # every case in one spawn: the ranks' start-up and Triton compilations once
    return run_cases(CASES, world_size, "nccl", "cuda", env=MULTICAST_OFF)


# the moe cases after the symmetric-memory comparisons and before the CUDA-graph captures (symm_cases.CASES' order)
CASES = ([f"symm_cases.{case}" for case in symm_cases.CASES[:2]] + [f"moe_cases.{case}" for case in moe_cases.CASES]
         + [f"symm_cases.{case}" for case in symm_cases.CASES[2:]])


@pytest.mark.parametrize("case", CASES)
def test_symm_exchange(case):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        pytest.skip(f"needs 2 or more GPUs (one per NCCL rank), found {count}")
    error = _results(count)[case]
    if error is not None:
        pytest.fail(f"{count} GPUs, {case}: {error}", pytrace=False)
