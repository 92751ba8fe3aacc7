"""Helpers of the sm_90 tests: the Hopper kernel modules on a Hopper GPU, and the SASS of an offline build."""

from __future__ import annotations

import importlib

import pytest
import torch


def hopper_attention_module(name: str):
    """`flashmoe_science.attention.hopper.<name>` (e.g. "fwd_sm90", "bwd_sm90"); skips the test off Hopper."""
    from flashmoe_science.device import device_traits

    if not torch.cuda.is_available() or not device_traits(torch.device("cuda")).is_hopper:
        pytest.skip("needs a Hopper (sm_90) GPU")
    return importlib.import_module(f"flashmoe_science.attention.hopper.{name}")


def sass_or_skip(compiled) -> str:
    """The SASS of an offline build (skips the test where triton ships no cuobjdump)."""
    from flashmoe_science.gluon.build import offline_sass

    sass = offline_sass(compiled)
    if sass is None:
        pytest.skip("no cuobjdump in this triton")
    return sass
