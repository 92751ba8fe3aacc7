"""The symmetric-memory exchange's kernels (distributed/triton_exchange.py) and steps (distributed/symm_exchange.py)
under the CPU interpreter, on an emulated group: W ranks' buffers are plain CPU tensors in one process, reached
through the same byte distances the kernels use between GPUs, and the ranks' steps run in lockstep
(``symm_exchange.run_lockstep``). Forward and backward against the whole layer in float64 (``fused_experts`` on
every rank's tokens), the receive buffers against a loop over tokens, and a capacity overflow.

Not collected directly (no ``test_`` prefix): ``test_expert_parallel.py`` runs this file in a subprocess with
``TRITON_INTERPRET=1``. By hand:
``TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest tests/distributed/exchange_interpreter_cases.py -q``.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (see test_expert_parallel.py)", allow_module_level=True)

from flashmoe_science.distributed import expert_bounds  # noqa: E402
from flashmoe_science.distributed.symm_exchange import (LocalExperts, backward_steps, emulated_group,  # noqa: E402
                                                        forward_steps, plan_route, run_lockstep)
from flashmoe_science.moe import fused_experts  # noqa: E402


def _problem(tokens, num_experts, top_k, d_model, d_ff, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(tokens)
    x = torch.randn(total, d_model, generator=gen, dtype=torch.float64)
    w1 = torch.randn(num_experts, 2 * d_ff, d_model, generator=gen, dtype=torch.float64) / d_model ** 0.5
    w2 = torch.randn(num_experts, d_model, d_ff, generator=gen, dtype=torch.float64) / d_ff ** 0.5
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(total)]).reshape(total, top_k)
    weights = torch.rand(total, top_k, generator=gen).double()  # float32 values: the exchange sends float32
    grad = torch.randn(total, d_model, generator=gen, dtype=torch.float64)
    return x, w1, w2, ids, weights, grad


def _exchange(tokens, num_experts, top_k, d_model=40, d_ff=16, capacity_factor=None, seed=0):
    """The emulated group's forward and backward; with the reference's results and each rank's pieces."""
    world_size = len(tokens)
    x, w1, w2, ids, weights, grad = _problem(tokens, num_experts, top_k, d_model, d_ff, seed)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    expected = fused_experts(*leaves[:2], leaves[2], leaves[3], ids, backend="reference")
    expected.backward(grad)
    group = emulated_group(world_size, max(tokens), d_model, top_k, torch.float64, capacity_factor)
    bounds = expert_bounds(num_experts, world_size)
    starts = [sum(tokens[:r]) for r in range(world_size + 1)]
    rows = [slice(starts[r], starts[r + 1]) for r in range(world_size)]
    experts = [LocalExperts(w1[bounds[r]:bounds[r + 1]], w2[bounds[r]:bounds[r + 1]], (True,) * 4, "reference")
               for r in range(world_size)]
    routes = [plan_route(ids[rows[r]], num_experts, world_size) for r in range(world_size)]
    outs = run_lockstep([forward_steps(group[r], x[rows[r]], weights[rows[r]].float(), ids[rows[r]], routes[r],
                                       num_experts, experts[r].forward) for r in range(world_size)])
    grads = run_lockstep([backward_steps(group[r], grad[rows[r]], routes[r], experts[r].backward, True, True)
                          for r in range(world_size)])
    return dict(group=group, rows=rows, bounds=bounds, expected=expected.detach(), leaves=leaves, outs=outs,
                grads=grads, experts=experts, routes=routes, ids=ids, x=x)


def _close(name, got, expected, rtol=1e-12):
    """float64 rows: summation order only; ``rtol`` 1e-6 for what travels in float32 (the routing weights and
    their gradients)."""
    assert got.shape == expected.shape, (name, got.shape, expected.shape)
    if not got.numel():
        return
    err = (got.double() - expected.double()).abs().max().item()
    assert err <= rtol * max(1.0, expected.abs().max().item()), f"{name}: max abs error {err:.3g}"


@pytest.mark.parametrize("tokens, num_experts, top_k", [
    ([24, 24, 24, 24], 8, 2),  # more tokens than a program's block, d not a power of 2
    ([20, 0, 33, 3], 7, 3),  # ragged, a rank without tokens, E not a multiple of W
    ([17, 9], 4, 2),  # top-k = W: every token may visit both ranks
])
def test_forward_backward_match_whole_layer(tokens, num_experts, top_k):
    run = _exchange(tokens, num_experts, top_k)
    x_ref, w1_ref, w2_ref, weights_ref = run["leaves"]
    for r, rows in enumerate(run["rows"]):
        first, stop = run["bounds"][r:r + 2]
        dx, dweights = run["grads"][r]
        _close(f"rank {r} out", run["outs"][r], run["expected"][rows])
        _close(f"rank {r} dx", dx, x_ref.grad[rows])
        _close(f"rank {r} dweights", dweights, weights_ref.grad[rows], rtol=1e-6)
        _close(f"rank {r} dw1", run["experts"][r].dw1, w1_ref.grad[first:stop])
        _close(f"rank {r} dw2", run["experts"][r].dw2, w2_ref.grad[first:stop])
        run["group"][r].check_capacity()  # the default capacity never overflows


def test_receive_buffers_hold_each_source_in_token_order():
    """Rank w's rows from source s: s's tokens that visit w, in token order, at rows [s·cap, s·cap + count)."""
    tokens, num_experts, top_k = [13, 6, 21], 6, 2
    run = _exchange(tokens, num_experts, top_k, d_model=8)
    group, bounds, ids, x = run["group"], run["bounds"], run["ids"], run["x"]
    cap = group[0].capacity
    for w, buffers in enumerate(group):
        for s, rows in enumerate(run["rows"]):
            visiting = [t for t in range(rows.start, rows.stop)
                        if any(bounds[w] <= int(e) < bounds[w + 1] for e in ids[t])]
            assert int(buffers.counts_recv[s]) == len(visiting), (w, s)
            for i, t in enumerate(visiting):
                local = [int(e) - bounds[w] if bounds[w] <= int(e) < bounds[w + 1] else -1 for e in ids[t]]
                assert buffers.ids_recv[s * cap + i].tolist() == local, (w, s, i)


def test_capacity_overflow_gives_nan_rows_and_a_clear_error():
    tokens, num_experts, top_k = [32, 32], 4, 2
    run = _exchange(tokens, num_experts, top_k, capacity_factor=0.25)
    group = run["group"]
    cap = group[0].capacity
    assert cap == 8  # 0.25 · 32 · min(2, 2) / 2
    overflowed = 0
    for r, rows in enumerate(run["rows"]):
        slots, send_counts = run["routes"][r]
        offsets = torch.cumsum(send_counts[:, 0], 0) - send_counts[:, 0]
        lost = ((slots >= 0) & (slots - offsets >= cap)).any(dim=1)
        out = run["outs"][r]
        assert torch.isnan(out[lost]).all() and not torch.isnan(out[~lost]).any()
        _close(f"rank {r} kept rows", out[~lost], run["expected"][rows][~lost])
        dx, _ = run["grads"][r]
        assert torch.isnan(dx[lost]).all() and not torch.isnan(dx[~lost]).any()
        if int(send_counts.max()) > cap:
            overflowed += 1
            with pytest.raises(RuntimeError, match="capacity is 8"):
                group[r].check_capacity()
    assert overflowed == 2


@pytest.mark.parametrize("needs", [(True, True, True, True), (False, False, True, False), (True, False, False, True)])
def test_autograd_function_on_one_rank(needs):
    """`SymmExpertParallel` (the autograd function the GPU path applies) on a group of one, its barrier a no-op:
    the gradients asked for, and None for the others, as the whole layer's."""
    from flashmoe_science.distributed.symm_exchange import SymmExpertParallel

    tokens, num_experts, top_k = 21, 4, 2
    x, w1, w2, ids, weights, grad = _problem([tokens], num_experts, top_k, 24, 8)
    expected_leaves = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    expected = fused_experts(*expected_leaves[:3], expected_leaves[3], ids, backend="reference")
    expected.backward(grad)
    group = emulated_group(1, tokens, 24, top_k, torch.float64)
    leaves = [t.clone().requires_grad_(need) for t, need in zip((x, weights, w1, w2), needs)]
    out = SymmExpertParallel.apply(leaves[0], leaves[1], leaves[2], leaves[3], ids, group[0], num_experts,
                                   "reference", True)
    _close("out", out.detach(), expected.detach())
    out.backward(grad)
    references = (expected_leaves[0].grad, expected_leaves[3].grad, expected_leaves[1].grad, expected_leaves[2].grad)
    for name, leaf, need, reference in zip(("dx", "dweights", "dw1", "dw2"), leaves, needs, references):
        if need:
            _close(name, leaf.grad, reference, rtol=1e-6 if name == "dweights" else 1e-12)
        else:
            assert leaf.grad is None, name
