"""The ladder: exact attention from a CPU loop to the Hopper kernel, one idea per rung.

Every rung computes the same function, softmax(q kᵀ · scale) v, with the same call (`ladder.inputs`):

    from flashmoe_science.attention.ladder import RUNGS
    for rung in RUNGS:
        out = rung.attention(q, k, v, causal=True)      # q, k, v: (B, H, L, D)

and each file teaches the step it takes over the one before:

    cpu                 the definition in PyTorch: scores, softmax, P·V, the L x L matrix in memory
    naive_gpu           the same three steps as three Triton kernels, the scores in GPU memory between them
    tiled_fma           one kernel, online softmax over key tiles: the scores never leave the chip (CUDA cores)
    tiled_tensor_cores  the same loop with its products on tensor cores (the library's portable Triton kernel)
    hopper              TMA, warp specialisation and async wgmma overlap loads, products and softmax (Gluon)

`RUNGS` is the order the benchmark (`flashmoe-science bench --suite ladder`, bench/ladder.py) and the tests walk;
docs/ladder.md explains each step with its measured gain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from flashmoe_science.attention.ladder import cpu, hopper, naive_gpu, tiled_fma, tiled_tensor_cores
from flashmoe_science.device import device_traits, triton_interpreter_on

# Where a rung runs: "cpu" CPU tensors; "interpreter" CPU tensors under TRITON_INTERPRET=1 (slow; tests and tiny
# sizes); "cuda" any GPU Triton supports; "sm_90" Hopper GPUs only.
DEVICE_KINDS = ("cpu", "interpreter", "cuda", "sm_90")


@dataclass(frozen=True)
class Rung:
    name: str
    idea: str
    devices: tuple[str, ...]
    attention: Callable[..., torch.Tensor]  # attention(q, k, v, causal=False, softmax_scale=None) -> out


RUNGS: tuple[Rung, ...] = (
    Rung("cpu", "the definition in PyTorch on the CPU: all L x L scores, softmax, then P·V", ("cpu",),
         cpu.attention),
    Rung("naive_gpu", "three GPU kernels (scores, softmax, P·V), the L x L float32 scores in HBM between them",
         ("interpreter", "cuda"), naive_gpu.attention),
    Rung("tiled_fma", "one kernel, online softmax over key tiles: scores stay on chip; float32 FMA products",
         ("interpreter", "cuda"), tiled_fma.attention),
    Rung("tiled_tensor_cores", "the same tiled loop with its two products on tensor cores (the Triton kernel)",
         ("interpreter", "cuda"), tiled_tensor_cores.attention),
    Rung("hopper", "TMA, warp-specialised producer and consumers, async wgmma under the softmax (the Gluon kernel)",
         ("sm_90",), hopper.attention),
)


def rung(name: str) -> Rung:
    """The rung called `name` (ValueError listing the names otherwise)."""
    for candidate in RUNGS:
        if candidate.name == name:
            return candidate
    raise ValueError(f"no ladder rung named {name!r}; the rungs are {', '.join(r.name for r in RUNGS)}")


def unavailable(r: Rung, device: torch.device) -> str | None:
    """Why rung `r` cannot run on `device` here, or None when it can."""
    if device.type == "cpu":
        if "cpu" in r.devices or ("interpreter" in r.devices and triton_interpreter_on()):
            return None
        if "interpreter" in r.devices:
            return "it runs on the CPU only under TRITON_INTERPRET=1 (set before the process starts)"
        return "it needs a GPU" if "sm_90" not in r.devices else "it needs a Hopper (sm_90) GPU"
    if device.type != "cuda":
        return f"it does not run on {device.type} tensors"
    if "cuda" in r.devices:
        return None
    if "sm_90" in r.devices:
        if device_traits(device).arch in r.devices:
            return None
        return f"it needs a Hopper (sm_90) GPU, this is {torch.cuda.get_device_name(device)}"
    return "it runs on CPU tensors only"
