"""Repeating a Triton/Gluon kernel launch without Triton's per-call binding.

`kernel[grid](...)` re-binds and re-specialises every argument and looks the compiled kernel up on each call:
tens of microseconds of host time, which on a small problem is longer than the GPU work (docs/perf-notes.md, host
time). A PreparedLaunch does that once for one call signature and afterwards hands the compiled kernel only
the arguments that change per call: the tensors (or TMA descriptors over them). Everything else (shapes, strides,
scalars, constexprs, grid) is frozen, so the caller must key its cache of prepared launches on all of it, and on
each tensor's 16-byte alignment, which Triton specialises on (see attention.call.prepared_key).

Because a signature freezes shapes and strides, a TMA descriptor of a new call differs from the prepared call's
only in its base tensor: without a `make_head`, a PreparedLaunch copies the prepared descriptors' fields onto the
new tensors (a dict copy) instead of deriving them again (a shared-memory layout per descriptor, tens of µs).
"""

from __future__ import annotations

from typing import Callable

import torch
from triton import knobs
from triton.runtime.driver import driver


class PreparedLaunch:
    """One call signature's launch of `kernel`, ready to repeat on new tensors.

    `bound`: every kernel parameter by name, as for `kernel[grid](**bound, **options)`, which must have been
    launched (or warmed up) with them already: the compiled kernel is taken from Triton's cache. `make_head(*tensors)`
    builds the kernel arguments that change per call (tensors, descriptors) from the call's tensors: the leading
    parameters, or those named in `live` (in that order) where per-call tensors sit among frozen scalars (a packed
    batch's cumulative lengths); every other parameter is frozen from `bound`. `make_head=None`: each per-call
    tensor is passed as given where `bound` holds a tensor, and as a copy of `bound`'s descriptor over it where
    `bound` holds a TMA descriptor (`rebased_head`).
    """

    __slots__ = ("compiled", "grid", "make_head", "template", "positions", "aligned")

    def __init__(self, kernel, grid: tuple[int, ...], bound: dict, options: dict,
                 make_head: Callable[..., tuple] | None, tensors: tuple, live: tuple[str, ...] | None = None):
        self.compiled = kernel.warmup(grid=grid, **bound, **options)
        self.grid = (*grid, 1, 1)[:3]
        names = list(kernel.arg_names)
        if make_head is None:
            live = names[:len(tensors)] if live is None else list(live)
            make_head = rebased_head(tuple(bound[name] for name in live), tensors)
        self.make_head = make_head
        live = names[:len(make_head(*tensors))] if live is None else list(live)
        self.positions = tuple(names.index(name) for name in live)
        if self.positions == tuple(range(len(live))):  # the common case: one tuple concatenation per call
            self.positions = len(live)
        live_positions = range(self.positions) if isinstance(self.positions, int) else self.positions
        # the frozen arguments, in order; the per-call ones left empty (holding the first call's tensors or their
        # descriptors would keep those tensors alive as long as this launch is cached)
        self.template = tuple(None if position in live_positions else bound[name]
                              for position, name in enumerate(names))
        self.aligned = tuple(t.data_ptr() % 16 == 0 for t in tensors)

    @property
    def frozen(self) -> tuple:
        """The arguments every call repeats (all but the per-call ones), in parameter order."""
        live = range(self.positions) if isinstance(self.positions, int) else self.positions
        return tuple(arg for position, arg in enumerate(self.template) if position not in live)

    def __call__(self, *tensors) -> None:
        if tuple(t.data_ptr() % 16 == 0 for t in tensors) != self.aligned:  # Triton specialised on it
            raise ValueError("PreparedLaunch: a tensor's 16-byte alignment differs from the prepared call's")
        head = self.make_head(*tensors)
        if isinstance(self.positions, int):
            args = (*head, *self.template[self.positions:])
        else:
            args = list(self.template)
            for position, value in zip(self.positions, head):
                args[position] = value
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        c = self.compiled
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _hooked(enter) or _hooked(exit_):  # a profiler is listening: hand it what Triton's own launch would
            metadata = c.launch_metadata(self.grid, stream, *args)
            c.run(*self.grid, stream, c.function, c.packed_metadata, metadata, enter, exit_, *args)
        else:
            c.run(*self.grid, stream, c.function, c.packed_metadata, None, None, None, *args)


def rebased_head(prepared: tuple, tensors: tuple) -> Callable[..., tuple]:
    """The per-call arguments from a call's tensors, given the prepared call's arguments (`prepared`: tensors, TMA
    descriptors, None) and tensors: a tensor as given, a descriptor as a copy of the prepared one with the new
    tensor as its base. The copy is exact because the cache key freezes every tensor's shape, strides and dtype,
    which are all a descriptor holds besides its base (block shape, padding and shared-memory layout are the
    kernel's); so a descriptor must be over the tensor the caller passes, with its shape and strides."""
    templates = []  # (position, descriptor class, its fields but the base)
    for position, (arg, t) in enumerate(zip(prepared, tensors)):
        if isinstance(arg, torch.Tensor) or arg is None or not hasattr(arg, "block_shape"):
            continue
        base = arg.base
        if base.shape != t.shape or base.stride() != t.stride() or base.data_ptr() != t.data_ptr():
            raise ValueError("PreparedLaunch without make_head: each descriptor must be over the tensor passed for "
                             "it, as it is shaped (a descriptor over a reshaped view needs a make_head)")
        # without the prepared tensor: a cached launch must not keep it alive
        templates.append((position, type(arg), {name: value for name, value in vars(arg).items() if name != "base"}))
    if not templates:
        return _as_given

    def head(*tensors) -> tuple:
        args = list(tensors)
        for position, cls, fields in templates:
            desc = args[position] = object.__new__(cls)
            desc.__dict__.update(fields, base=tensors[position])
        return args

    return head


def _as_given(*tensors) -> tuple:
    return tensors


def _hooked(hook) -> bool:
    """Whether a Triton launch hook (None, a function, or an empty or non-empty HookChain) would do anything."""
    return hook is not None and bool(getattr(hook, "calls", True))
