"""Compile the Gluon sm_90 attention backward on a machine without a GPU (ptxas ships with triton) and report
registers, shared memory, spills and the SASS instruction mix (HGMMA, TMA, barriers).

    PYTHONPATH=src:scripts python scripts/compile_bwd_sm90.py [--sass out.sass] [--stages N] [D CAUSAL ...]

With no config: D in {64, 128} x causal in {0, 1}.
"""
import argparse

import torch

from flashmoe_science.attention.hopper import bwd_sm90
from flashmoe_science.attention.tiles import padded_head_dim
from flashmoe_science.moe.hopper.common import compile_offline
from sass_tools import sass_counts

EXTRA_OPS = ("UBLKRED", "UTMAREDG", "REDG", "LDG", "STG", "LDL", "STL", "BAR.SYNC", "SYNCS")


def compile_once(d, causal, stages=bwd_sm90.NUM_STAGES, dtype=torch.bfloat16):
    bd = padded_head_dim(d)
    q = torch.empty(2, 4, 256, d, dtype=dtype, device="meta")
    lse = torch.empty(2, 4, 256, device="meta")
    acc = torch.empty(2, 4, 256, bd, device="meta")
    args = (bwd_sm90._descriptor(q, bwd_sm90.BLOCK_M, bd), bwd_sm90._descriptor(q, bwd_sm90.BLOCK_M, bd),
            bwd_sm90._descriptor(q, bwd_sm90.BLOCK_N, bd), bwd_sm90._descriptor(q, bwd_sm90.BLOCK_N, bd),
            bwd_sm90._dq_accum_descriptor(acc), lse, lse, q, q,
            1024 * d, 256 * d, d, 1024 * d, 256 * d, d, 4, 2, 2, 256, 256, 0.1, 0.07, d, bd, stages, causal)
    consts = dict(HEAD_DIM=d, BLOCK_D=bd, NUM_STAGES=stages, CAUSAL=causal)
    return compile_offline(bwd_sm90.attention_backward_sm90_kernel, args, consts)


def report(d, causal, stages=bwd_sm90.NUM_STAGES, sass_path=None):
    k = compile_once(d, causal, stages)
    sass, counts = sass_counts(k.asm["cubin"])
    for op in EXTRA_OPS:
        counts[op] = sum(1 for line in sass.splitlines() if f" {op}" in line)
    print(f"D{d} causal{int(causal)} stages{stages}: smem {k.metadata.shared} | {counts}", flush=True)
    if sass_path:
        with open(sass_path, "w") as f:
            f.write(sass)
    return k, sass, counts


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--sass")
    p.add_argument("--stages", type=int, default=bwd_sm90.NUM_STAGES)
    p.add_argument("config", nargs="*", type=int, help="D CAUSAL [D CAUSAL ...]")
    a = p.parse_args()
    configs = list(zip(a.config[::2], a.config[1::2])) or [(64, 0), (64, 1), (128, 0), (128, 1)]
    for d, c in configs:
        report(d, bool(c), a.stages, a.sass)
