"""Compile the Gluon sm_90 attention backward on a machine without a GPU (ptxas ships with triton) and report
registers, shared memory, spills and the SASS instruction mix (HGMMA, TMA, barriers).

    PYTHONPATH=src:benchmarks/tools python benchmarks/tools/sass_attention_backward.py [--sass out.sass] [--stages N] [D CAUSAL ...]

With no config: D in {64, 128, 256} x causal in {0, 1} (at 256: the dK/dV kernel, bwd_sm90_hdim256).
"""
import argparse

from flashmoe_science.attention.hopper import bwd_sm90
from sass_tools import sass_counts

EXTRA_OPS = ("UBLKRED", "UTMAREDG", "REDG", "LDG", "STG", "LDL", "STL", "BAR.SYNC", "SYNCS")


def report(d, causal, stages=bwd_sm90.NUM_STAGES, sass_path=None):
    k = bwd_sm90.compile_offline(d, causal, stages)
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
    configs = list(zip(a.config[::2], a.config[1::2])) or [(64, 0), (64, 1), (128, 0), (128, 1), (256, 0), (256, 1)]
    for d, c in configs:
        report(d, bool(c), a.stages, a.sass)
