"""Helpers of the sm_90 tests: the Hopper kernel modules on a Hopper GPU, and the SASS of an offline build."""

from __future__ import annotations

import importlib

import pytest
import torch


def hopper_attention_module(name: str):
    """`flashmoe_science.attention.hopper.<name>` (e.g. "fwd_sm90", "bwd_sm90"); skips the test off Hopper."""
    from flashmoe_science.device import device_traits
    from flashmoe_science.gluon.target import ARCH

    if not torch.cuda.is_available() or device_traits(torch.device("cuda")).arch != ARCH:
        pytest.skip("needs a Hopper (sm_90) GPU")
    return importlib.import_module(f"flashmoe_science.attention.hopper.{name}")


def sass_or_skip(compiled) -> str:
    """The SASS of an offline build (skips the test where triton ships no cuobjdump)."""
    from flashmoe_science.gluon.build import offline_sass

    sass = offline_sass(compiled)
    if sass is None:
        pytest.skip("no cuobjdump in this triton")
    return sass


# A 132-SM Hopper (H100 SXM and H200): its SM count and opt-in shared memory per block
HOPPER_TRAITS = (132, 232448)


def hopper_forward_plan(batch: int, heads: int, seqlen: int, window, head_dim: int = 128):
    """(problem, backend.forward_plan, its describe text) of a dense causal bf16 call with `window` as planned on a
    132-SM Hopper, without a GPU (meta tensors: nothing is allocated)."""
    from unittest import mock

    from flashmoe_science.attention.hopper import backend
    from flashmoe_science.attention.problem import dense_problem
    from flashmoe_science.device import DeviceTraits

    q = torch.empty(batch, heads, seqlen, head_dim, dtype=torch.bfloat16, device="meta")
    problem = dense_problem(q, q, q, causal=True, window=window)[0]
    with mock.patch.object(backend, "device_traits", lambda device: DeviceTraits((9, 0), *HOPPER_TRAITS)):
        plan = backend.forward_plan(problem)
        return problem, plan, plan.describe(problem, "", "", "")
