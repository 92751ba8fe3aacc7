"""Compile the Gluon sm_90 attention kernel on a machine without a GPU (ptxas ships with triton) and report
registers, shared memory, spills and the SASS instruction mix. Catches compile errors before using GPU time.

    PYTHONPATH=src python scripts/compile_sm90.py [--sass out.sass] [--q-buffers N] [--cross-item] D BLOCK_N STAGES CAUSAL
"""
import argparse

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.attention.tiles import padded_head_dim
from flashmoe_science.hopper.common import LAUNCH_OPTIONS
from sass_tools import sass_counts


def compile_once(d, bn, stages, causal, dtype=torch.bfloat16, q_buffers=1, cross_item=False):
    bd = padded_head_dim(d)
    q = torch.empty(2, 4, 256, d, dtype=dtype)
    lse = torch.empty(2, 4, 256)
    args = dict(q_desc=fwd_sm90._descriptor(q, fwd_sm90.CONSUMER_ROWS, bd), k_desc=fwd_sm90._descriptor(q, bn, bd),
                v_desc=fwd_sm90._descriptor(q, bn, bd), o_desc=fwd_sm90._descriptor(q, fwd_sm90.CONSUMER_ROWS, bd),
                LSE=lse, num_q_heads=4, group_size=1, seqlen_q=256, seqlen_k=256, qk_scale=0.1,
                num_m_tiles=2, num_work=16)
    consts = dict(BLOCK_N=bn, BLOCK_D=bd, NUM_STAGES=stages, CAUSAL=causal, Q_BUFFERS=q_buffers,
                  CROSS_ITEM=cross_item)
    fn = fwd_sm90.attention_forward_sm90_kernel
    names = fn.arg_names
    signature = {n: ("constexpr" if n in consts else mangle_type(args[n])) for n in names}
    constexprs = {(names.index(n),): v for n, v in consts.items()}
    # what Triton's launcher specialises on: 16-byte aligned pointers and integers divisible by 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, v in args.items()
             if isinstance(v, torch.Tensor) or (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0)}
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(LAUNCH_OPTIONS))


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
