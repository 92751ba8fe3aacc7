"""The distributed cases (ring_cases.py, moe_cases.py) with CUDA tensors: the GPU kernels between ranks.

- One GPU: 2 ranks of a gloo group share it, their tensors staged through host memory
  (distributed/comm.py); checks the local kernels, the merges and the gradient bookkeeping on the GPU.
- Two or more GPUs (`pytest -m multigpu`): NCCL, one GPU per rank, every case (ring attention forward and backward
  with both K/V exchanges, expert parallelism forward and backward) against the one-process result. NVLink
  multicast is left off (NCCL_NVLS_ENABLE=0 in the environment of the run).
"""

import pytest
import torch

from all_cases import GPU_CASES as CASES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", CASES)
def test_cases_on_one_gpu_gloo(distributed_case, case):
    distributed_case(2, case, "gloo", "cuda")


def _gpu_counts():
    # every GPU of the host, one rank each (two ranks are covered by the gloo variant and by two-GPU hosts); each world
    # size is one spawn whose Triton compilations take most of its minutes
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [max(count, 2)]


@pytest.mark.multigpu
@pytest.mark.parametrize("world_size", _gpu_counts())
@pytest.mark.parametrize("case", CASES)
def test_cases_nccl(distributed_case, world_size, case):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs for NCCL (one per rank), found {torch.cuda.device_count()}")
    distributed_case(world_size, case, "nccl", "cuda")
