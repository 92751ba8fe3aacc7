"""Repeating a Triton/Gluon kernel launch without Triton's per-call binding.

`kernel[grid](...)` re-binds and re-specialises every argument and looks the compiled kernel up on each call:
tens of microseconds of host time, which on a small problem is longer than the GPU work (docs/perf-notes.md, host
time). A PreparedLaunch does that once for one call signature and afterwards hands the compiled kernel only
the arguments that change per call: the tensors (or TMA descriptors over them). Everything else (shapes, strides,
scalars, constexprs, grid) is frozen, so the caller must key its cache of prepared launches on all of it, and on
each tensor's 16-byte alignment, which Triton specialises on (see attention.call.prepared_key).
"""

from __future__ import annotations

from typing import Callable

from triton import knobs
from triton.runtime.driver import driver


class PreparedLaunch:
    """One call signature's launch of `kernel`, ready to repeat on new tensors.

    `bound`: every kernel parameter by name, as for `kernel[grid](**bound, **options)`, which must have been
    launched (or warmed up) with them already: the compiled kernel is taken from Triton's cache. `make_head(*tensors)`
    builds the kernel arguments that change per call (tensors, descriptors) from the call's tensors: the leading
    parameters, or those named in `live` (in that order) where per-call tensors sit among frozen scalars (a packed
    batch's cumulative lengths); every other parameter is frozen from `bound`.
    """

    __slots__ = ("compiled", "grid", "make_head", "template", "positions", "aligned")

    def __init__(self, kernel, grid: tuple[int, ...], bound: dict, options: dict,
                 make_head: Callable[..., tuple], tensors: tuple, live: tuple[str, ...] | None = None):
        self.compiled = kernel.warmup(grid=grid, **bound, **options)
        self.grid = (*grid, 1, 1)[:3]
        self.make_head = make_head
        names = list(kernel.arg_names)
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


def _hooked(hook) -> bool:
    """Whether a Triton launch hook (None, a function, or an empty or non-empty HookChain) would do anything."""
    return hook is not None and bool(getattr(hook, "calls", True))
