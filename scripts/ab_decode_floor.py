"""What bounds the decode path at Qwen3-30B-A3B T=1, and the decode kernel's configs against it, under CUDA graphs.

    PYTHONPATH=src:scripts python scripts/ab_decode_floor.py --out $OUT/decode-floor

1. Floors: kernels that only read the routed experts' byte count from one contiguous buffer (a looped read, and an
   unrolled one with UNROLL independent loads in flight per thread), torch.sum over it, and a graph of one empty
   kernel (what a one-layer graph replay costs with no work at all).
2. The decode kernel (triton_decode.decode_forward, routing inside) over a few configs, one layer per graph.
3. The same in a stack: LAYERS layers with their own weights in one graph (as a decode step runs them), time per
   layer; and the read floor stacked the same way.
do_bench medians, L2 flushed between replays. Outputs checked against the default config's.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from flashmoe_science.bench.moe import MODELS, _graph_median_ms, _make_inputs, _routed_expert_bytes
from flashmoe_science.moe import triton_decode as td

BANDWIDTH = 4.3e12


@triton.jit
def _read_kernel(src_ptr, sink_ptr, num_elements, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK * STEPS + tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(STEPS):
        total += tl.load(src_ptr + offs, mask=offs < num_elements, other=0.0).to(tl.float32)
        offs += BLOCK
    tl.store(sink_ptr + pid, tl.sum(total))


@triton.jit
def _read_unrolled_kernel(src_ptr, sink_ptr, num_elements, chunk, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * chunk
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, chunk, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            offs = base + start + u * BLOCK + tl.arange(0, BLOCK)
            total += tl.load(src_ptr + offs, mask=(offs < num_elements) & (offs < base + chunk), other=0.0,
                             eviction_policy="evict_first").to(tl.float32)
    tl.store(sink_ptr + pid, tl.sum(total))


@triton.jit
def _empty_kernel(sink_ptr):
    tl.store(sink_ptr, 0.0)


def read_floors(bufs):
    """(name, callable reading every buffer once) for each floor kernel."""
    numel = bufs[0].numel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    programs = triton.cdiv(numel, 8192 * 8)
    sink = torch.empty(max(programs, 8 * sms), device="cuda")
    out.append(("loop block8192x8 w16", lambda: [_read_kernel[(programs,)](b, sink, numel, BLOCK=8192, STEPS=8,
                                                                            num_warps=16) for b in bufs]))
    for per_sm, block, unroll, warps in ((1, 2048, 8, 8), (2, 2048, 8, 8), (4, 1024, 8, 4), (4, 2048, 4, 8),
                                         (8, 1024, 4, 4)):
        grid = per_sm * sms
        chunk = triton.cdiv(triton.cdiv(numel, grid), block * unroll) * block * unroll
        out.append((f"unrolled {per_sm}/SM block{block}x{unroll} w{warps}",
                    lambda grid=grid, chunk=chunk, block=block, unroll=unroll, warps=warps: [
                        _read_unrolled_kernel[(grid,)](b, sink, numel, chunk, BLOCK=block, UNROLL=unroll,
                                                       num_warps=warps) for b in bufs]))
    out.append(("torch.sum", lambda: [b.sum(dtype=torch.float32) for b in bufs]))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode-floor")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    results = []

    def report(case, kind, config, seconds_per_layer, num_bytes, diff=None):
        share = num_bytes / seconds_per_layer / BANDWIDTH
        row = dict(case=case, kind=kind, config=config, us=seconds_per_layer * 1e6, share=share, diff=diff)
        results.append(row)
        extra = f" diff {diff:.1e}" if diff is not None else ""
        print(f"   {kind:14s} {config:46s} {row['us']:7.1f} us/layer  {share:.2f} of 4.3 TB/s{extra}", flush=True)

    sink = torch.empty(1, device="cuda")
    print(f"empty-kernel graph: {_graph_median_ms(lambda: _empty_kernel[(1,)](sink)) * 1e3:.1f} us", flush=True)
    base = td.decode_config(2)
    configs = [base, base._replace(num_stages=3), base._replace(block_k=256, num_stages=3), base._replace(num_warps=8)]
    for model_name, num_tokens in (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 2), ("mixtral-8x7b", 1)):
        dims = MODELS[model_name]
        top_k = dims["top_k"]
        torch.manual_seed(0)
        layers = [_make_inputs(num_tokens, dims["num_experts"], dims["d_model"], dims["d_ff"], torch.bfloat16,
                               torch.device("cuda")) for _ in range(args.layers)]
        x, w1, w2, logits = layers[0]
        num_bytes = _routed_expert_bytes(layers[0], top_k)
        case = f"{model_name} T={num_tokens}"
        print(f"== {case}: {num_bytes / 1e6:.1f} MB of routed weights ({num_bytes / BANDWIDTH * 1e6:.1f} us at "
              f"4.3 TB/s); stacks of {args.layers} layers", flush=True)
        if num_tokens == 1:
            bufs = [torch.randn(num_bytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
            for name, fn in read_floors(bufs[:1])[-2:]:
                report(case, "read 1 layer", name, _graph_median_ms(fn) * 1e-3, num_bytes)
            for name, fn in read_floors(bufs)[-2:]:
                report(case, "read stack", name, _graph_median_ms(fn) * 1e-3 / args.layers, num_bytes)
            del bufs
        ref = td.decode_forward(x, w1, w2, logits, None, top_k, route=True)[0]
        for config in configs if model_name.startswith("qwen3") else configs[:2]:
            name = f"f{config.block_f} k{config.block_k} d{config.block_d} w{config.num_warps} s{config.num_stages}"
            try:
                out = td.decode_forward(x, w1, w2, logits, None, top_k, route=True, config=config)[0]
                diff = (out.float() - ref.float()).abs().max().item()
                one = _graph_median_ms(lambda: td.decode_forward(x, w1, w2, logits, None, top_k, route=True,
                                                                 config=config))
                report(case, "decode 1 layer", name, one * 1e-3, num_bytes, diff)
                stack = _graph_median_ms(lambda: [td.decode_forward(*layer[:3], layer[3], None, top_k, route=True,
                                                                    config=config) for layer in layers])
                report(case, "decode stack", name, stack * 1e-3 / args.layers, num_bytes)
            except Exception as error:  # noqa: BLE001 - a config that fails is reported
                print(f"   {name}: {type(error).__name__}: {str(error)[:200]}", flush=True)
        del layers
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "ab_decode_floor.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
