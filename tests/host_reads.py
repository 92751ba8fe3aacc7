"""Counting the host reads of device values (the synchronisations a CUDA device would make) on any device.

On a GPU `torch.cuda.set_sync_debug_mode` reports them; on the CPU nothing waits, so `HostReads` records the
operations that would: an aten op that turns a tensor into a Python number (`item`, `bool()`, `int()`: all
`_local_scalar_dense`), a shape that depends on values (`nonzero`, `masked_select`, `unique`, a boolean index),
`equal`, and `tolist`/`numpy` (which read memory without an aten op, so a function mode sees them). Code that
legitimately reads values in a test (the PyTorch reference's per-sequence loop) runs under `paused()`.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READING_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "equal", "is_nonzero",
                "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave"}
_READING_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy}


class _Ops(TorchDispatchMode):
    def __init__(self, reads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._opname in _READING_OPS and not self.reads.pause_depth:
            self.reads.seen.append(func._opname)
        return func(*args, **(kwargs or {}))


class _Methods(TorchFunctionMode):
    def __init__(self, reads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READING_METHODS and not self.reads.pause_depth:
            self.reads.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


class Pausable:
    """A counter's ``paused()``: what runs inside it is not counted (nested pauses too), read as ``pause_depth``."""

    pause_depth = 0

    @contextlib.contextmanager
    def paused(self):
        self.pause_depth += 1
        try:
            yield
        finally:
            self.pause_depth -= 1


class HostReads(Pausable):
    """``with HostReads() as reads: ...`` then ``reads.seen``: the reading operations, in order."""

    def __init__(self):
        self.seen: list[str] = []
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self):  # re-entrant: a counted function may be called inside a counted region
        stack = contextlib.ExitStack()
        stack.enter_context(_Methods(self))
        stack.enter_context(_Ops(self))
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self._stacks.pop().__exit__(*exc)


def pausing(reads: HostReads, function):
    """`function` with `reads` paused while it runs (for monkeypatching an implementation that may read)."""

    def wrapped(*args, **kwargs):
        with reads.paused():
            return function(*args, **kwargs)

    return wrapped
