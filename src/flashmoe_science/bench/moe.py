"""MoE layer benchmark: ours against the two ways PyTorch users run a Mixture-of-Experts FFN today.

Each backend runs the whole layer from router logits: softmax top-k routing (renormalised), SwiGLU experts,
weighted combine. Records, one per measurement:
    {"op": "moe", "model", "pass", "T", "E", "top_k", "d_model", "d_ff", "dtype", "backend", "ms", "tflops"}

- ``flashmoe``: ``fused_moe`` (GPU sort by expert, grouped Triton GEMMs with fused gather/SwiGLU/combine).
- ``torch-loop``: a loop over experts that gathers each expert's tokens and ``index_add_``s the results
  (the Hugging Face implementation's shape; one host synchronisation per expert).
- ``torch-grouped-mm``: ``torch._grouped_mm`` over tokens sorted by expert with ``argsort`` (offsets are int32
  cumulative counts), SwiGLU and weighting as separate ops, ``index_add_`` to combine.
TFLOP/s count the expert GEMMs only: forward 2·T·k·(2F·d + d·F), backward twice that. GPU times are medians of
``triton.testing.do_bench``; cases of 0.25 TFLOP or more after 3 s of back-to-back calls (``sustained_window``,
``report.gpu_median_ms``: such a layer runs at the GPU's power cap, and training runs in that settled state; each
record's ``warmup_ms`` says which window it had); backward is timed alone (one forward with grads on x, w1, w2 and the router logits,
then ``torch.autograd.grad`` with the graph retained). A backend that raises on a shape (out of memory, no
backward) gets no record there and the run goes on. On a CPU-only machine the shapes shrink by 32 in d and F
and only T=16 runs (a smoke test of the harness, not a measurement).

Every record says how it was timed: ``"timing": "eager"`` (each call launched from Python: on few tokens this
includes host time wherever the host is slower than the GPU), or ``"cuda-graph"``: the forward at T <= 16
(decode) captured once in a CUDA graph and replayed, as serving engines run it, which leaves the GPU's time alone;
backends that synchronise with the host cannot be captured and get no such record. Forward records at T <= 16
also carry ``weight_gbps``: the bytes of the experts the tokens were routed to (3·d·F each), read once, per
second: the bound for few tokens is reading those weights.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from flashmoe_science.bench.report import (SHORT_WARMUP_MS, SUSTAINED_WARMUP_MS, gpu_median_ms, median_over_rounds,
                                           round_significant, tflops)
from flashmoe_science.moe import fused_moe

MODELS = {
    "mixtral-8x7b": dict(num_experts=8, top_k=2, d_model=4096, d_ff=14336),
    "qwen3-30b-a3b": dict(num_experts=128, top_k=8, d_model=2048, d_ff=768),
}
TOKENS = (1, 16, 256, 4096, 16384)
SUSTAINED_FROM_FLOPS = 2.5e11  # expert GEMM FLOPs from which a case is timed in the sustained window
DECODE_TOKENS = 16  # forward calls with at most this many tokens also run under a CUDA graph and report weight_gbps
QUICK_TOKENS = (16, 4096)
CPU_TOKENS = (16,)
CPU_SHRINK = 32
PASSES = ("fwd", "bwd")
BACKENDS = ("flashmoe", "torch-loop", "torch-grouped-mm")


def expert_gemm_flops(num_tokens: int, top_k: int, d_model: int, d_ff: int, pass_: str) -> float:
    forward = 2.0 * num_tokens * top_k * (2 * d_ff * d_model + d_model * d_ff)
    return forward if pass_ == "fwd" else 2.0 * forward


# ------------------------------------------------------------------------------------------------ baselines
def _route(router_logits, top_k):
    weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def torch_loop_moe(x, w1, w2, router_logits, top_k):
    weights, ids = _route(router_logits, top_k)
    d_ff = w1.shape[1] // 2
    out = torch.zeros_like(x)
    for expert in range(w1.shape[0]):
        token_idx, slot_idx = torch.where(ids == expert)
        if token_idx.numel() == 0:
            continue
        x_e = x[token_idx]
        h = F.silu(x_e @ w1[expert, :d_ff].T) * (x_e @ w1[expert, d_ff:].T)
        y = (h @ w2[expert].T) * weights[token_idx, slot_idx, None].to(x.dtype)
        out.index_add_(0, token_idx, y)  # in place, as a PyTorch user (and Hugging Face) writes it
    return out


def torch_grouped_mm_moe(x, w1, w2, router_logits, top_k):
    weights, ids = _route(router_logits, top_k)
    num_experts = w1.shape[0]
    d_ff = w1.shape[1] // 2
    order = torch.argsort(ids.reshape(-1), stable=True)
    token_of_row = order // top_k
    offsets = torch.cumsum(torch.bincount(ids.reshape(-1), minlength=num_experts), 0).to(torch.int32)
    gate_up = torch._grouped_mm(x[token_of_row], w1.transpose(1, 2), offs=offsets)
    h = F.silu(gate_up[:, :d_ff]) * gate_up[:, d_ff:]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets)
    y = y * weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add(0, token_of_row, y)


def _layer(backend):
    if backend == "flashmoe":
        return lambda x, w1, w2, logits, top_k: fused_moe(x, w1, w2, logits, top_k)
    if backend == "torch-loop":
        return torch_loop_moe
    return torch_grouped_mm_moe


def _available_backends(device):
    if device.type != "cuda":
        return ("flashmoe", "torch-loop")
    return BACKENDS if hasattr(torch, "_grouped_mm") else BACKENDS[:2]


# -------------------------------------------------------------------------------------------------- timing
def _median_ms(fn, device, sustained=False) -> float:
    """``report.gpu_median_ms`` on the GPU, else the median of five timed calls after one."""
    if device.type == "cuda":
        return gpu_median_ms(fn, sustained=sustained)
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _graph_median_ms(fn) -> float:
    """do_bench median of replaying ``fn`` captured in a CUDA graph (warmed up on a side stream first, as capture
    requires); raises where fn cannot be captured (a host synchronisation)."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))


def _measure(backend, pass_, tensors, top_k, device, timing="eager", sustained=False) -> float:
    """Median ms of one backend's layer, forward or backward, as the records report it (``sustained``: eager calls
    after seconds of back-to-back calls, ``sustained_window``)."""
    layer = _layer(backend)
    x, w1, w2, logits = tensors
    if pass_ == "fwd":
        with torch.no_grad():
            if timing == "cuda-graph":
                return _graph_median_ms(lambda: layer(x, w1, w2, logits, top_k))
            return _median_ms(lambda: layer(x, w1, w2, logits, top_k), device, sustained)
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = layer(*leaves, top_k)
    grad_out = torch.randn_like(out)
    return _median_ms(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True), device, sustained)


def sustained_window(flops: float, timing: str, device) -> bool:
    """Whether a case is timed in the sustained window (``report.gpu_median_ms``): eager GPU calls whose expert GEMMs
    are SUSTAINED_FROM_FLOPS or more (~0.5 ms at 500 TFLOP/s: long enough to hold the GPU at its power cap), decided
    per case so that every backend of a comparison gets the same window."""
    return device.type == "cuda" and timing == "eager" and flops >= SUSTAINED_FROM_FLOPS


def _routed_expert_bytes(tensors, top_k) -> int:
    """Bytes of the expert weights (w1 and w2 rows) of every expert that at least one token is routed to."""
    _, w1, w2, logits = tensors
    _, ids = _route(logits, top_k)
    experts_used = torch.unique(ids).numel()
    return experts_used * (w1[0].numel() + w2[0].numel()) * w1.element_size()


def _make_inputs(num_tokens, num_experts, d_model, d_ff, dtype, device):
    x = torch.randn(num_tokens, d_model, device=device, dtype=dtype)
    w1 = torch.randn(num_experts, 2 * d_ff, d_model, device=device, dtype=dtype) / d_model**0.5
    w2 = torch.randn(num_experts, d_model, d_ff, device=device, dtype=dtype) / d_ff**0.5
    logits = torch.randn(num_tokens, num_experts, device=device, dtype=dtype)
    return x, w1, w2, logits


def run_moe_bench(quick: bool = False, progress=None, on_case_done=None, rounds: int = 1,
                  models: list[str] | None = None) -> list[dict]:
    """Every backend on every (model, T, pass); returns the records. ``progress``: an object with
    ``update(n=1, desc=None)`` and ``close()`` (``bench.report.Progress``), or None. ``on_case_done(records so
    far)`` runs after each (model, T) (the CLI saves partial results there).

    ``rounds`` > 1 repeats the whole sweep and records each case's median time (each round's in ``ms_rounds``):
    at Mixtral T=4096 the backward's ratio to grouped_mm read 1.14-1.19x across single sweeps of the same code;
    a slow stretch of clocks then lands on every backend of a round alike."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    unknown = [name for name in models or () if name not in MODELS]
    if unknown:
        raise ValueError(f"models: unknown {', '.join(unknown)}; expected some of {', '.join(MODELS)}")
    chosen = {name: shape for name, shape in MODELS.items() if not models or name in models}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    token_counts = (QUICK_TOKENS if quick else TOKENS) if on_gpu else CPU_TOKENS
    backends = _available_backends(device)
    if progress is not None and hasattr(progress, "set_total"):
        graph_steps = sum(t <= DECODE_TOKENS for t in token_counts) if on_gpu else 0  # forward only
        progress.set_total(rounds * len(chosen) * len(backends) * (len(token_counts) * len(PASSES) + graph_steps))

    measured: dict[tuple, list[dict]] = {}  # (model, T, pass, backend, timing) -> one record per round
    for model, shape in ((m, s) for _ in range(rounds) for m, s in chosen.items()):
        num_experts, top_k = shape["num_experts"], shape["top_k"]
        shrink = 1 if on_gpu else CPU_SHRINK
        d_model, d_ff = shape["d_model"] // shrink, shape["d_ff"] // shrink
        for num_tokens in token_counts:
            tensors = _make_inputs(num_tokens, num_experts, d_model, d_ff, dtype, device)
            decode = num_tokens <= DECODE_TOKENS
            weight_bytes = _routed_expert_bytes(tensors, top_k) if decode else None
            for pass_ in PASSES:
                timings = ("eager", "cuda-graph") if decode and on_gpu and pass_ == "fwd" else ("eager",)
                for backend, timing in ((b, t) for t in timings for b in backends):
                    step = f"{model} T={num_tokens} {pass_} {backend}" + (f" ({timing})" if timing != "eager" else "")
                    flops = expert_gemm_flops(num_tokens, top_k, d_model, d_ff, pass_)
                    sustained = sustained_window(flops, timing, device)
                    try:
                        ms = _measure(backend, pass_, tensors, top_k, device, timing, sustained)
                    except Exception as error:  # a backend that cannot run this shape gets no record
                        warnings.warn(f"moe bench: {step} skipped: {type(error).__name__}: {error}")
                        ms = None
                    if ms is not None:
                        record = {
                            "op": "moe",
                            "model": model,
                            "pass": pass_,
                            "T": num_tokens,
                            "E": num_experts,
                            "top_k": top_k,
                            "d_model": d_model,
                            "d_ff": d_ff,
                            "dtype": {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype],
                            "backend": backend,
                            "timing": timing,
                            "warmup_ms": SUSTAINED_WARMUP_MS if sustained else SHORT_WARMUP_MS,
                            "ms": round_significant(ms),
                            "tflops": round_significant(tflops(flops, ms)),
                        }
                        if weight_bytes is not None and pass_ == "fwd":
                            record["weight_gbps"] = round_significant(weight_bytes / ms / 1e6)
                            record["weight_bytes"] = weight_bytes
                        measured.setdefault((model, num_tokens, pass_, backend, timing), []).append(record)
                    if progress is not None:
                        progress.update(desc=step)
            del tensors
            if on_gpu:
                torch.cuda.empty_cache()
            if on_case_done is not None:
                on_case_done(_median_records(measured))
    if progress is not None:
        progress.close()
    return _median_records(measured)


def _median_records(measured: dict[tuple, list[dict]]) -> list[dict]:
    """One record per case: the first round's, with the median time over the rounds so far."""
    def scale_rates(record, ms):
        flops = expert_gemm_flops(record["T"], record["top_k"], record["d_model"], record["d_ff"], record["pass"])
        record["tflops"] = round_significant(tflops(flops, ms))
        if "weight_bytes" in record:
            record["weight_gbps"] = round_significant(record["weight_bytes"] / ms / 1e6)

    return [median_over_rounds(per_round, scale_rates) for per_round in measured.values()]


# ------------------------------------------------------------------------------------------------------ FP8
FP8_TOKENS = (1, 16, 4096, 16384)
FP8_SWEEP_TOKENS = (16, 4096)


def _fp8_layer(tensors, top_k, tiles=None):
    """The FP8 experts' layer on ``tensors``' weights quantised once (outside any timing): ``fused_moe`` with the
    block scales, or with ``tiles`` the forward on those tiles (routing, then ``triton_fp8_gemm.fp8_forward``)."""
    from flashmoe_science.moe import moe_route
    from flashmoe_science.moe.fp8 import quantize_fp8_weights
    from flashmoe_science.moe.triton_fp8_gemm import fp8_forward

    x, w1, w2, logits = tensors
    (q1, s1), (q2, s2) = quantize_fp8_weights(w1), quantize_fp8_weights(w2)
    if tiles is None:
        return lambda: fused_moe(x, q1, q2, logits, top_k, w1_scale=s1, w2_scale=s2)

    def layer():
        weights, ids = moe_route(logits, top_k)
        return fp8_forward(x, q1, s1, q2, s2, weights.float().contiguous(), ids, tiles)
    return layer


def _fp8_record(model, shape, num_tokens, backend, timing, ms, weight_bytes=None, **extra) -> dict:
    flops = expert_gemm_flops(num_tokens, shape["top_k"], shape["d_model"], shape["d_ff"], "fwd")
    record = {"op": "moe", "model": model, "pass": "fwd", "T": num_tokens, "E": shape["num_experts"],
              "top_k": shape["top_k"], "d_model": shape["d_model"], "d_ff": shape["d_ff"],
              "dtype": "fp8-e4m3" if backend.endswith("fp8") else "bf16", "backend": backend, "timing": timing,
              "ms": round_significant(ms), "tflops": round_significant(tflops(flops, ms)), **extra}
    if weight_bytes is not None:
        record["weight_bytes"] = weight_bytes
        record["weight_gbps"] = round_significant(weight_bytes / ms / 1e6)
    return record


def run_moe_fp8_bench(models: list[str] | None = None, tokens=FP8_TOKENS, progress=None) -> list[dict]:
    """The FP8 experts (``flashmoe-fp8``: e4m3 weights in 128x128 blocks, activations per 1x128 group) beside our
    bf16 layer (``flashmoe``), forward, side by side per case on one GPU. Both run from router logits; the
    weights are quantised once before timing. T <= DECODE_TOKENS: also in a CUDA graph, with ``weight_gbps`` (the
    routed experts' bytes in each layer's own format, per second). Each FP8 record carries ``speedup``: the bf16
    time over the FP8 time with the same timing."""
    if not torch.cuda.is_available():
        raise ValueError("the FP8 experts' benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    records = []
    for model, shape, num_tokens, tensors in _fp8_cases(models, tokens, device):
        top_k = shape["top_k"]
        decode = num_tokens <= DECODE_TOKENS
        bf16_bytes = _routed_expert_bytes(tensors, top_k) if decode else None
        flops = expert_gemm_flops(num_tokens, top_k, shape["d_model"], shape["d_ff"], "fwd")
        layers = {"flashmoe": lambda t=tensors: _layer("flashmoe")(*t, top_k),
                  "flashmoe-fp8": _fp8_layer(tensors, top_k)}
        for timing in ("eager", "cuda-graph") if decode else ("eager",):
            times = {}
            for backend, layer in layers.items():
                sustained = sustained_window(flops, timing, device)
                with torch.no_grad():
                    ms = _graph_median_ms(layer) if timing == "cuda-graph" else _median_ms(layer, device, sustained)
                times[backend] = ms
                weight_bytes = None if bf16_bytes is None else (
                    bf16_bytes // 2 if backend == "flashmoe-fp8" else bf16_bytes)
                extra = {"speedup": round_significant(times["flashmoe"] / ms)} if backend == "flashmoe-fp8" else {}
                records.append(_fp8_record(model, shape, num_tokens, backend, timing, ms, weight_bytes,
                                           warmup_ms=SUSTAINED_WARMUP_MS if sustained else SHORT_WARMUP_MS,
                                           **extra))
                if progress is not None:
                    progress.update(desc=f"{model} T={num_tokens} {backend} ({timing})")
        del tensors, layers
    return records


def _fp8_cases(models, tokens, device):
    """(model, shape, T, bf16 inputs from `_make_inputs`) of every selected case; each case's memory is freed
    before the next one's inputs are made."""
    for model, shape in MODELS.items():
        if models and model not in models:
            continue
        for num_tokens in tokens:
            yield model, shape, num_tokens, _make_inputs(num_tokens, shape["num_experts"], shape["d_model"],
                                                         shape["d_ff"], torch.bfloat16, device)
            torch.cuda.empty_cache()


def run_fp8_tile_sweep(models: list[str] | None = None, tokens=FP8_SWEEP_TOKENS) -> list[dict]:
    """Every candidate of ``triton_fp8_gemm.fp8_tile_candidates`` (the default tiles and their alternatives) on
    the FP8 forward, beside our bf16 layer, per (model, T): records with ``tiles`` (the candidate's name and
    config) and ``speedup`` over bf16 (CUDA-graph timing at T <= DECODE_TOKENS, eager otherwise). A candidate that
    fails to compile or run gets a record with its ``error`` instead."""
    from dataclasses import asdict

    from flashmoe_science.moe.triton_fp8_gemm import fp8_tile_candidates

    if not torch.cuda.is_available():
        raise ValueError("the FP8 tile sweep needs a CUDA GPU")
    device = torch.device("cuda")
    records = []
    for model, shape, num_tokens, tensors in _fp8_cases(models, tokens, device):
        top_k = shape["top_k"]
        timing = "cuda-graph" if num_tokens <= DECODE_TOKENS else "eager"
        time_of = _graph_median_ms if timing == "cuda-graph" else (lambda fn: _median_ms(fn, device))
        with torch.no_grad():
            bf16_ms = time_of(lambda t=tensors: _layer("flashmoe")(*t, top_k))
            records.append(_fp8_record(model, shape, num_tokens, "flashmoe", timing, bf16_ms))
            candidates = fp8_tile_candidates(num_tokens, top_k, shape["num_experts"], shape["d_model"],
                                             shape["d_ff"], device)
            for name, tiles in candidates.items():
                config = {"name": name, **asdict(tiles)}
                try:
                    ms = time_of(_fp8_layer(tensors, top_k, tiles))
                except Exception as error:  # a candidate that does not build on this GPU is a finding too
                    records.append({"op": "moe", "model": model, "T": num_tokens, "backend": "flashmoe-fp8",
                                    "tiles": config, "error": f"{type(error).__name__}: {error}"[:500]})
                    continue
                records.append(_fp8_record(model, shape, num_tokens, "flashmoe-fp8", timing, ms, tiles=config,
                                           speedup=round_significant(bf16_ms / ms)))
        del tensors
    return records
