"""A/B of the sm_90 forward with and without cross-item overlap (the next work item's first Q·Kᵀ and softmax run
under the current item's last P·V), beside cuDNN and our Triton kernel, at the tiles, persistence and Q buffering the
library picks for each shape; short causal rows (two ring stages) also with a third stage, which cross-item overlap
needs there. The variants do the same arithmetic in the same order per row, so their outputs must match bit for
bit; all are also checked against SDPA (max abs error). (Session 3 A/B'd Q buffering and a consumer ping-pong here,
session 4 half of exp2 on the FMA pipe.)

    PYTHONPATH=src python scripts/ab_fwd_sm90.py [--cases BxHxLxD,...] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashmoe_science import flash_attention_science
from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.attention.tiles import (device_traits, sm90_cross_item_safe, sm90_forward_tiles,
                                              sm90_persistent, sm90_q_buffers, sm90_smem_bytes)
from flashmoe_science.bench.attention import AttentionShape, attention_flops, cuda_median_ms

CASES = ("32x32x512x64,16x32x1024x64,8x32x2048x64,4x32x4096x64,4x8x4096x64,32x16x512x128,16x16x1024x128,"
         "4x16x4096x128,32x8x512x256")


def run_sm90(q, k, v, causal, tiles, ctas, qbuf, cross):
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(q.shape[:3], device="cuda")
    fwd_sm90.attention_forward_sm90(q, k, v, out, lse, causal, q.shape[-1] ** -0.5, tiles, num_ctas=ctas,
                                    q_buffers=qbuf, cross_item=cross)
    return out, lse


def check_ragged(traits):
    """Lq != Lk, odd lengths, GQA, uneven shares of items per CTA: cross-item overlap must equal the plain kernel
    bit for bit."""
    for d in (64, 128):
        for causal in (False, True):
            for lq, lk in ((1000, 1000), (300, 777), (777, 300), (129, 4097), (4097, 129)):
                q = torch.randn(2, 8, lq, d, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(2, 2, lk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                tiles = sm90_forward_tiles(d, causal, lq)
                if not sm90_cross_item_safe(causal, tiles.num_stages):
                    tiles = dataclasses.replace(tiles, num_stages=3)
                for ctas in (7, 64, traits.sm_count):
                    qbuf = sm90_q_buffers(tiles, d, True, traits)
                    if qbuf != 2:  # overlapped items stage the output in the current item's Q buffer
                        continue
                    plain = run_sm90(q, k, v, causal, tiles, ctas, qbuf, False)
                    cross = run_sm90(q, k, v, causal, tiles, ctas, qbuf, True)
                    torch.cuda.synchronize()
                    same = torch.equal(plain[0], cross[0]) and torch.equal(plain[1], cross[1])
                    print(f"ragged D{d} Lq{lq} Lk{lk} causal={causal} ctas={ctas} s{tiles.num_stages} qbuf{qbuf}: "
                          f"identical={same}", flush=True)
                    assert same


def variants(tiles, causal, d, persistent, traits):
    """(name, tiles, q_buffers, cross_item): the plan's kernel, with cross-item overlap, and for two-stage causal
    plans the same with a third stage (plain and overlapped)."""
    qbuf = sm90_q_buffers(tiles, d, persistent, traits)
    out = [("plan", tiles, qbuf, False)]
    if not persistent:
        return out
    if sm90_cross_item_safe(causal, tiles.num_stages):
        if qbuf == 2:
            out.append(("cross", tiles, qbuf, True))
    else:
        t3 = dataclasses.replace(tiles, num_stages=3)
        if sm90_smem_bytes(t3, d, qbuf) <= traits.smem_per_block:
            out.append(("s3", t3, qbuf, False))
            if qbuf == 2:
                out.append(("s3-cross", t3, qbuf, True))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=CASES)
    p.add_argument("--out", default=".")
    p.add_argument("--skip-ragged", action="store_true")
    a = p.parse_args()
    traits = device_traits(torch.device("cuda"))
    if not a.skip_ragged:
        check_ragged(traits)
    rows = []
    for case in a.cases.split(","):
        b, h, length, d = map(int, case.split("x"))
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fl = attention_flops(AttentionShape(b, h, length, length, d, causal), "fwd")
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = fl / cuda_median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)) / 1e9
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            triton_tf = fl / cuda_median_ms(lambda: flash_attention_science(q, k, v, causal=causal,
                                                                            backend="triton")) / 1e9
            tiles = sm90_forward_tiles(d, causal, length)
            num_work = b * h * -(-length // tiles.block_m)
            ctas = traits.sm_count if sm90_persistent(causal, length, num_work, traits.sm_count) else None
            row = {"B": b, "H": h, "L": length, "D": d, "causal": causal, "cudnn": cudnn, "triton": triton_tf,
                   "tiles": tiles.as_dict(), "persistent": ctas is not None}
            outs = []
            line = []
            for name, vt, qbuf, cross in variants(tiles, causal, d, ctas is not None, traits):
                out, lse = run_sm90(q, k, v, causal, vt, ctas, qbuf, cross)

                def fn():  # into the same buffers: no allocation or fill in the timed call
                    fwd_sm90.attention_forward_sm90(q, k, v, out, lse, causal, d**-0.5, vt, num_ctas=ctas,
                                                    q_buffers=qbuf, cross_item=cross)
                tf = fl / cuda_median_ms(fn) / 1e9
                err = (out.float() - ref.float()).abs().max().item()
                row[name] = {"tflops": tf, "err": err, "stages": vt.num_stages, "q_buffers": qbuf, "cross": cross}
                line.append(f"{name} {tf:.0f} ({tf / cudnn:.3f}) err{err:.1e}")
                outs.append(out)
            row["identical"] = all(torch.equal(outs[0], o) for o in outs[1:])
            rows.append(row)
            print(f"B{b} H{h} L{length} D{d} causal={int(causal)} 128x{tiles.block_n} s{tiles.num_stages} "
                  f"pers={int(ctas is not None)}: cudnn {cudnn:.0f} | triton {triton_tf:.0f} ({triton_tf / cudnn:.3f})"
                  f" | " + " | ".join(line) + f" | identical={row['identical']}", flush=True)
    with open(os.path.join(a.out, "ab_fwd_sm90.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
