"""Host-side layout rules of the attention kernels, shared by the Triton and the Gluon launchers: when TMA can address
a tensor (`tma_compatible`), the rank-4 TMA box over the caller's own strides (`tma_box`, `tma_descriptor`), and when
row offsets need 64-bit arithmetic (`needs_64bit_rows`).

Kernels take q/k/v/out as 4-D `(B, H, L, D)` views with unit stride in the last dim; nothing here copies a tensor.
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit last stride, 16-byte aligned base addresses and outer strides (size-1 dims excepted).

    Holds for any rank: every view the API derives (merged leading dims, unsqueezed 2-D/3-D) keeps the property.
    """
    for t in tensors:
        align = 16 // t.element_size()
        if t.data_ptr() % 16 or (t.shape[-1] > 1 and t.stride(-1) != 1):
            return False
        for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
            if size > 1 and stride % align:
                return False
    return True


def tma_box(t: torch.Tensor, block_rows: int, block_d: int) -> dict:
    """The fields of a rank-4 TMA descriptor over t's own strides, boxes of (1, 1, block_rows, block_d).

    The descriptors are built from these without their classes' re-validation (`tma_compatible` was checked once by
    the caller): this runs on every call, and host time matters for small problems, where the GPU idles while Python
    prepares a launch.
    """
    shape, strides = list(t.shape), list(t.stride())
    # Size-1 dims are never stepped over, but TMA still wants every outer stride 16-byte aligned.
    for dim in (2, 1, 0):
        if shape[dim] == 1:
            strides[dim] = shape[dim + 1] * strides[dim + 1]
    return {"base": t, "shape": shape, "strides": strides, "block_shape": [1, 1, block_rows, block_d],
            "padding": "zero"}


def tma_descriptor(t: torch.Tensor, block_rows: int, block_d: int, descriptor_type: type = TensorDescriptor,
                   **fields):
    """A `descriptor_type` (Triton's host TensorDescriptor, or Gluon's, whose extra `layout` field comes in `fields`)
    over `tma_box(t, block_rows, block_d)`, built field by field (see `tma_box`)."""
    desc = object.__new__(descriptor_type)
    desc.__dict__.update(tma_box(t, block_rows, block_d), **fields)
    return desc


def needs_64bit_rows(*tensors: torch.Tensor | None) -> bool:
    """Whether a kernel's row offsets (row index × row stride, in elements) can reach 2**31 for these (..., L, D)
    tensors. The kernels compute them in 32 bits unless told otherwise (ROW64): 64-bit offsets cost registers in
    the common case, but a transposed (B, L, H, D) buffer has row stride H·D, so H=32, D=128 passes 2**31 at
    L = 524288. Batch and head offsets are always 64-bit; TMA descriptors address on their own."""
    return any(t is not None and t.shape[-2] > 1 and (t.shape[-2] - 1) * t.stride(-2) + t.shape[-1] >= 2**31
               for t in tensors)


def bias_tma_view(bias: torch.Tensor, seqlen_q: int, seqlen_k: int) -> tuple[torch.Tensor, int, int] | None:
    """A `(Bb, Hb, Lq, Lk)` bias (`features.CallFeatures.attn_bias`) as a TMA can read it: `(view, batch step, head
    step)`, or None where its query or key dim broadcasts or its strides defeat TMA (`tma_compatible`).

    A TMA descriptor cannot step by 0, so a batch or head dim the bias broadcasts over (size 1, or stride 0 after an
    `expand`) becomes a size-1 dim of the view and its step 0: the kernel reads TMA coordinate `batch · step`."""
    if tuple(bias.shape[2:]) != (seqlen_q, seqlen_k) or (seqlen_q > 1 and bias.stride(2) == 0):
        return None
    view = bias
    steps = []
    for dim in (0, 1):
        if view.shape[dim] > 1 and view.stride(dim) == 0:
            view = view.narrow(dim, 0, 1)
        steps.append(int(view.shape[dim] > 1))
    if not tma_compatible(view):
        return None
    return view, steps[0], steps[1]
