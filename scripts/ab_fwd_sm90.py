"""A/B of the sm_90 forward with one or two Q buffers per consumer, beside cuDNN, at the tiles and persistence the
library picks for each shape (two buffers with one ring stage fewer where that is what fits). The variants do the
same arithmetic in the same order per row, so at equal tiles their outputs must match bit for bit; all are also
checked against SDPA (max abs error). (Session 3 also A/B'd a consumer ping-pong here: docs/perf-notes.md.)

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

from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.attention.tiles import device_traits, sm90_forward_tiles, sm90_persistent, sm90_smem_bytes
from flashmoe_science.bench.attention import AttentionShape, attention_flops, cuda_median_ms

CASES = ("32x16x512x128,16x16x1024x128,8x16x2048x128,2x16x8192x128,32x32x512x64,16x32x1024x64,4x32x4096x64,"
         "32x8x512x256,8x8x2048x256")


def check_ragged(traits, limit):
    """Lq != Lk, odd lengths, GQA, both persistence modes: two Q buffers must equal one bit for bit."""
    for causal in (False, True):
        for lq, lk in ((1000, 1000), (300, 777), (777, 300), (129, 4097)):
            q = torch.randn(2, 8, lq, 128, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(2, 2, lk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            tiles = sm90_forward_tiles(128, causal, lq)
            for ctas in (None, 7, traits.sm_count):
                outs = []
                for qbuf in (1, 2):
                    if sm90_smem_bytes(tiles, 128, qbuf) > limit:
                        continue
                    out = torch.full_like(q, float("nan"))
                    lse = torch.empty(q.shape[:3], device="cuda")
                    fwd_sm90.attention_forward_sm90(q, k, v, out, lse, causal, 128**-0.5, tiles, num_ctas=ctas,
                                                    q_buffers=qbuf)
                    outs.append((out, lse))
                torch.cuda.synchronize()
                same = all(torch.equal(outs[0][0], o) and torch.equal(outs[0][1], lse) for o, lse in outs[1:])
                print(f"ragged Lq{lq} Lk{lk} causal={causal} ctas={ctas}: {len(outs)} variants identical={same}",
                      flush=True)
                assert same


def variants(tiles, d, persistent, limit):
    """(name, tiles, q_buffers): the plan's tiles with one Q buffer, and with two (with one ring stage fewer if that
    is what makes it fit)."""
    out = [("qbuf1", tiles, 1)]
    if persistent:
        for stages in range(tiles.num_stages, 1, -1):
            t2 = dataclasses.replace(tiles, num_stages=stages)
            if sm90_smem_bytes(t2, d, 2) <= limit:
                out.append((f"qbuf2-s{stages}", t2, 2))
                break
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=CASES)
    p.add_argument("--out", default=".")
    a = p.parse_args()
    traits = device_traits(torch.device("cuda"))
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    check_ragged(traits, limit)
    rows = []
    for case in a.cases.split(","):
        b, h, length, d = map(int, case.split("x"))
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fl = attention_flops(AttentionShape(b, h, length, length, d, causal), "fwd")
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = fl / cuda_median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)) / 1e9
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            tiles = sm90_forward_tiles(d, causal, length)
            ctas = traits.sm_count if sm90_persistent(causal, length) else None
            row = {"B": b, "H": h, "L": length, "D": d, "causal": causal, "cudnn": cudnn, "tiles": tiles.as_dict(),
                   "persistent": ctas is not None}
            outs = []
            line = []
            for name, vt, qbuf in variants(tiles, d, ctas is not None, limit):
                out = torch.empty_like(q)
                lse = torch.empty(q.shape[:3], device="cuda")

                def fn():
                    fwd_sm90.attention_forward_sm90(q, k, v, out, lse, causal, d**-0.5, vt, num_ctas=ctas,
                                                    q_buffers=qbuf)
                fn()
                tf = fl / cuda_median_ms(fn) / 1e9
                err = (out.float() - ref.float()).abs().max().item()
                row[name] = {"tflops": tf, "err": err, "stages": vt.num_stages}
                line.append(f"{name} {tf:.0f} ({tf / cudnn:.3f}) err{err:.1e}")
                if vt.num_stages == tiles.num_stages:
                    outs.append(out)
            row["identical"] = all(torch.equal(outs[0], o) for o in outs[1:])
            rows.append(row)
            print(f"B{b} H{h} L{length} D{d} causal={int(causal)} 128x{tiles.block_n} s{tiles.num_stages} "
                  f"pers={int(ctas is not None)}: cudnn {cudnn:.0f} | " + " | ".join(line)
                  + f" | identical={row['identical']}", flush=True)
    with open(os.path.join(a.out, "ab_fwd_sm90.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
