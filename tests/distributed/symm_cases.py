"""Symmetric-memory exchange cases run in every rank of an NCCL group, one GPU per rank (dist_spawn.py;
test_symm_exchange_gpu.py): the exchange against the NCCL exchange and the one-GPU layer (forward and backward), a
layer captured in a CUDA graph (inference, and a whole training step), a forced capacity overflow, and the plan's
choice. Every rank builds the same inputs (the spawn seeds each case alike) and raises only after its last
collective."""

from __future__ import annotations

import math

import torch

from flashmoe_science.distributed import ExpertParallelMoE, expert_bounds, expert_parallel_experts
from flashmoe_science.distributed.exchange_plan import ExchangeProblem, describe_exchange, plan_exchange
from flashmoe_science.distributed.symm_exchange import check_exchange_capacity
from flashmoe_science.moe import fused_experts, moe_route


def _bf16_error(got, expected) -> str | None:
    """bf16 against another order of the same sums: each partial rounded once, summed in float32."""
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
    scale = expected.float().abs().max().item() if expected.numel() else 0.0
    err = (got.float() - expected.float()).abs().max().item() if got.numel() else 0.0
    return None if err <= 2e-2 * scale + 1e-3 else f"max abs error {err:.3g} (largest value {scale:.3g})"


def _layer_problem(tokens, num_experts=16, top_k=4, d_model=256, d_ff=128, dtype=torch.bfloat16):
    total = sum(tokens)
    x = torch.randn(total, d_model, dtype=dtype)
    logits = torch.randn(total, num_experts, dtype=dtype)
    w1 = torch.randn(num_experts, 2 * d_ff, d_model, dtype=dtype) / math.sqrt(d_model)
    w2 = torch.randn(num_experts, d_model, d_ff, dtype=dtype) / math.sqrt(d_ff)
    grad = torch.randn(total, d_model, dtype=dtype)
    weights, ids = moe_route(logits, top_k)
    return x, w1, w2, weights, ids, grad


def _run(x, w1, w2, weights, ids, grad, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, weights)]
    if kwargs:
        out = expert_parallel_experts(leaves[0], leaves[1], leaves[2], leaves[3], ids, **kwargs)
    else:
        out = fused_experts(leaves[0], leaves[1], leaves[2], leaves[3], ids)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def symm_matches_nccl_and_one_gpu(rank, world_size):
    tokens = [96 + 32 * r for r in range(world_size)]  # ragged
    num_experts = 16
    x, w1, w2, weights, ids, grad = _layer_problem(tokens, num_experts)
    whole = _run(x, w1, w2, weights, ids, grad)
    rows = slice(sum(tokens[:rank]), sum(tokens[:rank + 1]))
    first, stop = expert_bounds(num_experts, world_size)[rank:rank + 2]
    mine = (x[rows], w1[first:stop], w2[first:stop], weights[rows], ids[rows], grad[rows])
    runs = {exchange: _run(*mine, num_experts=num_experts, exchange=exchange) for exchange in ("nccl", "symm_mem")}
    torch.cuda.synchronize()
    expected = [whole[0][rows], whole[1][rows], whole[2][first:stop], whole[3][first:stop], whole[4][rows]]
    errors = []
    for name, got, nccl, ref in zip(("out", "dx", "dw1", "dw2", "dweights"), runs["symm_mem"], runs["nccl"],
                                    expected):
        for against, value in (("one GPU", ref), ("nccl", nccl)):
            error = _bf16_error(got, value)
            if error:
                errors.append(f"{name} against {against}: {error}")
    if errors:
        raise AssertionError("; ".join(errors))


def _graph_layer(tokens):
    """Qwen3-like in small (d 256, F 128, 16 experts, top-4), buffers for ``tokens`` per rank."""
    return ExpertParallelMoE(256, 128, 16, 4, exchange="symm_mem", max_tokens=tokens, dtype=torch.bfloat16,
                             device=torch.device("cuda", torch.cuda.current_device()))


def _warm_up(step, times=2):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            step()
    torch.cuda.current_stream().wait_stream(side)


def symm_cuda_graph_forward(rank, world_size):
    """A layer's forward captured once, replayed on new tokens: the eager forward's result, bit for bit."""
    tokens = 256
    layer = _graph_layer(tokens)
    static_x = torch.randn(tokens, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        _warm_up(lambda: layer(static_x))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        outs = []
        for _ in range(2):
            fresh = torch.randn(tokens, 256, dtype=torch.bfloat16)
            static_x.copy_(fresh)
            graph.replay()
            outs.append((static_out.clone(), layer(fresh)))
    torch.cuda.synchronize()
    for replayed, eager in outs:
        if not torch.equal(replayed, eager):
            raise AssertionError(f"replay differs from eager: {(replayed.float() - eager.float()).abs().max():.3g}")


def symm_cuda_graph_training_step(rank, world_size):
    """Forward and backward captured in one graph: the replay's output and gradients equal an eager step's."""
    tokens = 256
    layer = _graph_layer(tokens)
    static_x = torch.randn(tokens, 256, dtype=torch.bfloat16, requires_grad=True)
    static_grad = torch.randn(tokens, 256, dtype=torch.bfloat16)

    def step():
        layer.zero_grad(set_to_none=True)
        static_x.grad = None
        out = layer(static_x)
        out.backward(static_grad)
        return out

    _warm_up(step)
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
        static_out.backward(static_grad)
    fresh = torch.randn(tokens, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        static_x.copy_(fresh)
    graph.replay()
    replayed = [t.clone() for t in (static_out, static_x.grad, layer.w1.grad, layer.w2.grad, layer.router.weight.grad)]
    x_eager = fresh.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = layer(x_eager)
    out.backward(static_grad)
    eager = [out.detach(), x_eager.grad, layer.w1.grad, layer.w2.grad, layer.router.weight.grad]
    torch.cuda.synchronize()
    errors = [f"{name}: {error}" for name, got, expected in zip(("out", "dx", "dw1", "dw2", "drouter"), replayed,
                                                                 eager)
              if (error := _bf16_error(got, expected))]
    if errors:
        raise AssertionError("; ".join(errors))


def symm_no_host_sync(rank, world_size):
    """A training step (routing, exchange, experts, backward) with CUDA's synchronising calls made errors
    (``torch.cuda.set_sync_debug_mode``): no host read anywhere."""
    tokens = 256
    layer = _graph_layer(tokens)
    x = torch.randn(tokens, 256, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, 256, dtype=torch.bfloat16)
    layer(x).backward(grad)  # compilations, buffers
    error = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x).backward(grad)
    except RuntimeError as raised:
        error = raised
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if error is not None:
        raise AssertionError(f"a synchronising call in the step: {error}")


def symm_overflow_is_loud(rank, world_size):
    """Every token to experts 0 and 1 (rank 0's) with a small capacity: the tokens past it come back NaN, the
    others exact, and the capacity check raises."""
    tokens, num_experts, top_k, d_model, d_ff = 64, 4 * world_size, 2, 128, 64
    x = torch.randn(tokens, d_model, dtype=torch.bfloat16)
    w1 = torch.randn(num_experts, 2 * d_ff, d_model, dtype=torch.bfloat16) / math.sqrt(d_model)
    w2 = torch.randn(num_experts, d_model, d_ff, dtype=torch.bfloat16) / math.sqrt(d_ff)
    ids = torch.tensor([[0, 1]] * tokens)
    weights = torch.rand(tokens, top_k)
    first, stop = expert_bounds(num_experts, world_size)[rank:rank + 2]
    with torch.no_grad():
        out = expert_parallel_experts(x, w1[first:stop], w2[first:stop], weights, ids, num_experts=num_experts,
                                      exchange="symm_mem", capacity_factor=0.1)
        expected = fused_experts(x, w1, w2, weights, ids)
    torch.cuda.synchronize()
    cap = math.ceil(0.1 * tokens * min(top_k, world_size) / world_size)
    lost = torch.isnan(out).all(dim=1)
    errors = []
    if int(lost.sum()) != tokens - cap or bool(lost[:cap].any()):
        errors.append(f"expected the last {tokens - cap} tokens NaN, got {int(lost.sum())} NaN rows")
    error = _bf16_error(out[:cap], expected[:cap])
    if error:
        errors.append(f"kept rows: {error}")
    try:
        check_exchange_capacity()
        errors.append("check_exchange_capacity did not raise")
    except RuntimeError as raised:
        if "overflow" not in str(raised):
            errors.append(f"unclear overflow error: {raised}")
    if errors:
        raise AssertionError("; ".join(errors))


def symm_plan_takes_one_host_nccl_group(rank, world_size):
    x = torch.randn(4, 8)
    choice = plan_exchange(ExchangeProblem(x, None))
    text = describe_exchange(choice)
    forced = plan_exchange(ExchangeProblem(x, None, "nccl"))
    if choice.backend != "symm_mem" or forced.backend != "nccl" or "symm_mem" not in text:
        raise AssertionError(f"auto chose {choice.backend} ({text}); forced nccl gave {forced.backend}")


# in the order they run: the comparisons first, the CUDA-graph captures last (a capture that fails may leave the
# process's CUDA context unusable for what follows)
CASES = ["symm_matches_nccl_and_one_gpu", "symm_plan_takes_one_host_nccl_group", "symm_no_host_sync",
         "symm_overflow_is_loud", "symm_cuda_graph_forward", "symm_cuda_graph_training_step"]
