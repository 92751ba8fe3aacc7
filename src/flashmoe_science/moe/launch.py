"""One MoE kernel launch kept as data: run it as Triton's JIT would, or prepare it for repeats on new tensors."""

from typing import NamedTuple

import torch

from flashmoe_science.prepared_launch import PreparedLaunch


class Launch(NamedTuple):
    """One kernel launch, built but not yet run: ``launch()`` runs it. Kept as data so that the tile sweep
    (scripts/sweep_moe.py) can time one GEMM alone, the offline sm_90 build can compile exactly what would run, and
    a repeated call signature can skip Triton's binding (``prepare``)."""

    kernel: object  # a @triton.jit function
    grid: tuple
    args: tuple  # the kernel's tensors first, then its scalars
    meta: dict  # constexprs, num_warps, num_stages

    def __call__(self):
        return self.kernel[self.grid](*self.args, **self.meta)

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
