"""Expert-parallel MoE in 2 and 4 CPU processes (gloo): outputs and gradients equal the whole layer run in one
process on every rank's tokens (moe_cases.py; ragged token counts, a rank without tokens, a rank that receives none)."""

from pathlib import Path

import pytest

import moe_cases
from flashmoe_science.distributed import expert_bounds
from interpreter_driver import interpreter_suite, run_marked_suite

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("case", moe_cases.CASES)
def test_expert_parallel(distributed_case, world_size, case):
    distributed_case(world_size, f"moe_cases.{case}")


def test_expert_bounds():
    assert expert_bounds(8, 4) == [0, 2, 4, 6, 8]
    assert expert_bounds(7, 4) == [0, 2, 4, 6, 7]


@pytest.mark.parametrize("num_experts,world_size", [(8, 4), (7, 4), (128, 3), (5, 5), (9, 2), (64, 8)])
def test_owner_arithmetic_matches_expert_bounds(num_experts, world_size):
    """The plan's device arithmetic (owner and first expert of every id) is expert_bounds' table."""
    import torch

    from flashmoe_science.distributed.pair_plan import owner_and_start as _owner_and_start

    bounds = expert_bounds(num_experts, world_size)
    ids = torch.arange(num_experts)
    owner, start = _owner_and_start(ids, num_experts, world_size)
    expected = torch.tensor([next(r for r in range(world_size) if bounds[r] <= e < bounds[r + 1])
                             for e in range(num_experts)])
    assert torch.equal(owner, expected)
    assert torch.equal(start, torch.tensor(bounds)[expected])


@pytest.mark.slow
@interpreter_suite(HERE / "plan_interpreter_cases.py", HERE / "exchange_interpreter_cases.py")
def test_triton_plan_under_interpreter(request):
    """The plan's kernels against the PyTorch plan and a loop over tokens (plan_interpreter_cases.py), the
    symmetric-memory exchange's kernels on an emulated group against the whole layer (exchange_interpreter_cases.py),
    then the layer planned by the plan's kernels in 4 gloo ranks (ep_interpreter_cases.py): each in a process
    started with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    import ep_interpreter_cases
    from dist_spawn import run_cases

    run_marked_suite(request)
    names = [f"ep_interpreter_cases.{case}" for case in ep_interpreter_cases.CASES]
    errors = {name: error for name, error in run_cases(names, 4, env={"TRITON_INTERPRET": "1"}).items() if error}
    if errors:
        pytest.fail("\n".join(f"{name}: {error}" for name, error in errors.items()), pytrace=False)


@pytest.mark.parametrize("world_size", (2,))
def test_distributed_bench_harness(distributed_case, world_size):
    distributed_case(world_size, "bench_cases.bench_scaling_smoke")


def test_cli_suite_distributed_without_torchrun_or_gpu(capsys):
    import torch

    from flashmoe_science.cli import main

    if torch.cuda.is_available():
        pytest.skip("with a GPU the command runs the one-GPU overlap measurement")
    assert main(["bench", "--suite", "distributed"]) == 2
    assert "torchrun" in capsys.readouterr().err


@pytest.mark.parametrize("max_tokens,top_k,world_size,factor,expected", [
    (16384, 8, 4, None, 16384),  # room for every token: never overflows
    (16384, 8, 4, 1.25, 16384),  # k >= W: a destination may get every token, at most max_tokens
    (1000, 2, 8, 1.0, 250),  # the average a destination gets from a source: T·min(k, W)/W
    (1000, 2, 8, 1.5, 375),
    (3, 1, 4, 0.1, 1),  # at least one row
])
def test_symm_exchange_capacity(max_tokens, top_k, world_size, factor, expected):
    from flashmoe_science.distributed.symm_exchange import capacity

    assert capacity(max_tokens, top_k, world_size, factor) == expected
