"""Sweep forward tile configs on the GPU and print them beside cuDNN: the data behind tiles.forward_tiles.

    PYTHONPATH=src python benchmarks/tools/sweep_attention_forward_tiles.py --out $OUT [--cases BxHxLxD,...]

Writes sweep JSON (every config's ms, TFLOP/s, registers, spills, shared memory) and the best config's cubin
per case (for `cuobjdump -sass`, to confirm HGMMA) under --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashmoe_science.attention.tiles import AttentionTiles, forward_smem_bytes, smem_budget
from flashmoe_science.device import device_traits
from flashmoe_science.attention.triton import fwd as triton_fwd
from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.bench.attention import AttentionShape, attention_flops, cuda_median_ms
from sass_tools import sass_counts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--cases", default="32x32x512x64,4x32x4096x64,32x16x512x128,16x16x1024x128,"
                        "8x16x2048x128,4x16x4096x128,1x16x16384x128,32x8x512x256,8x8x2048x256,1x8x16384x256")
    args = parser.parse_args()
    traits = device_traits(torch.device("cuda"))
    results = []
    for case in args.cases.split(","):
        b, h, l, d = map(int, case.split("x"))
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fl = attention_flops(AttentionShape(b, h, l, l, d, causal), "fwd")
            row = {"B": b, "H": h, "L": l, "D": d, "causal": causal, "configs": []}
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        ms = cuda_median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    row[name] = fl / ms / 1e9
                except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
                    row[name] = None
                    print(f"{name} failed: {e}")
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device="cuda")
            best = None
            triton_configs = [("triton", AttentionTiles(*c)) for c in (
                (64, 128, 4, 2, True), (64, 64, 4, 3, True))]
            # sm90: persistent (one CTA per SM) and "sm90-grid" (one CTA per query tile)
            sm90_configs = [(kernel, AttentionTiles(128, block_n, 8, stages, use_tma=True))
                            for kernel in ("sm90", "sm90-grid") for block_n, stages in (
                                (128, 2), (128, 3), (64, 2), (64, 3))]
            for kernel, tiles in triton_configs + sm90_configs:
                limit = traits.smem_per_block - 2048 if kernel.startswith("sm90") else smem_budget(traits)
                if forward_smem_bytes(tiles, d, 2) > limit:
                    continue
                try:
                    if kernel.startswith("sm90"):
                        ctas = None if kernel == "sm90-grid" else traits.sm_count
                        fn = lambda: fwd_sm90.attention_forward_sm90(  # noqa: E731
                            q, k, v, out, lse, causal, d**-0.5, tiles, num_ctas=ctas)
                    else:
                        fn = lambda: triton_fwd.attention_forward(q, k, v, out, lse, causal, d**-0.5, tiles)  # noqa: E731
                    kern = fn()
                    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = cuda_median_ms(fn)
                except Exception as e:  # noqa: BLE001
                    print(f"  {tiles} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                rec = {**tiles.as_dict(), "kernel": kernel, "max_err_vs_sdpa": err, "ms": ms, "tflops": fl / ms / 1e9,
                       "regs": getattr(kern, "n_regs", None), "spills": getattr(kern, "n_spills", None),
                       "smem": kern.metadata.shared}
                row["configs"].append(rec)
                if best is None or ms < best[0]["ms"]:
                    best = (rec, kern)
            row["configs"].sort(key=lambda r: r["ms"])
            results.append(row)
            top = row["configs"][:3]
            print(f"B{b} H{h} L{l} D{d} causal={causal}: cudnn {row['cudnn'] or 0:.0f} fa2 {row['fa2'] or 0:.0f} | "
                  + " | ".join(f"{r['block_m']}x{r['block_n']} w{r['num_warps']} s{r['num_stages']} "
                               f"{r['kernel']}{'' if r['use_tma'] else '-ptr'} {r['tflops']:.0f} err{r['max_err_vs_sdpa']:.1e} (r{r['regs']} sp{r['spills']})"
                               for r in top), flush=True)
            if best is not None:
                row["best_sass_summary"] = sass_counts(best[1].asm["cubin"])[1]
                print("   best config SASS:", row["best_sass_summary"], flush=True)
    with open(os.path.join(args.out, "sweep_fwd.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
