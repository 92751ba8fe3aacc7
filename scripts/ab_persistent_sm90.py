"""A/B of the sm_90 forward's persistent CTAs (static snaking rounds, tiles.sm90_persistent) against one CTA per
query tile, at the plan's tiles, Q buffering and cross-item overlap for each; with `--stages 3,4,...` instead the
plan's persistence at each K/V ring depth. Each variant is timed twice, interleaved (the mean is reported); all
must give the same output bit for bit, checked against SDPA too.

    PYTHONPATH=src python scripts/ab_persistent_sm90.py [--cases BxHxLxDxC,...] [--stages N,...] [--out DIR]
    (C: 1 = causal)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.attention.tiles import (device_traits, sm90_cross_item, sm90_forward_tiles, sm90_persistent,
                                              sm90_q_buffers, sm90_smem_bytes)
from flashmoe_science.bench.attention import AttentionShape, attention_flops, cuda_median_ms

CASES = "2x32x8192x64x1,4x8x8192x64x1,2x16x8192x128x1,2x8x8192x256x1,1x32x16384x64x1,1x16x16384x128x1,4x32x4096x64x1"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=CASES)
    p.add_argument("--stages", help="compare these ring depths instead of persistent vs one CTA per tile")
    p.add_argument("--out", default=".")
    a = p.parse_args()
    traits = device_traits(torch.device("cuda"))
    rows = []
    for case in a.cases.split(","):
        b, h, length, d, causal = map(int, case.split("x"))
        causal = bool(causal)
        q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fl = attention_flops(AttentionShape(b, h, length, length, d, causal), "fwd")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = fl / cuda_median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)) / 1e9
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        plan_tiles = sm90_forward_tiles(d, causal, length)
        if a.stages:
            num_work = b * h * -(-length // plan_tiles.block_m)
            persistent = sm90_persistent(causal, length, num_work, traits.sm_count)
            variants = [(f"s{n}", persistent, dataclasses.replace(plan_tiles, num_stages=int(n)))
                        for n in a.stages.split(",")]
        else:
            variants = [("persistent", True, plan_tiles), ("grid", False, plan_tiles)]
        runs = {}
        for name, persistent, tiles in variants:
            qbuf = sm90_q_buffers(tiles, d, persistent, traits)
            if sm90_smem_bytes(tiles, d, qbuf) > traits.smem_per_block:
                continue
            cross = sm90_cross_item(tiles, d, causal, persistent, qbuf)
            out = torch.full_like(q, float("nan"))
            lse = torch.empty(q.shape[:3], device="cuda")
            ctas = traits.sm_count if persistent else None

            def fn(out=out, lse=lse, ctas=ctas, qbuf=qbuf, cross=cross, tiles=tiles):
                fwd_sm90.attention_forward_sm90(q, k, v, out, lse, causal, d**-0.5, tiles, ctas, qbuf, cross)
            fn()
            runs[name] = (fn, out, [])
        for _ in range(2):
            for fn, _, times in runs.values():
                times.append(cuda_median_ms(fn))
        row = {"B": b, "H": h, "L": length, "D": d, "causal": causal, "cudnn": cudnn}
        line = []
        for name, (_, out, times) in runs.items():
            tf = fl / (sum(times) / len(times)) / 1e9
            row[name] = {"tflops": tf, "ms": times, "err": (out.float() - ref.float()).abs().max().item()}
            line.append(f"{name} {tf:.0f} ({tf / cudnn:.3f})")
        outs = [out for _, out, _ in runs.values()]
        row["identical"] = all(torch.equal(outs[0], o) for o in outs[1:])
        rows.append(row)
        print(f"B{b} H{h} L{length} D{d} causal={int(causal)}: cudnn {cudnn:.0f} | " + " | ".join(line)
              + f" | identical={row['identical']}", flush=True)
    with open(os.path.join(a.out, "ab_persistent_sm90.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
