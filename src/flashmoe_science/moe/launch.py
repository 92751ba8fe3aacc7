"""One MoE kernel launch kept as data: run it, or prepare it for repeats on new tensors."""

from typing import NamedTuple

import torch

from flashmoe_science.device import triton_interpreter_on
from flashmoe_science.prepared_cache import prepared_table, remember
from flashmoe_science.prepared_launch import PreparedLaunch

# Every launch whose signature ran before goes through its PreparedLaunch instead of Triton's per-call binding
# (tens of microseconds each: the backward's seven launches and the training forward's five made small-T layers
# host-bound; docs/perf-notes.md). Bounded: each token count is a new signature (new grids).
_PREPARED: dict[tuple, PreparedLaunch] = prepared_table("MoE kernel launches")


class Launch(NamedTuple):
    """One kernel launch, built but not yet run: ``launch()`` runs it. Kept as data so that the tile sweep
    (benchmarks/tools/sweep_moe_gemm_tiles.py) can time one GEMM alone, an offline build can compile exactly what
    would run, and a repeated call signature can skip Triton's binding (``prepare``)."""

    kernel: object  # a @triton.jit function
    grid: tuple
    args: tuple  # the kernel's tensors first, then its scalars
    meta: dict  # constexprs, num_warps, num_stages

    def __call__(self) -> None:
        key = self.signature()
        prepared = _PREPARED.get(key) if key is not None else None
        if prepared is not None:
            prepared(*self.args[:len(prepared.aligned)])
            return
        self.kernel[self.grid](*self.args, **self.meta)
        if key is not None:
            remember(_PREPARED, key, self.prepare())

    def signature(self) -> tuple | None:
        """Everything a PreparedLaunch freezes or Triton specialises on: the kernel, grid, constexprs and scalars
        as given, and per tensor its dtype, device and 16-byte alignment; None where no compiled kernel exists
        (the interpreter, CPU tensors)."""
        head = self.args[0]
        if not (isinstance(head, torch.Tensor) and head.is_cuda) or triton_interpreter_on():
            return None
        args = tuple((a.dtype, a.device, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a
                     for a in self.args)
        return (self.kernel, self.grid, args, tuple(self.meta.items()))

    def prepare(self) -> PreparedLaunch:
        """This launch as a PreparedLaunch, called with the kernel's leading tensor arguments (new tensors of the
        same shapes, strides, dtypes, device and 16-byte alignment); the grid, the scalars and the constexprs are
        frozen, so every one of them must follow from what the caller keys its cache on."""
        names = self.kernel.arg_names
        num_tensors = next((i for i, arg in enumerate(self.args) if not isinstance(arg, torch.Tensor)),
                           len(self.args))
        if any(isinstance(arg, torch.Tensor) for arg in self.args[num_tensors:]):
            raise ValueError("Launch.prepare: a tensor after the scalars would be frozen into the launch")
        bound = dict(zip(names, self.args))
        options = {}
        for name, value in self.meta.items():
            (bound if name in names else options)[name] = value
        return PreparedLaunch(self.kernel, self.grid, bound, options, _as_given, self.args[:num_tensors])


def _as_given(*tensors):
    # the MoE kernels take plain pointers: the per-call arguments are the tensors themselves
    return tensors
