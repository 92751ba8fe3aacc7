"""The expert-parallel plan on a GPU: the Triton plan (two launches) equals the PyTorch plan at the bench's routing
shapes, T not a multiple of the chunks and T < chunks; both plans' device ops counted by
benchmarks/tools/profile_ep_plan.py."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location(
    "profile_ep_plan", Path(__file__).resolve().parents[2] / "benchmarks/tools/profile_ep_plan.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


@pytest.mark.parametrize("world_size", (2, 4, 8, 16))
@pytest.mark.parametrize("tokens, chunks", [(16384, 2), (16387, 3), (3, 4), (1, 1)])
def test_triton_plan_matches_pytorch_plan(world_size, tokens, chunks):
    from flashmoe_science.distributed.pair_plan import plan_pairs_reference as _plan_pairs
    from flashmoe_science.distributed.triton_plan import plan_pairs

    topk_ids = tool.routing(tokens, "cuda")
    got = tool.plan_once(plan_pairs, topk_ids, world_size, chunks)
    expected = tool.plan_once(_plan_pairs, topk_ids, world_size, chunks)
    for name, a, b in zip(("send_counts", "slots", "pair_token", "pair_ids"), got, expected):
        assert torch.equal(a, b), name


def test_triton_plan_is_two_kernels():
    from flashmoe_science.distributed.pair_plan import plan_pairs_reference as _plan_pairs
    from flashmoe_science.distributed.triton_plan import plan_pairs

    topk_ids = tool.routing(16384, "cuda")
    ops = tool.device_ops(plan_pairs, topk_ids, 2, 2)
    reference = tool.device_ops(_plan_pairs, topk_ids, 2, 2)
    # the two kernels and the counts read (one memcpy)
    assert (ops["kernels"], ops["memcpy"], ops["memset"]) == (2, 1, 0), ops
    assert reference["kernels"] > 10, reference
