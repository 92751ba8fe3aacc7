"""Compile the Gluon sm_90 attention kernel on a machine without a GPU (ptxas ships with triton) and report
registers, shared memory, spills and the SASS instruction mix. Catches compile errors before using GPU time.

    PYTHONPATH=src python scripts/compile_sm90.py [--sass out.sass] D BLOCK_M BLOCK_N STAGES WARPS CAUSAL
"""
import argparse
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.attention.tiles import padded_head_dim


def compile_once(d, bm, bn, stages, warps, causal, dtype=torch.bfloat16):
    bd = padded_head_dim(d)
    q = torch.empty(2, 4, 256, d, dtype=dtype)
    lse = torch.empty(2, 4, 256)
    args = dict(q_desc=fwd_sm90._descriptor(q, fwd_sm90.CONSUMER_ROWS, bd), k_desc=fwd_sm90._descriptor(q, bn, bd),
                v_desc=fwd_sm90._descriptor(q, bn, bd), O=q, LSE=lse, stride_ob=1024 * d, stride_oh=256 * d,
                stride_om=d, num_q_heads=4, group_size=1, seqlen_q=256, seqlen_k=256, qk_scale=0.1)
    consts = dict(HEAD_DIM=d, BLOCK_N=bn, BLOCK_D=bd, NUM_STAGES=stages, CAUSAL=causal)
    maxnreg = fwd_sm90.REGISTER_CAP
    warps = 4
    fn = fwd_sm90.attention_forward_sm90_kernel
    names = fn.arg_names
    signature = {n: ("constexpr" if n in consts else mangle_type(args[n])) for n in names}
    constexprs = {(names.index(n),): v for n, v in consts.items()}
    src = GluonASTSource(fn, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "maxnreg": maxnreg})


def sass_counts(cubin):
    cuobjdump = triton.__path__[0] + "/backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    usage = subprocess.run([cuobjdump, "-res-usage", f.name] if False else [cuobjdump, "-res-usage", _tmp(cubin)],
                           capture_output=True, text=True).stdout
    ops = ("HGMMA", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "UTMALDG", "LDL", "STL", "MUFU.EX2", "BAR.SYNC", "SYNCS")
    counts = {op: sass.count(op) for op in ops}
    counts["res"] = " ".join(l.strip() for l in usage.splitlines() if "REG" in l)
    return sass, counts


def _tmp(cubin):
    f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False)
    f.write(cubin)
    f.close()
    return f.name


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--sass")
    p.add_argument("config", nargs="*", type=int, default=[128, 128, 128, 2, 8, 0])
    a = p.parse_args()
    d, bm, bn, st, w, c = a.config
    k = compile_once(d, bm, bn, st, w, bool(c))
    sass, counts = sass_counts(k.asm["cubin"])
    print(f"D{d} {bm}x{bn} stages{st} warps{w} causal{c}: smem {k.metadata.shared} | {counts}")
    if a.sass:
        open(a.sass, "w").write(sass)
