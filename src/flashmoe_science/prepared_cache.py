"""The caches of prepared calls (attention.api, moe.api): what their keys hold of a tensor, and their bound.

A PreparedLaunch (prepared_launch.py) freezes everything but its tensors, so a cache of them is keyed on each
tensor's signature and on the call's other arguments. Kept apart from prepared_launch so that the front doors can
key their calls without importing Triton (the CPU reference path does not need it).
"""

from __future__ import annotations

# Prepared calls kept per cache: ragged workloads make a new signature per length.
CACHE_MAX = 512


def tensor_signature(t) -> tuple:
    """What a PreparedLaunch freezes from a tensor argument, and so what a cache key must hold of it: shape,
    strides, dtype, device and 16-byte alignment (Triton specialises on it)."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def remember(cache: dict, key, prepared) -> None:
    """``cache[key] = prepared``, emptying the cache first once it holds CACHE_MAX entries (bounded memory)."""
    if len(cache) >= CACHE_MAX:
        cache.clear()
    cache[key] = prepared
