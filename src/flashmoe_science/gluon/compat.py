"""The one place where the library meets Gluon's moving API: every sm_90 Gluon kernel imports its Gluon names from
here, under the names of the newest triton, so that the kernels read the same on every supported release
(3.6.0 to 3.9.x, tested offline by the sm_90 build tests). No kernel checks a version.

What moved (Gluon is Triton's experimental layer):

- TMA copies: ``tma.async_copy_global_to_shared`` / ``tma.async_copy_shared_to_global`` (3.6, 3.7) became
  ``tma.async_load`` / ``tma.async_store`` in 3.8; 3.9 removed the old names (they raise). Same arguments.
- The TMA reduce-add (``cp.reduce.async.bulk.tensor.add``): 3.6 and 3.7 build the op but wrap it nowhere on
  Hopper, so ``async_atomic_add`` is written here for them as a builtin; 3.8 added ``tma.async_atomic_add``.
- ``gl.thread_barrier()`` (3.6) became ``gl.barrier()`` (3.7, which dropped the old name): exported as ``barrier``.
- ``mbarrier.expect``'s byte count is positional everywhere (its name moved from ``bytes`` to ``bytes_per_cta``).
- Aggregates (named kernel-side structs): ``gluon.aggregate`` from 3.9, ``triton.language.core._aggregate`` before
  (the same decorator); exported as ``aggregate``. Their ``__init__`` is a ``gluon.constexpr_function`` (3.6 and 3.7
  require one; 3.9 would generate it), which sees constexpr arguments unwrapped: it stores each argument through
  ``field`` (constexprs wrapped again, tensors as they are). Field annotations must be real classes, not strings:
  a module that declares an aggregate does not use ``from __future__ import annotations``.
- ``TensorDescriptor`` gained ``round_f32_to_tf32`` (3.7; a class-level default, so descriptors built field by
  field in ``sm90.descriptor`` stay valid).

Kernels write ``tma.async_load(...)``; ``tma`` here is a module holding the TMA ops of the running triton under
those names (Gluon's compiler accepts a module global, and calls the same builtins: the SASS on 3.6 is the one
written against triton's own ``tma`` module).
"""

from __future__ import annotations

import types

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper as _hopper
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["TRITON_VERSION", "TUNED_TRITON", "TensorDescriptor", "aggregate", "barrier", "fence_async_shared", "field",
           "gl", "gluon", "mbarrier", "on_tuned_triton", "tma", "warpgroup_mma", "warpgroup_mma_wait"]

TRITON_VERSION = triton.__version__
# The release the kernels' tiles, register budgets and spill-free builds were tuned and measured on (the H200's).
TUNED_TRITON = "3.6"


def on_tuned_triton() -> bool:
    """Whether the running triton is the release the Gluon kernels were tuned on (``TUNED_TRITON``)."""
    return TRITON_VERSION.split(".")[:2] == TUNED_TRITON.split(".")


_tma = _hopper.tma


def _legacy_async_atomic_add():
    """tma.async_atomic_add for triton 3.6 / 3.7: the builder's TMA reduce op, which they build but do not wrap."""
    from triton._C.libtriton import ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def async_atomic_add(tensor_desc, coord, src, _semantic=None):
        """dst[box at coord] += src (shared memory), by the TMA unit; completion is tracked like a TMA store
        (``tma.store_wait``)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    return async_atomic_add


barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # a CTA-wide barrier (bar.sync)
aggregate = getattr(gluon, "aggregate", None) or triton.language.core._aggregate


@gluon.constexpr_function
def field(value):
    """An aggregate field's value inside its ``__init__``: a tensor as it is, anything else (a constexpr argument,
    which the constexpr function sees unwrapped, e.g. None for an argument a launch leaves out) as a constexpr."""
    return value if isinstance(value, gl.tensor) else gl.constexpr(value)

tma = types.ModuleType(__name__ + ".tma", "Gluon's Hopper TMA ops under triton 3.8+'s names, on any supported triton.")
tma.async_load = getattr(_tma, "async_load", None) or _tma.async_copy_global_to_shared
tma.async_store = getattr(_tma, "async_store", None) or _tma.async_copy_shared_to_global
tma.store_wait = _tma.store_wait
tma.async_atomic_add = getattr(_tma, "async_atomic_add", None) or _legacy_async_atomic_add()
