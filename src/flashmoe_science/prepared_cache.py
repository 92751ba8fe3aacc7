"""The tables of prepared calls (attention, MoE): one registry of them (`prepared_table`, `clear_prepared`), what
their keys hold of a tensor, and their one bound.

A PreparedLaunch (prepared_launch.py) freezes everything but its tensors, so a cache of them is keyed on each
tensor's signature and on the call's other arguments. Kept apart from prepared_launch so that the front doors can
key their calls without importing Triton (the CPU reference path does not need it).
"""

from __future__ import annotations

import weakref

import torch

# Prepared calls kept per table: ragged workloads make a new signature per length, and an MoE layer's call holds
# about 12 kernel launches per token count.
CACHE_MAX = 1024
# A cache's mark for a signature seen once: it is prepared on its second call (preparing costs about one more
# binding, which a signature seen once never repays; packed batches whose sequence count changes every step make a
# new signature per step).
SEEN_ONCE = object()


def tensor_signature(t) -> tuple:
    """What a PreparedLaunch freezes from a tensor argument, and so what a cache key must hold of it: shape,
    strides, dtype, device and 16-byte alignment (Triton specialises on it). The stride of a dimension of size 1
    is never multiplied by anything but index 0, so it is left out: a (1, H, L, D) output that a (L, H, D)
    allocation transposed and a fresh one share a signature."""
    shape, strides = t.shape, t.stride()
    if 1 in shape:  # the common call has no size-1 dim: its strides as they are (a key built per call)
        strides = tuple(0 if size == 1 else stride for size, stride in zip(shape, strides))
    return (shape, strides, t.dtype, t.device, t.data_ptr() % 16)


# Every table of prepared calls in the library, by name (`prepared_table`): the attention calls, a GPU forward's
# launches, the backward plans, the MoE calls and the MoE kernels' launches. One bound (`remember`), one way to empty
# them all (`clear_prepared`: after changing what a call's plan reads from the environment, or in tests).
TABLES: dict[str, dict] = {}


def prepared_table(name: str) -> dict:
    """The table of prepared calls named `name`, registered in TABLES (created on first use)."""
    return TABLES.setdefault(name, {})


def clear_prepared() -> None:
    """Empty every table of prepared calls: the next call of each signature takes the full path again."""
    for table in TABLES.values():
        table.clear()


def remember(cache: dict, key, prepared) -> None:
    """``cache[key] = prepared``, emptying the cache first once it holds CACHE_MAX entries (bounded memory)."""
    if len(cache) >= CACHE_MAX:
        cache.clear()
    cache[key] = prepared


class TensorMemo:
    """Values derived from tensors' contents (a check passed, a table computed on the device), remembered while
    those very tensors live unwritten: an entry counts only while weak references to its tensors still point at
    them (a freed tensor's id and memory may be reused by the next batch's) and their version counters are
    unchanged (an in-place write bumps `_version`). Inference tensors have no version counter: never remembered.
    Nothing is read or remembered while a CUDA graph is captured: a value computed then is not computed yet (the
    graph computes it at each replay, from the tensors' contents then), and one from before would be frozen into
    the graph while the tensors change between replays. Bounded (`max_entries`; emptied when full)."""

    __slots__ = ("entries", "max_entries")

    def __init__(self, max_entries: int = 64):
        self.entries: dict[tuple, tuple] = {}
        self.max_entries = max_entries

    def get(self, tensors: tuple, extra=None):
        """The value remembered for these tensors (and `extra`, what else it was derived from), or None."""
        if _capturing(tensors[0]):
            return None
        entry = self.entries.get((*map(id, tensors), extra))
        if entry is None:
            return None
        refs, versions, value = entry
        for ref, t, version in zip(refs, tensors, versions):
            if ref() is not t or t._version != version:
                return None
        return value

    def put(self, tensors: tuple, extra, value) -> None:
        if any(t.is_inference() for t in tensors) or _capturing(tensors[0]):
            return
        if len(self.entries) >= self.max_entries:
            self.entries.clear()
        self.entries[(*map(id, tensors), extra)] = (tuple(map(weakref.ref, tensors)),
                                                    tuple(t._version for t in tensors), value)


def _capturing(t) -> bool:
    """Whether a CUDA graph is being captured on the current stream (never for CPU tensors)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
