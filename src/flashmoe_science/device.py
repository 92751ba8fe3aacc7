"""What the kernels need to know about the device they run on, in one place for every kernel family.

The device's architecture is read here and nowhere else: `DeviceTraits.arch` names it (``"sm_90"``; the
interpreter's stand-in has none) and the traits say what the planners ask of it (tensor cores, e4m3 products,
whether the measured tile tables apply). A kernel family for one architecture compares `arch` with the name it
declares (its backend package's `ARCH`); the generic planners, tiles and the CLI read the traits only.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


# The compute capability the portable kernels' tile tables were measured on (an H200; docs/perf-notes.md): GPUs of
# its generation get them (and TMA descriptors), the others conservative tables keyed by their capability.
MEASURED_CAPABILITY = (9, 0)
FP8_CAPABILITY = (8, 9)  # e4m3 tensor-core products: compute capability 8.9 and newer


def arch_name(capability: tuple[int, int]) -> str:
    """The architecture of a compute capability as CUDA names it: (9, 0) -> "sm_90"."""
    return f"sm_{capability[0]}{capability[1]}"


@dataclass(frozen=True)
class DeviceTraits:
    capability: tuple[int, int]  # (0, 0): the interpreter's stand-in for CPU tensors
    sm_count: int
    smem_per_block: int  # bytes a block may opt in to

    @property
    def arch(self) -> str | None:
        """The GPU's architecture ("sm_90"), or None for the interpreter's stand-in."""
        return arch_name(self.capability) if self.capability != (0, 0) else None

    @property
    def tensor_cores(self) -> bool:
        """Ampere or newer: mma tensor-core products, asynchronous copies, the larger tiles."""
        return self.capability[0] >= 8

    @property
    def fp8_mma(self) -> bool:
        return self.capability >= FP8_CAPABILITY

    def in_families(self, majors: tuple[int, ...]) -> bool:
        """Whether the GPU's compute-capability major is one of `majors` (the GPUs a peer library is built for)."""
        return self.capability[0] in majors

    @property
    def measured_tiles(self) -> bool:
        """Whether the tile tables measured on MEASURED_CAPABILITY apply (the same compute-capability major)."""
        return self.capability[0] == MEASURED_CAPABILITY[0]


# Conservative stand-in for CPU tensors run under the Triton interpreter.
INTERPRETER_TRAITS = DeviceTraits(capability=(0, 0), sm_count=1, smem_per_block=1 << 20)


@functools.lru_cache(maxsize=None)
def _cuda_traits(index: int) -> DeviceTraits:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 101376
    return DeviceTraits((props.major, props.minor), props.multi_processor_count, int(smem))


def current_traits() -> DeviceTraits | None:
    """The current CUDA device's traits, or None without a CUDA GPU (the CLI's question)."""
    if not torch.cuda.is_available():
        return None
    return _cuda_traits(torch.cuda.current_device())


def device_traits(device: torch.device) -> DeviceTraits:
    """The GPU's traits (cached per device), or the interpreter's stand-in for CPU tensors."""
    if device.type != "cuda":
        return INTERPRETER_TRAITS
    return _cuda_traits(device.index if device.index is not None else torch.cuda.current_device())


def on_another_cuda_device(t) -> bool:
    """Whether t is a CUDA tensor on a GPU other than the current one. Triton launches on the current device, so
    the front doors run such calls under `torch.cuda.device(t.device)`."""
    return isinstance(t, torch.Tensor) and t.is_cuda and t.get_device() != torch.cuda.current_device()


def check_device_option(device: str) -> None:
    """A ValueError in one line when a ``--device`` option names CUDA on a machine without a CUDA device (before any
    work: torch's own error comes later, as a long traceback)."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: there is no CUDA device here (torch.cuda.is_available() is False); "
                         f"use --device cpu")


def triton_interpreter_on() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors (slowly; for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_interpreter_operands(name: str, t: torch.Tensor) -> None:
    """Raise TypeError before a Triton kernel runs on bfloat16 CPU tensors (TRITON_INTERPRET=1): the interpreter's
    tl.dot multiplies bfloat16 operands as their raw bit patterns (triton-lang/triton#11584), which would give a
    result wrong by orders of magnitude, silently. Its float16 and float32 products are exact."""
    if t.device.type == "cpu" and t.dtype == torch.bfloat16 and triton_interpreter_on():
        raise TypeError(f"{name} is bfloat16 on the CPU: Triton's interpreter multiplies bfloat16 tl.dot operands "
                        "as raw bits (triton-lang/triton#11584); pass float16 or float32 tensors, or backend='auto' "
                        "(the reference on the CPU)")


def dot_precision(t: torch.Tensor) -> dict:
    """The DOT_PRECISION constexpr of every kernel (attention and MoE): float32 inputs multiply in 3xTF32
    (near-fp32 accuracy; plain TF32 gives ~1e-3 relative error, which compounds through a backward's
    recomputation). 16-bit inputs ignore it."""
    return {"DOT_PRECISION": "tf32x3" if t.dtype == torch.float32 else "tf32"}
