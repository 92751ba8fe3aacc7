"""Megatron-core's model-parallel state on CPU ranks (gloo), for the tests and the example's CPU run.

Megatron-core assumes CUDA where its local GPT-MoE layers reach it: buffers and moved weights go to
``torch.cuda.current_device()`` (``DotProductAttention``'s score buffer from ``parallel_state``'s global memory
buffer, the router's weight, its auxiliary-loss tensors, RoPE's frequencies), and dropout and the expert weights'
initialisation fork the CUDA RNG tracker; its DDP waits on ``torch.cuda.current_stream()``; its optimizer allocates
CUDA tensors. On the CPU, ``init`` makes ``torch.cuda.current_device()`` name the CPU and ``current_stream()`` a
stream with nothing to wait for, the global memory buffer allocate CPU tensors, and the tracker Megatron's inference
tracker (whose fork is a no-op: these runs have no dropout); ``MainGradAdamW`` stands in for the optimizer.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mpu_random


class NoStream:
    """``torch.cuda.current_stream()`` on the CPU: Megatron's DDP waits on it for CUDA-graph events (none here)."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


class CpuMemoryBuffer:
    """``parallel_state``'s global memory buffer, its tensors on the CPU."""

    def __init__(self):
        self.buffers = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        needed = 1
        for size in tensor_shape:
            needed *= size
        key = (name, dtype)
        if key not in self.buffers or self.buffers[key].numel() < needed:
            self.buffers[key] = torch.empty(needed, dtype=dtype)
        return self.buffers[key][:needed].view(*tensor_shape)


def init(expert_parallel: int = 1, expert_tensor_parallel: int | None = None) -> None:
    """The gloo process group (from torchrun's environment, else one rank) and Megatron's parallel state on it, on
    a machine without CUDA (``torch.cuda.current_device`` is replaced for the process)."""
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu.init is for CPU-only machines; this one has CUDA")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29571")
        dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_parallel,
                                             expert_tensor_parallel_size=expert_tensor_parallel)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.current_stream = lambda device=None: NoStream()
    mpu_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()


def destroy() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class MainGradAdamW(torch.optim.AdamW):
    """AdamW over a Megatron-DDP-wrapped model, for CPU runs: Megatron-core's optimizer allocates CUDA tensors.

    Megatron's ``DistributedDataParallel`` accumulates (and reduces) each parameter's gradient in its float32
    ``main_grad``; ``step`` hands those to AdamW. No gradient clipping (Megatron's clips by the norm over all
    model-parallel ranks, which this stand-in does not compute); Megatron's ``OptimizerParamScheduler`` drives its
    learning rate as it drives Megatron's optimizer."""

    def __init__(self, ddp, lr: float, weight_decay: float, betas=(0.9, 0.95)):
        self.parameters_with_grads = [p for p in ddp.parameters() if p.requires_grad]
        super().__init__(self.parameters_with_grads, lr=lr, weight_decay=weight_decay, betas=betas)

    @torch.no_grad()
    def step(self, closure=None):
        for param in self.parameters_with_grads:
            param.grad = param.main_grad.to(param.dtype)
        return super().step(closure)
