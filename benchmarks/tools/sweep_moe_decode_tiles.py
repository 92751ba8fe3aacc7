"""Sweep the one-launch decode kernel's configs (moe/triton_decode.py) beside the batched path, under CUDA graphs:
the data behind triton_decode.decode_config and MAX_DECODE_TOKENS.

    PYTHONPATH=src:benchmarks/tools python benchmarks/tools/sweep_moe_decode_tiles.py --out $OUT/decode [--tokens 1,2,4,8,16] [--budget-s 240]

Per (model, T): the batched path (fused_moe with the decode path off: routing, sort, GEMM1, GEMM2) and, per config,
the decode path with the routing inside the kernel (zeroed workspace + one launch), each captured in a CUDA graph and
replayed (do_bench median). Every config's output is checked against the batched path's. GB/s: bytes of the experts
the tokens are routed to (bench moe's weight_gbps). T = 1 sweeps the whole grid; larger T only the best configs.
Writes sweep_decode.json and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch

from flashmoe_science.bench.moe import MODELS, _graph_median_ms, _make_inputs, _routed_expert_bytes
from flashmoe_science.moe import execute, fused_moe, triton_decode

GRID = dict(block_f=(16, 32, 64), block_k=(64, 128, 256), block_d=(128, 256), num_warps=(4,), num_stages=(3, 4, 6))
BANDWIDTH = 4.3e12


def batched_ms(tensors, top_k):
    x, w1, w2, logits = tensors
    saved = triton_decode.MAX_DECODE_TOKENS
    triton_decode.MAX_DECODE_TOKENS = 0  # the batched path
    try:
        out = fused_moe(x, w1, w2, logits, top_k)
        return out, _graph_median_ms(lambda: fused_moe(x, w1, w2, logits, top_k))
    finally:
        triton_decode.MAX_DECODE_TOKENS = saved
        execute.PREPARED.clear()  # (prepared calls remember the path they took)


def decode_ms(tensors, top_k, config):
    x, w1, w2, logits = tensors

    def call():
        return triton_decode.decode_forward(x, w1, w2, logits, None, top_k, route=True, config=config)[0]

    out = call()
    return out, _graph_median_ms(call)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out/decode")
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--keep", type=int, default=4, help="configs carried from T=1 to larger T")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    records = []
    grid = [triton_decode.DecodeConfig(*values) for values in itertools.product(*GRID.values())]
    with torch.no_grad():
        for model in args.models.split(","):
            shape = MODELS[model]
            best_configs = grid
            for num_tokens in (int(t) for t in args.tokens.split(",")):
                torch.manual_seed(0)
                tensors = _make_inputs(num_tokens, shape["num_experts"], shape["d_model"], shape["d_ff"],
                                       torch.bfloat16, "cuda")
                top_k = shape["top_k"]
                gbytes = _routed_expert_bytes(tensors, top_k) / 1e9
                reference, ms = batched_ms(tensors, top_k)
                print(f"== {model} T={num_tokens}: batched {ms * 1e3:.1f} us, {gbytes / ms * 1e3:.0f} GB/s "
                      f"({gbytes / ms * 1e12 / BANDWIDTH:.2f} of 4.3 TB/s)", flush=True)
                records.append(dict(model=model, T=num_tokens, path="batched", ms=ms, gbps=gbytes / ms * 1e3))
                timed = []
                for config in best_configs:
                    if time.time() - start > args.budget_s:
                        print("   budget spent: remaining configs skipped")
                        break
                    try:
                        out, ms = decode_ms(tensors, top_k, config)
                    except Exception as error:  # noqa: BLE001 (a config the compiler rejects: out of resources)
                        print(f"   {config}: {type(error).__name__}: {str(error)[:120]}")
                        continue
                    err = (out.float() - reference.float()).abs().max().item()
                    scale = reference.float().abs().max().item()
                    timed.append((ms, config))
                    records.append(dict(model=model, T=num_tokens, path="decode", config=config._asdict(), ms=ms,
                                        gbps=gbytes / ms * 1e3, max_abs_diff=err, out_scale=scale))
                    print(f"   {tuple(config)}: {ms * 1e3:6.1f} us {gbytes / ms * 1e3:5.0f} GB/s "
                          f"({gbytes / ms * 1e12 / BANDWIDTH:.2f}) diff {err:.2e}/{scale:.1e}", flush=True)
                timed.sort(key=lambda item: item[0])
                if timed:
                    print(f"   best {tuple(timed[0][1])}: {timed[0][0] * 1e3:.1f} us", flush=True)
                    best_configs = [config for _, config in timed[:args.keep]]
    with open(os.path.join(args.out, "sweep_decode.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, records=records), f, indent=1)


if __name__ == "__main__":
    main()
