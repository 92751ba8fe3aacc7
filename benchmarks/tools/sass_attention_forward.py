"""Compile the Gluon sm_90 attention kernel on a machine without a GPU (ptxas ships with triton) and report
registers, shared memory, spills and the SASS instruction mix. Catches compile errors before using GPU time.

    PYTHONPATH=src python benchmarks/tools/sass_attention_forward.py [--sass out.sass] [--q-buffers N] [--cross-item] D BLOCK_N STAGES CAUSAL
"""
import argparse

from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.attention.tiles import AttentionTiles
from sass_tools import sass_counts


def compile_once(d, bn, stages, causal, q_buffers=1, cross_item=False):
    return fwd_sm90.compile_offline(d, causal, AttentionTiles(128, bn, 8, stages), q_buffers=q_buffers,
                                    cross_item=cross_item)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--sass")
    p.add_argument("--q-buffers", type=int, default=1)
    p.add_argument("--cross-item", action="store_true")
    p.add_argument("config", nargs="*", type=int, default=[128, 128, 2, 0], help="D BLOCK_N STAGES CAUSAL")
    a = p.parse_args()
    d, bn, st, c = a.config
    k = compile_once(d, bn, st, bool(c), q_buffers=a.q_buffers, cross_item=a.cross_item)
    sass, counts = sass_counts(k.asm["cubin"])
    print(f"D{d} 128x{bn} stages{st} causal{c} qbuf{a.q_buffers} cross{int(a.cross_item)}: smem {k.metadata.shared} | {counts}")
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(sass)
