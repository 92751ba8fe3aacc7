"""The distributed benchmark behind `flashmoe-science bench --suite distributed`.

Under ``torchrun --nproc-per-node N`` (N > 1; NCCL on GPUs, gloo on CPUs), `run_scaling_bench`:

- ``ring-attention``: `ring_attention` over the zig-zag sharded sequence (B=1, H=8, D=128, causal, bf16) at 128k to
  1M tokens, forward and forward+backward, each ``kv_exchange`` ("flashmoe-ring/allgather", "flashmoe-ring/ring";
  forward+backward also with ``grad_exchange="allgather"``, "flashmoe-ring/allgather+grad-allgather"), against
  `flash_attention_science` on the whole sequence on one GPU. ``efficiency = ms_1gpu / (N · ms)``: tokens/s
  on N GPUs over N times tokens/s on one (1.0 = perfect scaling). PyTorch's ``context_parallel`` SDPA runs in the
  same pass where this torch has it (``backend`` "torch-cp"; ours carry ``speed_vs_torch_cp``).
- On GPUs every record of ours also carries what a ``torch.profiler`` trace of one call shows: ``comm_ms`` (NCCL
  kernels, or the symmetric-memory exchange's stores to peers and barriers: ``COMM_KERNELS``), ``comm_hidden`` (the share of it overlapped by computing kernels) and ``compute_idle_ms``.
- ``ep-moe``: `ExpertParallelMoE`'s computation (routing, exchange, local experts, combine) at Qwen3-30B-A3B shapes
  (E=128, top-8, d=2048, F=768) with T=16384 tokens per GPU, against `fused_moe` of the whole layer on T tokens on
  one GPU; ``efficiency`` = tokens/s per GPU over the one-GPU layer's; each ``exchange``: NCCL at
  ``overlap_chunks`` 1 (no overlap), 2 and 4, and symmetric memory where the plan takes it. Then the decode-like
  regime: the forward at T=2048 per GPU, the one-GPU layer and the symmetric-memory exchange timed as CUDA-graph
  replays (``timing``), the NCCL exchange eagerly (its host read of the counts cannot be captured).

Timing: the same number of calls on every rank (a collective must be entered by all ranks, so a per-rank adaptive timer
such as ``do_bench`` cannot be used; the count follows the slowest rank's first call); each call starts after a
barrier; the record keeps the slowest rank's median. A 1M-token run of the whole suite takes several minutes.

Without torchrun on a GPU, `run_overlap_bench` measures on the one GPU what a ring step overlaps: the local kernel of
a balanced zig-zag step (2c queries against c keys, non-causal) alone, the transfer of the next K/V shard alone
(a device-to-device copy on a side stream, standing in for the NCCL receive), and both at once. ``hidden`` is the
share of the transfer that the overlapped step hides, ``nvlink_ms`` what the shard takes at ``NVLINK_GBPS`` (H200
NVLink 4, one direction), against which ``kernel_ms`` must be long for the ring to scale. `run_ep_local_bench` times
one expert-parallel rank's expert work on what it would receive (W = 2, 4, 8) against the whole layer on one GPU.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from flashmoe_science.bench.moe import MODELS, expert_gemm_flops
from flashmoe_science.errors import CommandError

RING_LENGTHS = (131072, 262144, 524288, 1048576)
RING_SHAPE = dict(batch=1, heads=8, head_dim=128)
EP_MODEL, EP_TOKENS = "qwen3-30b-a3b", 16384
EP_CHUNKS = (1, 2, 4)  # overlap_chunks of the NCCL exchange: 1 is no overlap
EP_DECODE_TOKENS = 2048  # the decode-like regime, timed as CUDA-graph replays
# kernels that move data between GPUs (lower-case name fragments): NCCL's; the symmetric-memory exchange's stores to
# the peers (triton_exchange) and its signal-pad barriers
COMM_KERNELS = ("nccl", "_dispatch_kernel", "_return_kernel", "barrier")
OVERLAP_SHARDS = (8192, 16384, 32768, 65536, 131072)  # c: the chunk length; a rank holds 2c tokens
NVLINK_GBPS = 450.0
# CPU (gloo) smoke sizes: the harness, not a measurement
CPU_RING_LENGTHS, CPU_RING_SHAPE = (64, 128), dict(batch=1, heads=2, head_dim=16)
CPU_EP = dict(num_experts=8, top_k=2, d_model=32, d_ff=16)
CPU_EP_TOKENS = 32
PASSES = ("fwd", "fwd+bwd")


# ------------------------------------------------------------------------------------------------ timing
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collective_median_ms(fn, device, group=None, budget_s: float = 6.0) -> float:
    """Median ms of ``fn`` with every rank making the same calls (a collective inside must be entered by all): one
    untimed call, then as many timed ones as fit ``budget_s`` by the slowest rank's first call (3 to 10); each
    timed call starts after a barrier. Returns the slowest rank's median."""
    first = _timed_ms(fn, device, group)
    first = _slowest(first, device, group)
    reps = max(3, min(10, int(budget_s * 1e3 / max(first, 1e-3))))
    if first < 100:  # short calls: a few more untimed ones (clocks, caches, Triton's first launches)
        for _ in range(2):
            fn()
    times = [_timed_ms(fn, device, group) for _ in range(reps)]
    return _slowest(statistics.median(times), device, group)


def _timed_ms(fn, device, group) -> float:
    if dist.is_initialized():
        dist.barrier(group)
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _slowest(ms: float, device, group) -> float:
    value = torch.tensor([ms], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def _pass_fn(forward, inputs, pass_: str):
    """The call a pass times: the forward alone (no autograd), or forward and backward from a fixed gradient."""
    if pass_ == "fwd":
        def run():
            with torch.no_grad():
                forward(*inputs)
        return run
    leaves = [t.detach().requires_grad_() for t in inputs]
    grad = None

    def run():
        nonlocal grad
        for t in leaves:
            t.grad = None
        out = forward(*leaves)
        grad = torch.randn_like(out) if grad is None else grad
        out.backward(grad)
    return run


# ------------------------------------------------------------------------------------------------ ring attention
def _ring_records(world_size, rank, group, device, dtype, lengths, shape, progress, on_length=None) -> list[dict]:
    from flashmoe_science.attention.api import flash_attention_science
    from flashmoe_science.distributed import ring_attention
    from flashmoe_science.distributed.ring_attention import EXCHANGES
    from flashmoe_science.distributed.zigzag import shard_lengths

    batch, heads, head_dim = shape["batch"], shape["heads"], shape["head_dim"]
    records = []
    for seqlen in lengths:
        local = shard_lengths(seqlen, world_size)[rank]
        q, k, v = (torch.randn(batch, heads, local, head_dim, device=device, dtype=dtype) for _ in range(3))
        full = [torch.randn(batch, heads, seqlen, head_dim, device=device, dtype=dtype) for _ in range(3)]
        base = dict(op="ring-attention", L=seqlen, B=batch, H=heads, D=head_dim, causal=True, world_size=world_size,
                    dtype=str(dtype).removeprefix("torch."))
        for pass_ in PASSES:
            if pass_ == "fwd+bwd" and not _backward_fits(seqlen, shape, device, dtype):
                if progress is not None:
                    progress.update(desc=f"ring L={seqlen} {pass_}: skipped, over the GPU's memory")
                continue
            one_gpu = _collective_median_ms(
                _pass_fn(lambda *t: flash_attention_science(*t, causal=True), full, pass_), device, group)
            torch_cp = _torch_context_parallel_ms(full, group, world_size, device, pass_)
            if torch_cp is not None:
                records.append(_scaling_record(base, pass_, "torch-cp", torch_cp, one_gpu, seqlen, world_size))
            # each forward exchange with the ring backward; forward+backward also the all-gather backward
            configs = [(e, "ring") for e in EXCHANGES] + [("allgather", "allgather")] * (pass_ == "fwd+bwd")
            for exchange, grad_exchange in configs:
                run = _pass_fn(lambda *t, e=exchange, g=grad_exchange: ring_attention(
                    *t, group, causal=True, kv_exchange=e, grad_exchange=g), (q, k, v), pass_)
                ms = _collective_median_ms(run, device, group)
                name = f"flashmoe-ring/{exchange}" + ("" if grad_exchange == "ring" else f"+grad-{grad_exchange}")
                record = _scaling_record(base, pass_, name, ms, one_gpu, seqlen, world_size)
                record["kv_exchange"] = exchange
                if pass_ == "fwd+bwd":
                    record["grad_exchange"] = grad_exchange
                if torch_cp is not None:
                    record["speed_vs_torch_cp"] = round(torch_cp / ms, 4)
                records.append({**record, **_comm_overlap(run, device, group)})
            if progress is not None:
                progress.update(desc=f"ring L={seqlen} {pass_}")
        del q, k, v, full
        if on_length is not None:
            on_length(records)
    return records


# Live (B, H, L, D) tensors of the longest sequence during a forward+backward row (the one-GPU baseline's inputs,
# outputs and gradients, context_parallel's and ours' buffers): at L=1M, H=8, D=128 (2 GiB each) an 80 GB H100 ran
# out of memory with 73 GiB allocated, asking for 2 more (40); the all-gather backward adds the gathered K/V (2)
# and their float32 gradients (4).
LIVE_FULL_TENSORS = 46


def _backward_fits(seqlen: int, shape: dict, device, dtype) -> bool:
    """Whether a forward+backward row at this length fits the GPU (every rank decides alike: same card, same
    arithmetic, so no rank waits in a collective the others skip)."""
    if device.type != "cuda":
        return True
    one = shape["batch"] * shape["heads"] * seqlen * shape["head_dim"] * torch.finfo(dtype).bits // 8
    return LIVE_FULL_TENSORS * one <= torch.cuda.get_device_properties(device).total_memory


def _kernel_intervals(profile) -> tuple[list, list]:
    """(communication, computation) kernel intervals (start_us, end_us) of a profiled call: the kernels named by
    ``COMM_KERNELS`` are the communication, every other kernel the computation (copies done by copy engines are
    neither)."""
    comm, compute = [], []
    for event in profile.events():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA or event.time_range.elapsed_us() <= 0:
            continue
        name = event.name.lower()
        if "memcpy" in name or "memset" in name:
            continue
        (comm if any(part in name for part in COMM_KERNELS) else compute).append(
            (event.time_range.start, event.time_range.end))
    return comm, compute


def _union(intervals) -> list[tuple[float, float]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _comm_overlap(run, device, group) -> dict:
    """What a trace of one call shows (``torch.profiler``, CUDA kernels, rank by rank, the worst rank kept): the
    time NCCL kernels run (``comm_ms``), the share of it during which a computing kernel also runs
    (``comm_hidden``: 1 = every transfer overlapped), and the time the GPU runs no computing kernel between the
    call's first and last kernel (``compute_idle_ms``)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    dist.barrier(group)
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        run()
        _sync(device)
    try:
        comm, compute = _kernel_intervals(trace)
    except (AttributeError, RuntimeError) as error:  # a profiler without device events: no trace numbers
        print(f"trace unavailable: {type(error).__name__}: {error}")
        comm, compute = [], []
    comm, compute = _union(comm), _union(compute)
    comm_us = sum(end - start for start, end in comm)
    hidden_us = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in comm for s2, e2 in compute)
    span = (compute[-1][1] - compute[0][0]) if compute else 0.0
    idle_us = span - sum(end - start for start, end in compute)
    worst = torch.tensor([comm_us, -(hidden_us / comm_us if comm_us else 1.0), idle_us], dtype=torch.float64,
                         device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return {"comm_ms": round(worst[0].item() / 1e3, 4), "comm_hidden": round(-worst[1].item(), 3),
            "compute_idle_ms": round(worst[2].item() / 1e3, 4)}


def _scaling_record(base, pass_, backend, ms, ms_1gpu, tokens, world_size) -> dict:
    return {**base, "pass": pass_, "backend": backend, "ms": round(ms, 4), "ms_1gpu": round(ms_1gpu, 4),
            "tokens_per_s": round(tokens / (ms * 1e-3)), "efficiency": round(ms_1gpu / (world_size * ms), 4)}


_MESHES: dict[int, object] = {}


def _torch_context_parallel_ms(full, group, world_size, device, pass_) -> float | None:
    """PyTorch's ``context_parallel`` SDPA on the same problem (its own sharding of the full buffers), or None
    where this torch lacks it or it fails (the failure is printed by rank 0)."""
    if device.type != "cuda":
        return None
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        if world_size not in _MESHES:  # one mesh (and its communicator) per run
            _MESHES[world_size] = init_device_mesh("cuda", (world_size,))
        mesh = _MESHES[world_size]
        buffers = [t.clone() for t in full]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            run = _pass_fn(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), buffers, pass_)
            return _collective_median_ms(run, device, group)
    except Exception as error:  # a baseline that cannot run is reported, not fatal
        if dist.get_rank() == 0:
            print(f"torch context_parallel baseline skipped: {type(error).__name__}: {error}")
        return None


# ------------------------------------------------------------------------------------------------ expert parallel
def _ep_inputs(world_size, rank, device, dtype, config, tokens, model):
    """One rank's layer inputs (tokens, router logits, every expert's weights and this rank's slice of them) and the
    fields every expert-parallel record shares."""
    from flashmoe_science.distributed import expert_bounds

    num_experts, top_k, d_model, d_ff = (config[name] for name in ("num_experts", "top_k", "d_model", "d_ff"))
    x = torch.randn(tokens, d_model, device=device, dtype=dtype)
    logits = torch.randn(tokens, num_experts, device=device, dtype=dtype)
    w1 = torch.randn(num_experts, 2 * d_ff, d_model, device=device, dtype=dtype) / math.sqrt(d_model)
    w2 = torch.randn(num_experts, d_model, d_ff, device=device, dtype=dtype) / math.sqrt(d_ff)
    first, stop = expert_bounds(num_experts, world_size)[rank:rank + 2]
    base = dict(op="ep-moe", model=model, E=num_experts, top_k=top_k, d_model=d_model, d_ff=d_ff, T=tokens,
                world_size=world_size, dtype=str(dtype).removeprefix("torch."))
    return x, logits, w1, w2, w1[first:stop].clone(), w2[first:stop].clone(), base


def _ep_records(world_size, rank, group, device, dtype, config, tokens, model, progress) -> list[dict]:
    from flashmoe_science.moe import fused_moe

    num_experts, top_k, d_model, d_ff = (config[name] for name in ("num_experts", "top_k", "d_model", "d_ff"))
    x, logits, w1, w2, w1_local, w2_local, base = _ep_inputs(world_size, rank, device, dtype, config, tokens, model)
    records = []
    for pass_ in PASSES:
        one_gpu = _collective_median_ms(
            _pass_fn(lambda *t: fused_moe(*t, top_k), (x, w1, w2, logits), pass_), device, group)
        for exchange, chunks in _ep_configs(x, group):
            run = _pass_fn(_ep_layer(group, num_experts, top_k, tokens, exchange, chunks),
                           (x, w1_local, w2_local, logits), pass_)
            ms = _collective_median_ms(run, device, group)
            records.append({**base, **_comm_overlap(run, device, group), "pass": pass_,
                            "backend": _ep_backend(exchange, chunks), "exchange": exchange, "overlap_chunks": chunks,
                            **_ep_rates(ms, one_gpu, tokens, top_k, d_model, d_ff, pass_)})
            if progress is not None:
                progress.update(desc=f"ep {model} {pass_} {exchange} chunks={chunks}")
    return records


def _ep_configs(x, group) -> list[tuple[str, int]]:
    """(exchange, overlap_chunks) to time: the NCCL exchange at each of EP_CHUNKS, and the symmetric-memory
    exchange (one piece) where the plan takes it."""
    from flashmoe_science.distributed.exchange_plan import ExchangeProblem, plan_exchange

    configs = [("nccl", chunks) for chunks in EP_CHUNKS]
    if plan_exchange(ExchangeProblem(x, group)).backend == "symm_mem":
        configs.append(("symm_mem", 1))
    return configs


def _ep_backend(exchange: str, chunks: int) -> str:
    return f"flashmoe-ep/{exchange}" + (f"/chunks={chunks}" if exchange == "nccl" else "")


def _ep_layer(group, num_experts, top_k, tokens, exchange, chunks):
    """One EP layer call on this rank's tokens: the routing, the exchange, the local experts, the combine."""
    from flashmoe_science.distributed import expert_parallel_experts
    from flashmoe_science.moe import moe_route

    def layer(x, w1, w2, logits):
        weights, ids = moe_route(logits, top_k)
        return expert_parallel_experts(x, w1, w2, weights, ids, group, num_experts=num_experts,
                                       overlap_chunks=chunks, exchange=exchange, max_tokens=tokens)
    return layer


def _ep_rates(ms, one_gpu, tokens, top_k, d_model, d_ff, pass_) -> dict:
    flops = expert_gemm_flops(tokens, top_k, d_model, d_ff, "fwd" if pass_ == "fwd" else "bwd")
    return {"ms": round(ms, 4), "ms_1gpu": round(one_gpu, 4), "tokens_per_s_per_gpu": round(tokens / (ms * 1e-3)),
            "tflops_per_gpu": round(flops / (ms * 1e-3) / 1e12, 1), "efficiency": round(one_gpu / ms, 4)}


def _graph_replay_ms(fn, device, group) -> float:
    """`_collective_median_ms` of replays of ``fn`` captured in a CUDA graph (after two warm-up calls on a side
    stream: compilations, buffers); every rank captures and replays alike."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _collective_median_ms(graph.replay, device, group)


def _ep_graph_records(world_size, rank, group, device, dtype, config, tokens, model, progress) -> list[dict]:
    """The decode-like regime: the forward at few tokens per GPU, timed as CUDA-graph replays (the one-GPU layer
    and the symmetric-memory exchange; the NCCL exchange reads counts on the host, so it runs eagerly)."""
    from flashmoe_science.moe import fused_moe

    num_experts, top_k, d_model, d_ff = (config[name] for name in ("num_experts", "top_k", "d_model", "d_ff"))
    x, logits, w1, w2, w1_local, w2_local, base = _ep_inputs(world_size, rank, device, dtype, config, tokens, model)
    local = (x, w1_local, w2_local, logits)
    base["pass"] = "fwd"
    with torch.no_grad():
        one_gpu = _graph_replay_ms(lambda: fused_moe(x, w1, w2, logits, top_k), device, group)
        records = []
        for exchange, chunks in ((e, c) for e, c in _ep_configs(x, group) if c == 1):
            layer = _ep_layer(group, num_experts, top_k, tokens, exchange, chunks)
            graphed = exchange == "symm_mem"
            ms = (_graph_replay_ms(lambda: layer(*local), device, group) if graphed
                  else _collective_median_ms(lambda: layer(*local), device, group))
            records.append({**base, "backend": _ep_backend(exchange, chunks) + ("/graph" if graphed else ""),
                            "exchange": exchange, "overlap_chunks": chunks, "timing": "graph" if graphed else "eager",
                            "timing_1gpu": "graph", **_ep_rates(ms, one_gpu, tokens, top_k, d_model, d_ff, "fwd")})
            if progress is not None:
                progress.update(desc=f"ep {model} T={tokens} {exchange}")
    return records


def run_scaling_bench(group=None, quick: bool = False, progress=None, on_length=None,
                      ops=("ep-moe", "ring-attention")) -> list[dict]:
    """The multi-rank suite on an initialised process group (every rank calls it; every rank gets the records).
    ``on_length(records)``: called after each part of the EP records and after each ring length with the records so
    far (partial results). ``ops``: the parts to run."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    on_gpu = torch.cuda.is_available() and dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    ep, ring = [], []
    if on_gpu:
        # EP first: minutes shorter than the ring's 1M-token lengths, so a run cut short keeps it in the partial JSON
        lengths = RING_LENGTHS[:2] if quick else RING_LENGTHS
        if "ep-moe" in ops:
            config = MODELS[EP_MODEL]
            ep = _ep_records(world_size, rank, group, device, dtype, config, EP_TOKENS, EP_MODEL, progress)
            if on_length is not None:
                on_length(ep)
            ep += _ep_graph_records(world_size, rank, group, device, dtype, config, EP_DECODE_TOKENS, EP_MODEL,
                                    progress)
            if on_length is not None:
                on_length(ep)
        if "ring-attention" in ops:
            ring = _ring_records(world_size, rank, group, device, dtype, lengths, RING_SHAPE, progress,
                                 None if on_length is None else (lambda so_far: on_length(ep + so_far)))
    else:
        if "ring-attention" in ops:
            ring = _ring_records(world_size, rank, group, device, dtype, CPU_RING_LENGTHS, CPU_RING_SHAPE, progress)
        if "ep-moe" in ops:
            ep = _ep_records(world_size, rank, group, device, dtype, CPU_EP, CPU_EP_TOKENS, "cpu-smoke", progress)
    return ring + ep


# ------------------------------------------------------------------------------------------------ one GPU: overlap
def _cuda_ms(fn, reps: int = 10) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def run_overlap_bench(shards=OVERLAP_SHARDS, progress=None) -> list[dict]:
    """One GPU: a ring step's local kernel against the transfer of the next K/V shard (see the module docstring)."""
    side = torch.cuda.Stream()
    records = []
    for chunk in shards:
        for record in _overlap_records(chunk, side):  # one function call per size: its tensors go with it
            records.append(record)
            if progress is not None:
                progress.update(desc=f"overlap c={chunk} {record['pass']}")
    return records


def _overlap_records(chunk: int, side) -> list[dict]:
    from flashmoe_science.distributed.ring_attention import attention_backward_lse, attention_forward_lse

    device, dtype = torch.device("cuda"), torch.bfloat16
    batch, heads, head_dim = RING_SHAPE["batch"], RING_SHAPE["heads"], RING_SHAPE["head_dim"]
    scale = 1 / math.sqrt(head_dim)
    q = torch.randn(batch, heads, 2 * chunk, head_dim, device=device, dtype=dtype)
    kv = torch.randn(2, batch, heads, 2 * chunk, head_dim, device=device, dtype=dtype)
    k, v = kv[0][..., :chunk, :], kv[1][..., :chunk, :]  # a balanced zig-zag step: 2c queries, c keys
    grad = torch.randn_like(q)
    out, lse = attention_forward_lse(q, k, v, causal=False, softmax_scale=scale, window=None)
    # what travels per step: the K/V shard forward; backward also the float32 dK/dV accumulator
    payloads = {"fwd": [kv], "bwd": [kv, torch.zeros(kv.shape, dtype=torch.float32, device=device)]}
    kernels = {
        "fwd": lambda: attention_forward_lse(q, k, v, causal=False, softmax_scale=scale, window=None),
        "bwd": lambda: attention_backward_lse(q, k, v, out, lse, grad, causal=False, softmax_scale=scale,
                                              window=None),
    }
    records = []
    for pass_, kernel in kernels.items():
        sources = payloads[pass_]
        targets = [torch.empty_like(t) for t in sources]

        def transfer(also=None, sources=sources, targets=targets):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for target, source in zip(targets, sources):
                    target.copy_(source, non_blocking=True)
            if also is not None:
                also()
            torch.cuda.current_stream().wait_stream(side)

        kernel_ms, copy_ms, both_ms = _cuda_ms(kernel), _cuda_ms(transfer), _cuda_ms(lambda: transfer(kernel))
        nvlink_ms = sum(t.numel() * t.element_size() for t in sources) / (NVLINK_GBPS * 1e9) * 1e3
        records.append({"op": "ring-step-overlap", "pass": pass_, "chunk": chunk, "L_local": 2 * chunk,
                        "L_global_8gpu": 16 * chunk, "H": heads, "D": head_dim, "kernel_ms": round(kernel_ms, 4),
                        "copy_ms": round(copy_ms, 4), "overlapped_ms": round(both_ms, 4),
                        "hidden": round(min(1.0, max(0.0, (kernel_ms + copy_ms - both_ms) / copy_ms)), 3),
                        "slowdown": round(both_ms / kernel_ms, 3), "nvlink_ms": round(nvlink_ms, 4),
                        "compute_over_nvlink": round(kernel_ms / nvlink_ms, 2)})
    return records


def run_ep_local_bench(world_sizes=(2, 4, 8), tokens: int = EP_TOKENS, progress=None) -> list[dict]:
    """One GPU: the expert work of one rank of expert parallelism without the exchange. Rank 0 of W receives, from
    all W ranks' T tokens each, every token routed to one of its E/W experts (its other slots -1) and runs them with
    `fused_experts`; against `fused_moe` of the whole layer on T tokens. The ratio bounds the EP efficiency from the
    compute side (the same expert GEMM work, more rows to sort)."""
    from flashmoe_science.bench.report import gpu_median_ms
    from flashmoe_science.distributed import expert_bounds
    from flashmoe_science.moe import fused_experts, fused_moe, moe_route

    config = MODELS[EP_MODEL]
    num_experts, top_k, d_model, d_ff = (config[name] for name in ("num_experts", "top_k", "d_model", "d_ff"))
    device, dtype = torch.device("cuda"), torch.bfloat16
    w1 = torch.randn(num_experts, 2 * d_ff, d_model, device=device, dtype=dtype) / math.sqrt(d_model)
    w2 = torch.randn(num_experts, d_model, d_ff, device=device, dtype=dtype) / math.sqrt(d_ff)
    x = torch.randn(tokens, d_model, device=device, dtype=dtype)
    logits = torch.randn(tokens, num_experts, device=device, dtype=dtype)
    records = []
    for pass_ in PASSES:
        one_gpu = gpu_median_ms(_pass_fn(lambda *t: fused_moe(*t, top_k), (x, w1, w2, logits), pass_),
                                sustained=True)
        for world_size in world_sizes:
            local = expert_bounds(num_experts, world_size)[1]  # rank 0's experts: [0, local)
            weights, ids = moe_route(torch.randn(world_size * tokens, num_experts, device=device, dtype=dtype), top_k)
            rows = (ids < local).any(dim=1).nonzero().squeeze(1)
            local_ids = torch.where(ids[rows] < local, ids[rows], -1)
            x_recv = torch.randn(rows.numel(), d_model, device=device, dtype=dtype)
            run = _pass_fn(lambda x, w1, w2, w, ids=local_ids: fused_experts(x, w1, w2, w, ids),
                           (x_recv, w1[:local].clone(), w2[:local].clone(), weights[rows].contiguous()), pass_)
            ms = gpu_median_ms(run, sustained=True)
            records.append({"op": "ep-local-experts", "model": EP_MODEL, "T": tokens, "world_size": world_size,
                            "pass": pass_, "rows_received": rows.numel(), "ms": round(ms, 4),
                            "ms_1gpu": round(one_gpu, 4), "efficiency": round(one_gpu / ms, 4)})
            if progress is not None:
                progress.update(desc=f"ep-local W={world_size} {pass_}")
    return records


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_torchrun() -> None:
    """The process group torchrun describes: NCCL with one GPU per local rank where CUDA is there, else gloo."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")


RING_FIELDS = ("L", "world_size", "pass")
EP_FIELDS = ("model", "T", "world_size", "pass")
OVERLAP_FIELDS = ("pass", "chunk", "L_local", "kernel_ms", "copy_ms", "overlapped_ms", "hidden", "slowdown",
                  "nvlink_ms", "compute_over_nvlink")


def run_from_cli(args) -> int:
    """`flashmoe-science bench --suite distributed`: the scaling suite under torchrun, else the one-GPU overlap
    measurement; rank 0 prints the tables and writes the JSON (`--out`)."""
    from flashmoe_science.bench.report import (PartialResults, Progress, environment_metadata, format_table,
                                               resolve_commit, write_results)

    if launched_by_torchrun():
        init_from_torchrun()
        rank = dist.get_rank()
        envelope = environment_metadata(resolve_commit(args.commit))
        partial = PartialResults(args.out, envelope) if rank == 0 else None
        with Progress(desc="distributed", stream=None if rank == 0 else open(os.devnull, "w")) as progress:
            records = run_scaling_bench(quick=args.quick, progress=progress, on_length=partial,
                                        ops=args.ops or ("ep-moe", "ring-attention"))
        dist.barrier()
        tables = [("ring attention (efficiency = ms_1gpu / (N x ms))",
                   [r for r in records if r["op"] == "ring-attention"], (*RING_FIELDS, "backend")),
                  ("expert-parallel MoE (efficiency = tokens/s per GPU / one-GPU layer's)",
                   [r for r in records if r["op"] == "ep-moe"], (*EP_FIELDS, "backend"))]
        columns = ("ms", "ms_1gpu", "efficiency", "comm_ms", "comm_hidden", "compute_idle_ms")
    elif torch.cuda.is_available():
        rank = 0
        print(f"one GPU ({torch.cuda.get_device_name(0)}): a ring step's local kernel against the next shard's "
              "transfer; for the scaling suite run under `torchrun --nproc-per-node N`")
        with Progress(desc="overlap") as progress:
            records = run_overlap_bench(OVERLAP_SHARDS[:3] if args.quick else OVERLAP_SHARDS, progress)
            records += run_ep_local_bench(progress=progress)
        tables = [("ring step overlap", [r for r in records if r["op"] == "ring-step-overlap"], OVERLAP_FIELDS),
                  ("one EP rank's experts without the exchange (efficiency = ms_1gpu / ms)",
                   [r for r in records if r["op"] == "ep-local-experts"],
                   ("world_size", "pass", "rows_received", "ms", "ms_1gpu", "efficiency"))]
        columns = ()
    else:
        raise CommandError("bench --suite distributed needs torchrun (`torchrun --nproc-per-node N -m "
                           "flashmoe_science.cli bench --suite distributed`; gloo on CPUs runs a small smoke test) "
                           "or a CUDA GPU")
    if rank == 0:
        for title, rows, fields in tables:
            print(f"\n{title}")
            print(format_table([*fields, *columns], [[str(r.get(f)) for f in (*fields, *columns)] for r in rows]))
        envelope = envelope if launched_by_torchrun() else environment_metadata(resolve_commit(args.commit))
        path = write_results(args.out, envelope, records)
        print(f"\nresults: {path}")
        if launched_by_torchrun():
            partial.finish()
            plotted = plot_scaling(records, path.with_suffix(".png"))
            if plotted is not None:
                print(f"plot: {plotted}")
    if launched_by_torchrun():
        dist.destroy_process_group()
    return 0


def plot_scaling(records: list[dict], path):
    """Efficiency against the sequence length (ring attention, one panel per pass, a line per backend) and against
    the overlap chunks (expert parallelism), as PNG; None without matplotlib or records."""
    from flashmoe_science.bench.report import plot_panels

    panels: dict[str, dict[str, list]] = {}
    for r in records:
        if r["op"] == "ring-attention":
            title, x = f"ring attention {r['pass']}, {r['world_size']} GPUs", r["L"]
        elif r["op"] == "ep-moe":
            title, x = f"expert-parallel MoE, T={r['T']}, {r['world_size']} GPUs", r["overlap_chunks"]
        else:
            continue
        label = r["backend"] if r["op"] == "ring-attention" else f"flashmoe-ep/{r['exchange']} {r['pass']}"
        panels.setdefault(title, {}).setdefault(label, []).append((x, r["efficiency"]))
    return plot_panels(path, panels, "tokens (ring) / overlap chunks (EP)", "efficiency",
                       "scaling efficiency (1.0 = N GPUs do N times the work)") if panels else None
