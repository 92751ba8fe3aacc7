"""The kernel families written for one GPU architecture, in one place: each planner's walk tries these before the
portable Triton kernels and the reference, and `flashmoe-science info` says which of them run here.

A family compares the device's `device.DeviceTraits.arch` with the architecture it declares and declines with its
reason elsewhere; nothing outside this module and the families' own packages names an architecture
(tests/test_architecture.py). Adding one (sm_100) is a backend package (kernels, `tiles.py`, `backend.py`) and its
entries here, in the order the walks should try them.

Families are named here ("module:attribute") and imported by the walk that tries them: planning attention imports
no MoE backend, planning the MoE GEMMs no attention backend. `ATTENTION`, `ATTENTION_FP8` and `MOE_GEMMS` are each
walk's families, imported on first use (`families`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from flashmoe_science.gluon import availability, target


@dataclass(frozen=True)
class Architecture:
    """One architecture's kernels: `arch` (what `DeviceTraits.arch` must be), `title` (how `info` names them),
    `status` (whether they build on this triton: one line) and the families each walk tries first, named
    "module:attribute"."""

    arch: str
    title: str
    status: Callable[[], str]
    attention: tuple[str, ...] = ()
    attention_fp8: tuple[str, ...] = ()
    moe_gemms: tuple[str, ...] = ()


ARCHITECTURES = (
    Architecture(target.ARCH, "Gluon sm_90 kernels", availability.describe,
                 attention=("flashmoe_science.attention.hopper.backend:HOPPER",),
                 attention_fp8=("flashmoe_science.attention.hopper.backend:HOPPER_FP8",),
                 moe_gemms=("flashmoe_science.moe.hopper.backend:HOPPER_GEMMS",)),
)

WALKS = {"ATTENTION": "attention", "ATTENTION_FP8": "attention_fp8", "MOE_GEMMS": "moe_gemms"}


def families(walk: str) -> tuple:
    """The families every architecture puts first in `walk` ("attention", "attention_fp8" or "moe_gemms"), in
    order, importing only their modules."""
    found = []
    for architecture in ARCHITECTURES:
        for name in getattr(architecture, walk):
            module, _, attribute = name.partition(":")
            found.append(getattr(importlib.import_module(module), attribute))
    return tuple(found)


def __getattr__(name: str):
    """ATTENTION, ATTENTION_FP8, MOE_GEMMS: `families` of that walk, imported on first use."""
    if name not in WALKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = families(WALKS[name])
    return value
