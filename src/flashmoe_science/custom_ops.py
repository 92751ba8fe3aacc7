"""What every ``torch.library`` custom op of the package shares (namespace ``flashmoe_science``): the registration
function, and the layout, device and autograd helpers of their real and fake implementations.

Each op is registered by the module beside the front door that calls it, which imports it (no registration by side
effect): ``attention/ops.py`` (dense and packed attention), ``attention/decode/ops.py`` (KV-cache attention) and
``moe/ops.py`` (routing and experts). Under ``torch.compile`` the public functions call these ops: the compiler sees
one opaque node per op, with a fake implementation giving its outputs' shapes, dtypes and strides (and running the
eager checks at trace time), and the backward as another op (``register_autograd``). In eager mode the public
functions never come here (one ``is_compiling()`` test per call): their prepared launches keep the host time they
had (benchmarks/tools/host_time_custom_ops.py measures both). An op's real implementation calls the layer below the
public functions (``attention.call``, ``attention.decode.call``, ``moe.execute``: checked problem -> plan ->
execute), so a compiled call runs each check once; only its outputs are made to have the layout its fake promises.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

NAMESPACE = "flashmoe_science"
custom_op = torch.library.custom_op


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether `a` and `b` (one shape) have the same strides wherever a dim has more than one element."""
    return all(n <= 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def laid_out_like(t: Tensor, like: Tensor) -> Tensor:
    """`t` with the strides `torch.empty_like(like)` has (what the fake implementations promise), copied only where
    they differ (the reference path's outputs; the kernels' already have them)."""
    layout = torch.empty_like(like, device="meta")
    if same_layout(t, layout):
        return t
    return torch.empty_like(like).copy_(t)


def on_device(x: Tensor):
    """Triton launches on the current CUDA device: make it x's."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def empty_like_fake(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return torch.empty_like(t, dtype=dtype)




def lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def window_of(window: list[int] | None):
    # int(): a fake implementation may see symbolic ints (dynamo makes a changing int dynamic); the mask specialises
    return None if window is None else tuple(int(side) for side in window)


def autograd_on():
    """Autograd inside an op's implementation, where the dispatcher has switched it off: the reference backward
    differentiates through its score modifications (softcap, GQA expansion)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False))
    stack.enter_context(torch.enable_grad())
    return stack
