"""The expert-parallel plan's Triton kernels (distributed/triton_plan.py) under the CPU interpreter, against the
PyTorch plan (pair_plan.plan_pairs_reference) and a loop over tokens that states the send order directly.

Not collected directly (no ``test_`` prefix): ``test_expert_parallel.py`` runs this file in a subprocess with
``TRITON_INTERPRET=1`` (Triton decides between compiling and interpreting when a kernel module is imported).
Run by hand: ``TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest tests/distributed/plan_interpreter_cases.py -q``.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (see test_expert_parallel.py)", allow_module_level=True)

from flashmoe_science.distributed import expert_bounds  # noqa: E402
from flashmoe_science.distributed.pair_plan import plan_pairs_reference as _plan_pairs  # noqa: E402
from flashmoe_science.distributed.triton_plan import plan_pairs  # noqa: E402


def _loop_plan(ids, num_experts, world_size, chunks):
    """(send_counts, slots, pair_token, pair_ids) by walking chunks, then destinations, then tokens."""
    bounds = expert_bounds(num_experts, world_size)
    owner = {e: r for r in range(world_size) for e in range(bounds[r], bounds[r + 1])}
    num_tokens, top_k = ids.shape
    counts = torch.zeros(world_size, chunks, dtype=torch.int64)
    slots = torch.full((num_tokens, world_size), -1, dtype=torch.int64)
    pair_token, pair_ids = [], []
    for c in range(chunks):
        for w in range(world_size):
            for t in range(c * num_tokens // chunks, (c + 1) * num_tokens // chunks):
                row = [int(e) for e in ids[t]]
                if w not in [owner.get(e) for e in row]:
                    continue
                counts[w, c] += 1
                slots[t, w] = len(pair_token)
                pair_token.append(t)
                pair_ids.append([e - bounds[w] if owner.get(e) == w else -1 for e in row])
    return (counts, slots, torch.tensor(pair_token, dtype=torch.int64),
            torch.tensor(pair_ids, dtype=torch.int32).reshape(-1, top_k))


def _run(plan, ids, num_experts, world_size, chunks, **sizes):
    # poisoned outputs: every entry the plan reads back must have been written
    send_counts = torch.full((world_size, chunks), -7, dtype=torch.int64)
    called = []
    slots, pair_token, pair_ids = plan(ids, num_experts, world_size, send_counts, lambda: called.append(
        send_counts.clone()), **sizes)
    assert len(called) == 1 and torch.equal(called[0], send_counts), "counts_ready: once, after the counts"
    sent = int(send_counts.sum())
    return send_counts, slots, pair_token[:sent], pair_ids[:sent]


def _check(ids, num_experts, world_size, chunks, with_torch=True, **sizes):
    expected = _loop_plan(ids, num_experts, world_size, chunks)
    got = _run(plan_pairs, ids, num_experts, world_size, chunks, **sizes)
    plans = [("triton", got)]
    if with_torch:
        plans.append(("torch", _run(_plan_pairs, ids, num_experts, world_size, chunks)))
    for plan, result in plans:
        for name, value, reference in zip(("send_counts", "slots", "pair_token", "pair_ids"), result, expected):
            assert value.dtype == reference.dtype, f"{plan} {name}: dtype {value.dtype}"
            assert torch.equal(value, reference), f"{plan} {name}:\n{value}\nexpected\n{reference}"


def _random_ids(num_tokens, top_k, num_experts, generator):
    # distinct experts per token, as top-k routing picks them
    return torch.rand(num_tokens, num_experts, generator=generator).argsort(1)[:, :top_k].contiguous()


@pytest.mark.parametrize("world_size", (1, 2, 4, 8))
@pytest.mark.parametrize("num_tokens, chunks", [(0, 2), (1, 1), (2, 3), (3, 4), (37, 3), (64, 2), (101, 1)])
def test_random_routing(world_size, num_tokens, chunks):
    generator = torch.Generator().manual_seed(1000 * world_size + num_tokens)
    num_experts = 3 * world_size + 1  # E not a multiple of W: the first rank owns one expert more
    top_k = min(num_experts, 4)
    ids = _random_ids(num_tokens, top_k, num_experts, generator)
    # blocks of 8 tokens, 2 per counts step: chunks cross block and step boundaries at these token counts
    _check(ids, num_experts, world_size, chunks, block=8, step=16)


@pytest.mark.parametrize("world_size, top_k", [(4, 4), (8, 8), (8, 3)])
def test_tokens_visiting_every_rank_or_one(world_size, top_k):
    generator = torch.Generator().manual_seed(world_size + top_k)
    num_experts = 2 * world_size + 1
    bounds = expert_bounds(num_experts, world_size)
    ids = _random_ids(29, top_k, num_experts, generator)
    ids[0] = torch.tensor(bounds[:top_k])  # the first expert of top_k ranks: every rank when top_k >= W
    ids[5] = torch.arange(bounds[1] - top_k, bounds[1]).clamp(min=0) if bounds[1] >= top_k else ids[5]
    _check(ids, num_experts, world_size, 2, block=4, step=8)


def test_a_rank_no_token_visits():
    generator = torch.Generator().manual_seed(3)
    world_size, num_experts = 4, 10
    ids = _random_ids(40, 3, 7, generator)  # experts 7-9 (the last rank's) are never chosen
    _check(ids, num_experts, world_size, 3, block=4, step=16)


def test_ids_outside_the_experts_visit_no_rank():
    """Ids outside [0, E) (the slots `fused_experts` skips) send nothing; the PyTorch plan does not take them."""
    generator = torch.Generator().manual_seed(4)
    ids = _random_ids(23, 3, 9, generator)
    ids[4] = -1  # a token visiting no rank
    ids[7, 1] = 9
    ids[11, :2] = -5
    _check(ids, 9, 2, 2, with_torch=False, block=4, step=8)


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64))
def test_default_program_sizes_and_strided_ids(dtype):
    """The GPU's block and group sizes, on ids read through a transposed view."""
    generator = torch.Generator().manual_seed(5)
    ids = _random_ids(300, 8, 128, generator).to(dtype).t().contiguous().t()
    _check(ids, 128, 4, 2)
