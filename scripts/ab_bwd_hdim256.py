"""Where the sm_90 D=256 backward's time goes: variants of hopper/bwd_sm90_hdim256.py with one piece removed each
(wrong gradients, timing only), timed beside the kernel as it is, in one process.

    PYTHONPATH=src python scripts/ab_bwd_hdim256.py [--variants base,no_red,...] [--shapes B,H,L,causal ...]

A variant is a list of (old, new) source replacements; the edited module is written to a temporary file and
imported (Gluon reads kernel source through inspect), then its `launch` is timed on precomputed out/lse/Δ with
triton.testing.do_bench medians. TFLOP/s count the backward as 2.5x the forward's 4·B·H·Lq·Lk·D (half if causal).
"""
import argparse
import importlib.util
import inspect
import math
import sys
import tempfile

import torch

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.hopper import bwd_sm90_hdim256
from flashmoe_science.bench.attention import cuda_median_ms

ATOMIC = 'gl.atomic_add(dq_ptrs, dq, mask=gl.expand_dims(start_m + dq_rows < seqlen_q, 1), sem="relaxed")'
VARIANTS = {
    "base": [],
    "s1": [],  # a one-stage Q/dO ring
    "tma_s1": [],  # dQ through shared memory and TMA reduce-adds (needs the one-stage ring's shared memory)
    # the dQ atomics issued but predicated off: what their memory traffic costs
    "no_red": [(ATOMIC, ATOMIC.replace("seqlen_q, 1)", "seqlen_q, 1) & (seqlen_q < 0)"))],
    # no dQ product and no atomics
    "no_dq": [("dq = warpgroup_mma(ds_smem.index(slot0 + 0)", "dq_unused = warpgroup_mma(ds_smem.index(slot0 + 0)"),
              ("dq = warpgroup_mma(ds_smem.index(slot0 + 1), k_half.slice(KEYS, KEYS), dq, is_async=True)", ""),
              ("dq = warpgroup_mma_wait(4, deps=(dq,))", "dq_unused = warpgroup_mma_wait(4, deps=(dq_unused,))"),
              (ATOMIC, "")],
    # no dVᵀ/dKᵀ products (the transposed N=32 SS wgmmas)
    "no_dkdv": [("dv0 = warpgroup_mma(do_half_t", "dv0_x = warpgroup_mma(do_half_t"),
                ("dv1 = warpgroup_mma(do_half_t", "dv1_x = warpgroup_mma(do_half_t"),
                ("dk0 = warpgroup_mma(q_half_t", "dk0_x = warpgroup_mma(q_half_t"),
                ("dk1 = warpgroup_mma(q_half_t", "dk1_x = warpgroup_mma(q_half_t"),
                ("dq = warpgroup_mma_wait(4, deps=(dq,))", "dq = warpgroup_mma_wait(0, deps=(dq,))"),
                ("dv0, dv1, dk0, dk1 = warpgroup_mma_wait(0, deps=(dv0, dv1, dk0, dk1))", "")],
    # no S/dP products (their initial values stand in)
    "no_sdp": [("s = warpgroup_mma(q_tile, my_keys.permute((1, 0)), s_init, is_async=True)", "s = s_init"),
               ("dp = warpgroup_mma(do_tile, my_values.permute((1, 0)), dp_init, is_async=True)", "dp = dp_init"),
               ("s = warpgroup_mma_wait(1, deps=(s,))", ""), ("dp = warpgroup_mma_wait(0, deps=(dp,))", "")],
    # the consumers do not wait for each other's P/dS (wrong, timing only)
    "no_meet": [("mbarrier.wait(pds_ready.index(ring % 2), (ring // 2) & 1)", "")],
}
LAUNCH_KWARGS = {"s1": dict(num_stages=1), "tma_s1": dict(num_stages=1, dq_by_tma=True),
                 "no_red_s1": dict(num_stages=1)}
VARIANTS["no_red_s1"] = VARIANTS["no_red"]
SHAPES = [(4, 8, 4096, 0), (4, 8, 4096, 1), (1, 8, 16384, 0), (32, 8, 512, 0)]


def variant_module(name, replacements):
    src = inspect.getsource(bwd_sm90_hdim256)
    for old, new in replacements:
        if old not in src:
            raise ValueError(f"{name}: {old!r} not in the source")
        src = src.replace(old, new)
    f = tempfile.NamedTemporaryFile("w", suffix=f"_{name}.py", delete=False)
    f.write(src)
    f.close()
    spec = importlib.util.spec_from_file_location(f"bwd256_{name}", f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--shapes", nargs="*", default=None, help="B,H,L,causal")
    a = p.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    mods = {n: variant_module(n, VARIANTS[n]) for n in a.variants.split(",")}
    d = 256
    for b, h, length, causal in shapes:
        q, k, v, grad_out = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        scale = 1.0 / math.sqrt(d)
        with torch.no_grad():
            out, lse = flash_attention_science(q, k, v, causal=bool(causal), return_lse=True)
        delta = (out.float() * grad_out.float()).sum(-1)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dq_accum = torch.zeros(b, h, length, d, device="cuda")
        flops = 2.5 * 4 * b * h * length * length * d * (0.5 if causal else 1.0)
        cells = []
        for name, mod in mods.items():
            def run(mod=mod, kwargs=LAUNCH_KWARGS.get(name, {})):
                mod.launch(q, k, v, lse, grad_out, delta, dq_accum, dk, dv, bool(causal), scale, **kwargs)
            run()
            ms = cuda_median_ms(run)
            cells.append(f"{name} {ms:.3f} ms {flops / ms / 1e9:.0f}")
        print(f"B{b} H{h} L{length} {'causal' if causal else 'full'}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
