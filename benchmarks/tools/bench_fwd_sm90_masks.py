"""Timing of the Gluon sm_90 forward's masks on one GPU (bf16, D=128, median of triton.testing.do_bench):

* sliding window (4096, 0) at L = 32k and 128k against the dense kernel (TFLOP/s counted on the visible pairs);
* softcap and ALiBi against the plain kernel (same shapes);
* a packed (varlen) batch of long-tailed lengths against dense batches of the same token count (TFLOP/s on the
  real pairs).

    PYTHONPATH=src python benchmarks/tools/bench_fwd_sm90_masks.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from flashmoe_science.attention.hopper import fwd_sm90
from flashmoe_science.attention.mask import make_mask
from flashmoe_science.attention.hopper.tiles import (sm90_cross_item, sm90_forward_tiles, sm90_persistent,
                                                     sm90_q_buffers)
from flashmoe_science.attention.seqlen import VarlenBatch
from flashmoe_science.device import device_traits

D, H = 128, 16


def visible_pairs(lq: int, lk: int, mask) -> int:
    """Pairs (i, j) a query sees: the window [i + Lk - Lq - left, i + Lk - Lq + right] clipped to the keys (the rule
    of mask.visibility, counted per row instead of materialised: 128k x 128k would not fit)."""
    i = torch.arange(lq, dtype=torch.int64) + (lk - lq)
    hi = torch.clamp(i + mask.window_right, max=lk - 1) if mask.bounded_right else torch.full_like(i, lk - 1)
    lo = torch.clamp(i - mask.window_left, min=0) if mask.bounded_left else torch.zeros_like(i)
    return int(torch.clamp(hi - lo + 1, min=0).sum())


def launch(q, k, v, mask, slopes=None, varlen=None, seqlen_q=None, two_stage=False):
    """One forward launch, planned as the api plans the sm_90 kernel (a right bound plans as causal); two_stage:
    the non-causal plan's ring (two stages, two Q buffers) whatever the mask."""
    traits = device_traits(q.device)
    right = mask.bounded_right and not two_stage
    seqlen_q = seqlen_q or q.shape[2]
    tiles = sm90_forward_tiles(D, right, seqlen_q)
    num_work = q.shape[0] * q.shape[1] * -(-q.shape[2] // 128)
    persistent = varlen is not None or sm90_persistent(right, seqlen_q, num_work, traits.sm_count)
    q_buffers = sm90_q_buffers(tiles, D, persistent, traits)
    cross = sm90_cross_item(tiles, D, right, persistent, q_buffers) and not two_stage
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device)
    num_ctas = traits.sm_count if persistent else None
    return lambda: fwd_sm90.attention_forward_sm90(q, k, v, out, lse, mask.causal, D**-0.5, tiles, num_ctas,
                                                   q_buffers, cross, mask=mask, alibi_slopes=slopes, varlen=varlen)


def ms(fn) -> float:
    fn()
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def tflops(pairs: int, t_ms: float) -> float:
    return 4 * pairs * D / (t_ms * 1e-3) / 1e12


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def window_rows(quick: bool) -> list[dict]:
    rows = []
    L = 32768
    q, k, v = rand(1, H, L, D), rand(1, H, L, D), rand(1, H, L, D)
    for name, mask, two_stage in (("dense", make_mask(False), False), ("causal", make_mask(True), False),
                                  ("window(4096,0)", make_mask(True, (4096, -1)), False),
                                  ("window(4096,0) two-stage", make_mask(True, (4096, -1)), True),
                                  ("window(2048,2048)", make_mask(False, (2048, 2048)), False),
                                  ("window(2048,2048) two-stage", make_mask(False, (2048, 2048)), True)):
        t = ms(launch(q, k, v, mask, two_stage=two_stage))
        pairs = H * visible_pairs(L, L, mask)
        rows.append(dict(case=name, L=L, ms=t, tflops=tflops(pairs, t)))
    if not quick:
        L = 131072
        q, k, v = rand(1, H, L, D), rand(1, H, L, D), rand(1, H, L, D)
        mask = make_mask(True, (4096, -1))
        t = ms(launch(q, k, v, mask))
        rows.append(dict(case="window(4096,0)", L=L, ms=t, tflops=tflops(H * visible_pairs(L, L, mask), t)))
    return rows


def mods_rows() -> list[dict]:
    rows = []
    B, L = 2, 8192
    q, k, v = rand(B, H, L, D), rand(B, H, L, D), rand(B, H, L, D)
    slopes = torch.rand(H, device="cuda") * 0.1
    for causal in (False, True):
        for name, softcap, alibi in (("plain", None, None), ("softcap", 30.0, None), ("alibi", None, slopes),
                                     ("softcap+alibi", 30.0, slopes)):
            mask = make_mask(causal, None, softcap)
            t = ms(launch(q, k, v, mask, alibi))
            rows.append(dict(case=name, causal=causal, L=L, ms=t,
                             tflops=tflops(B * H * visible_pairs(L, L, mask), t)))
    return rows


def long_tailed_lengths(total: int, seed: int = 0) -> list[int]:
    """Lengths in 64..8192, log-uniform (many short, a few long), summing to `total`."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        n = int(2 ** (6 + 7 * torch.rand(1, generator=g).item()))
        lengths.append(min(n, total - sum(lengths)))
    return lengths


def varlen_rows() -> list[dict]:
    rows = []
    total = 16384
    lengths = long_tailed_lengths(total)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    cu = cu.cuda()
    packed = [rand(total, H, D) for _ in range(3)]
    q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in packed)
    for causal in (False, True):
        mask = make_mask(causal)
        block_m = sm90_forward_tiles(D, False, max(lengths)).block_m  # D=128: two consumers
        batch = VarlenBatch.of(cu, cu, block_m, total, mask.plain_causal)
        pairs = H * sum(visible_pairs(n, n, mask) for n in lengths)
        for two_stage in (False, True) if causal else (False,):
            t = ms(launch(q, k, v, mask, varlen=batch, seqlen_q=max(lengths), two_stage=two_stage))
            rows.append(dict(case=f"varlen {len(lengths)} seqs 64..8192" + (" two-stage" if two_stage else ""),
                             causal=causal, tokens=total, ms=t, tflops=tflops(pairs, t)))
        for b, L in ((8, 2048), (2, 8192)):
            dq, dk, dv = rand(b, H, L, D), rand(b, H, L, D), rand(b, H, L, D)
            t = ms(launch(dq, dk, dv, mask))
            rows.append(dict(case=f"dense B={b} L={L}", causal=causal, tokens=b * L, ms=t,
                             tflops=tflops(b * H * visible_pairs(L, L, mask), t)))
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="skip L=128k")
    p.add_argument("--json")
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    results = {}
    for part, fn in (("window", lambda: window_rows(a.quick)), ("mods", mods_rows), ("varlen", varlen_rows)):
        results[part] = fn()
        for row in results[part]:
            print(part, " ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                                 for key, val in row.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
