"""Expert-parallel MoE cases run in every rank of a gloo group (see dist_spawn.py): the sharded layer against the
whole layer in one process on all ranks' tokens, outputs and gradients (float32)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashmoe_science.distributed import ExpertParallelMoE, expert_parallel_experts
from flashmoe_science.distributed.expert_parallel import expert_bounds
from flashmoe_science.moe import fused_experts
from flashmoe_science.nn import FusedMoE



def _check(name, got, expected):
    """float32 against the same layer in one process: summation order only (and TF32-class dots on the GPU)."""
    atol, rtol = (1e-4, 1e-3) if got.is_cuda else (1e-5, 1e-4)
    if got.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}")
    if not torch.allclose(got, expected, atol=atol, rtol=rtol):
        err = (got - expected).abs().max().item()
        raise AssertionError(f"{name}: max abs error {err:.3g} (atol {atol}, rtol {rtol})")


def _compare_module(rank, world_size, tokens_per_rank, *, num_experts=8, top_k=2, d_model=16, d_ff=8, chunks=2,
                    avoid_rank=None, scoring="softmax", dtype=torch.float32, check=_check):
    """Every rank builds the same FusedMoE and the same tokens of all ranks; the reference runs the whole layer."""
    layer = FusedMoE(d_model, d_ff, num_experts, top_k, scoring=scoring, dtype=dtype)
    if avoid_rank is not None:  # no token is routed to this rank's experts: it receives nothing
        with torch.no_grad():
            first, stop = expert_bounds(num_experts, world_size)[avoid_rank:avoid_rank + 2]
            layer.router.weight[first:stop] = 0.0
            layer.router.weight[first:stop, 0] = -1e4
    x_all = torch.randn(sum(tokens_per_rank), d_model, dtype=dtype)
    if avoid_rank is not None:
        x_all[:, 0] = x_all[:, 0].abs() + 0.1
    grad_all = torch.randn_like(x_all)
    sharded = ExpertParallelMoE.from_fused_moe(layer, overlap_chunks=chunks)

    x_ref = x_all.clone().requires_grad_()
    layer(x_ref).backward(grad_all)
    rows = slice(sum(tokens_per_rank[:rank]), sum(tokens_per_rank[:rank + 1]))
    x = x_all[rows].clone().requires_grad_()
    out = sharded(x)
    out.backward(grad_all[rows])
    router_grad = sharded.router.weight.grad.float()
    dist.all_reduce(router_grad)  # replicated router: the data-parallel sum (before any check can raise)
    router_grad = router_grad.cpu()  # after the reduce: NCCL reduces device tensors only
    check("out", out.detach(), layer(x_all).detach()[rows])
    check("dx", x.grad, x_ref.grad[rows])
    first, stop = sharded.expert_range
    check("dw1", sharded.w1.grad, layer.w1.grad[first:stop])
    check("dw2", sharded.w2.grad, layer.w2.grad[first:stop])
    check("drouter", router_grad, layer.router.weight.grad.float().cpu())


def ep_even(rank, world_size):
    _compare_module(rank, world_size, [6] * world_size)


def ep_ragged_tokens(rank, world_size):
    # unequal token counts, one rank with none, experts not a multiple of the ranks, top-3 of 7
    tokens = [5, 0, 9, 3][:world_size]
    _compare_module(rank, world_size, tokens, num_experts=7, top_k=3)


def ep_rank_receives_nothing(rank, world_size):
    _compare_module(rank, world_size, [4] * world_size, avoid_rank=world_size - 1, chunks=3)


def ep_no_overlap_sigmoid(rank, world_size):
    _compare_module(rank, world_size, [7] * world_size, chunks=1, scoring="sigmoid", top_k=world_size)


def _check_bf16(name, got, expected):
    scale = expected.float().abs().max().item()
    err = (got.float() - expected.float()).abs().max().item()
    if err > 2e-2 * scale + 1e-3:
        raise AssertionError(f"{name}: bf16 max abs error {err:.3g} (largest value {scale:.3g})")


def ep_bf16_matches_one_process(rank, world_size):
    # bf16: the same experts as one process, each token's partials rounded once and summed in float32
    _compare_module(rank, world_size, [64 + 16 * r for r in range(world_size)], num_experts=16, top_k=4,
                    d_model=128, d_ff=64, dtype=torch.bfloat16, check=_check_bf16)


def ep_functional_weights_grad(rank, world_size):
    # expert_parallel_experts directly: routing weights as a leaf, all gradients against fused_experts
    num_experts, top_k, d, f = 2 * world_size, 2, 16, 8
    w1, w2 = torch.randn(num_experts, 2 * f, d), torch.randn(num_experts, d, f)
    tokens = [3 + r for r in range(world_size)]
    x_all = torch.randn(sum(tokens), d)
    ids_all = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(sum(tokens))])
    weights_all = torch.rand(sum(tokens), top_k)
    grad_all = torch.randn(sum(tokens), d)
    ref = [t.clone().requires_grad_() for t in (x_all, w1, w2, weights_all)]
    fused_experts(ref[0], ref[1], ref[2], ref[3], ids_all).backward(grad_all)

    rows = slice(sum(tokens[:rank]), sum(tokens[:rank + 1]))
    first, stop = expert_bounds(num_experts, world_size)[rank:rank + 2]
    mine = [x_all[rows].clone(), w1[first:stop].clone(), w2[first:stop].clone(), weights_all[rows].clone()]
    for t in mine:
        t.requires_grad_()
    out = expert_parallel_experts(mine[0], mine[1], mine[2], mine[3], ids_all[rows], num_experts=num_experts)
    out.backward(grad_all[rows])
    expected_grads = (ref[0].grad[rows], ref[1].grad[first:stop], ref[2].grad[first:stop], ref[3].grad[rows])
    for name, t, expected in zip(("dx", "dw1", "dw2", "dweights"), mine, expected_grads):
        _check(name, t.grad, expected)


def ep_bad_input(rank, world_size):
    x, w1, w2 = torch.randn(4, 16), torch.randn(3, 16, 16), torch.randn(3, 16, 8)
    ids, weights = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    for kwargs, fragment in ((dict(num_experts=100 * world_size), "w1 must hold this rank's"),
                             (dict(num_experts=1), "at least the group's size"),
                             (dict(num_experts=3 * world_size, overlap_chunks=0), "overlap_chunks"),
                             (dict(num_experts=3 * world_size, exchange="nvshmem"), "exchange must be one of"),
                             (dict(num_experts=3 * world_size, capacity_factor=0), "capacity_factor"),
                             (dict(num_experts=3 * world_size, max_tokens=0), "max_tokens")):
        try:
            expert_parallel_experts(x, w1, w2, weights, ids, **kwargs)
        except ValueError as error:
            if fragment not in str(error):
                raise AssertionError(f"{error!r} lacks {fragment!r}") from error
        else:
            raise AssertionError(f"no error for {kwargs}")


def ep_exchange_plan_off_nvlink(rank, world_size):
    # gloo (CPU tensors, or CUDA tensors staged through the host): the NCCL exchange, with symmetric memory's reason;
    # asked for by name, symmetric memory refuses with it
    from flashmoe_science.distributed.exchange_plan import ExchangeProblem, describe_exchange, plan_exchange

    if dist.get_backend() == "nccl":  # the NCCL groups' choice: symm_cases.symm_plan_takes_one_host_nccl_group
        return
    x = torch.randn(4, 8)
    choice = plan_exchange(ExchangeProblem(x, None))
    why = choice.why_not("symm_mem") or ""
    if choice.backend != "nccl" or not ("cpu" in why or "gloo" in why):
        raise AssertionError(describe_exchange(choice))
    layer = ExpertParallelMoE(8, 4, 2 * world_size, 1, exchange="symm_mem", device=x.device)
    try:
        layer(x)
    except ValueError as error:
        if "symm_mem" not in str(error):
            raise AssertionError(f"{error!r} does not name the exchange") from error
    else:
        raise AssertionError("exchange='symm_mem' on a gloo group ran")


CASES = [name for name in dir() if name.startswith("ep_")]
