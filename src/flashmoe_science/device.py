"""What the kernels need to know about the device they run on, in one place for every kernel family."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceTraits:
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int  # bytes a block may opt in to

    @property
    def is_hopper(self) -> bool:
        return self.capability[0] == 9


# Conservative stand-in for CPU tensors run under the Triton interpreter.
INTERPRETER_TRAITS = DeviceTraits(capability=(0, 0), sm_count=1, smem_per_block=1 << 20)


@functools.lru_cache(maxsize=None)
def _cuda_traits(index: int) -> DeviceTraits:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 101376
    return DeviceTraits((props.major, props.minor), props.multi_processor_count, int(smem))


def device_traits(device: torch.device) -> DeviceTraits:
    """The GPU's traits (cached per device), or the interpreter's stand-in for CPU tensors."""
    if device.type != "cuda":
        return INTERPRETER_TRAITS
    return _cuda_traits(device.index if device.index is not None else torch.cuda.current_device())


def on_another_cuda_device(t) -> bool:
    """Whether t is a CUDA tensor on a GPU other than the current one. Triton launches on the current device, so
    the front doors run such calls under `torch.cuda.device(t.device)`."""
    return isinstance(t, torch.Tensor) and t.is_cuda and t.get_device() != torch.cuda.current_device()


def triton_interpreter_on() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors (slowly; for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(t: torch.Tensor) -> dict:
    """The DOT_PRECISION constexpr of every kernel (attention and MoE): float32 inputs multiply in 3xTF32
    (near-fp32 accuracy; plain TF32 gives ~1e-3 relative error, which compounds through a backward's
    recomputation). 16-bit inputs ignore it."""
    return {"DOT_PRECISION": "tf32x3" if t.dtype == torch.float32 else "tf32"}
