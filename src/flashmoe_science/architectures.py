"""The kernel families written for one GPU architecture, in one place: each planner's walk tries these before the
portable Triton kernels and the reference, and `flashmoe-science info` says which of them run here.

A family compares the device's `device.DeviceTraits.arch` with the architecture it declares and declines with its
reason elsewhere; nothing outside this module and the families' own packages names an architecture
(tests/test_architecture.py). Adding one (sm_100) is a backend package (kernels, `tiles.py`, `backend.py`) and its
entries here, in the order the walks should try them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flashmoe_science.attention.hopper.backend import HOPPER, HOPPER_FP8
from flashmoe_science.gluon import availability, target
from flashmoe_science.moe.hopper.backend import HOPPER_GEMMS


@dataclass(frozen=True)
class Architecture:
    """One architecture's kernels: `arch` (what `DeviceTraits.arch` must be), `title` (how `info` names them),
    `status` (whether they build on this triton: one line) and the families each walk tries first."""

    arch: str
    title: str
    status: Callable[[], str]
    attention: tuple = ()
    attention_fp8: tuple = ()
    moe_gemms: tuple = ()


ARCHITECTURES = (
    Architecture(target.ARCH, "Gluon sm_90 kernels", availability.describe, attention=(HOPPER,),
                 attention_fp8=(HOPPER_FP8,), moe_gemms=(HOPPER_GEMMS,)),
)

# The families each walk tries before the portable ones, in order.
ATTENTION = tuple(family for a in ARCHITECTURES for family in a.attention)
ATTENTION_FP8 = tuple(family for a in ARCHITECTURES for family in a.attention_fp8)
MOE_GEMMS = tuple(family for a in ARCHITECTURES for family in a.moe_gemms)
