"""A/B of the decode path's two designs under CUDA graphs, beside a pure-read floor.

    PYTHONPATH=src:scripts python scripts/ab_decode_split.py --out $OUT/decode-split [--budget-s 300]

Per (model, T): the one-launch kernel (triton_decode.decode_forward: zeroed workspace + one launch with atomics),
and the split design (split_decode_forward: an up kernel writing h, a down kernel owning its outputs, launched by
programmatic dependent launch and prefetching its w2 rows into L2 before it waits) over a grid of configs, each
with the routing inside, captured in a CUDA graph and replayed (do_bench median, L2 flushed between replays). The
floor: one Triton kernel that only reads the routed experts' bytes (the same count) from a contiguous buffer, in a
graph, and a graph of one empty kernel. Every output is checked against the one-launch kernel's.
"""

from __future__ import annotations

import argparse
import itertools
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
def _empty_kernel(sink_ptr):
    tl.store(sink_ptr, 0.0)


def floor_rows(num_bytes, results):
    buf = torch.randn(num_bytes // 2, device="cuda", dtype=torch.bfloat16)
    for block, steps, warps in ((4096, 8, 8), (8192, 4, 8), (2048, 16, 4), (8192, 8, 16)):
        programs = triton.cdiv(buf.numel(), block * steps)
        sink = torch.empty(programs, device="cuda")
        ms = _graph_median_ms(lambda: _read_kernel[(programs,)](buf, sink, buf.numel(), BLOCK=block, STEPS=steps,
                                                                num_warps=warps))
        results.append(dict(kind="read-floor", config=f"block{block} steps{steps} w{warps} ({programs} programs)",
                            us=ms * 1e3, gbps=num_bytes / ms / 1e6))
    sink = torch.empty(1, device="cuda")
    ms = _graph_median_ms(lambda: _empty_kernel[(1,)](sink))
    results.append(dict(kind="empty-kernel", config="", us=ms * 1e3, gbps=0.0))

    def two_empty():
        _empty_kernel[(1,)](sink)
        _empty_kernel[(1,)](sink)

    ms = _graph_median_ms(two_empty)
    results.append(dict(kind="two-empty-kernels", config="", us=ms * 1e3, gbps=0.0))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode-split")
    parser.add_argument("--budget-s", type=float, default=300)
    parser.add_argument("--tokens", default="1,2")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    results = []
    grid = list(itertools.product((16, 32, 64), (128,), (4,), (4,), (16, 32), (256,), (4,), (4,),
                                  ((True, True), (True, False), (False, False))))
    grid += [(32, 128, 4, 3, 16, 128, 4, 6, (True, True)), (32, 256, 4, 3, 16, 256, 4, 3, (True, True)),
             (16, 256, 4, 4, 16, 256, 8, 4, (True, True)), (64, 128, 8, 4, 64, 128, 4, 4, (True, True))]
    for model_name in ("qwen3-30b-a3b", "mixtral-8x7b"):
        num_experts, top_k, d_model, d_ff = (MODELS[model_name][key] for key in
                                             ("num_experts", "top_k", "d_model", "d_ff"))
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            torch.manual_seed(0)
            tensors = _make_inputs(num_tokens, num_experts, d_model, d_ff, torch.bfloat16, torch.device("cuda"))
            x, w1, w2, logits = tensors
            num_bytes = _routed_expert_bytes(tensors, top_k)
            tag = f"{model_name} T={num_tokens}"
            print(f"== {tag}: {num_bytes / 1e6:.1f} MB of routed weights ({num_bytes / BANDWIDTH * 1e6:.1f} us at "
                  f"4.3 TB/s)", flush=True)
            if num_tokens == 1:
                rows = []
                floor_rows(num_bytes, rows)
                for row in rows:
                    print(f"   {row['kind']:18s} {row['config']:40s} {row['us']:7.1f} us {row['gbps']:6.0f} GB/s",
                          flush=True)
                    results.append(dict(row, case=tag))

            def one_launch():
                return td.decode_forward(x, w1, w2, logits, None, top_k, route=True)[0]

            ref = one_launch()
            ms = _graph_median_ms(one_launch)
            print(f"   one-launch {td.decode_config(2)}: {ms * 1e3:7.1f} us {num_bytes / ms / 1e6:6.0f} GB/s "
                  f"({num_bytes / ms / 1e9 / BANDWIDTH * 1e3:.2f})", flush=True)
            results.append(dict(case=tag, kind="one-launch", config=str(td.decode_config(2)), us=ms * 1e3,
                                gbps=num_bytes / ms / 1e6))
            configs = grid if num_tokens == 1 else sorted(
                (r for r in results if r["case"] == tag.replace(f"T={num_tokens}", "T=1") and r["kind"] == "split"),
                key=lambda r: r["us"])[:6]
            for config in configs:
                if time.perf_counter() - start > args.budget_s:
                    print("   (budget spent)", flush=True)
                    break
                if isinstance(config, dict):
                    cfg = td.SplitDecodeConfig(**config["cfg"])
                else:
                    *sizes, (pdl, prefetch) = config
                    cfg = td.SplitDecodeConfig(*sizes, pdl=pdl, prefetch=prefetch)

                def split():
                    return td.split_decode_forward(x, w1, w2, logits, None, top_k, route=True, config=cfg)[0]

                try:
                    out = split()
                    ms = _graph_median_ms(split)
                except Exception as error:  # noqa: BLE001 - a config that fails is reported
                    print(f"   {tuple(cfg)}: {type(error).__name__}: {str(error)[:160]}", flush=True)
                    continue
                diff = (out.float() - ref.float()).abs().max().item()
                print(f"   {tuple(cfg)}: {ms * 1e3:7.1f} us {num_bytes / ms / 1e6:6.0f} GB/s "
                      f"({num_bytes / ms / 1e9 / BANDWIDTH * 1e3:.2f}) diff {diff:.2e}", flush=True)
                results.append(dict(case=tag, kind="split", config=str(tuple(cfg)), cfg=cfg._asdict(), us=ms * 1e3,
                                    gbps=num_bytes / ms / 1e6, diff=diff))
            best = min((r for r in results if r["case"] == tag and r["kind"] == "split"), key=lambda r: r["us"],
                       default=None)
            if best:
                print(f"   best split {best['config']}: {best['us']:.1f} us", flush=True)
    with open(os.path.join(args.out, "ab_decode_split.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
