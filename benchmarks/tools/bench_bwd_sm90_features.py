"""Time the Gluon sm_90 backward with a sliding window, softcap and ALiBi against the same kernel without them (H200).

    PYTHONPATH=src python benchmarks/tools/bench_bwd_sm90_features.py [--lengths 32768,131072] [--d 128]

The backward alone: bwd_sm90.attention_backward_sm90's launches on precomputed out and lse. TFLOP/s count the backward as 2.5x the forward's 4·B·H·D per visible
(query, key) pair: L² dense, L²/2 causal (the FlashAttention convention), and the exact number of pairs inside a
window, so a windowed call at the dense call's TFLOP/s skips every tile outside its window at no cost.
"""
import argparse
import math

import torch

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.features import CallFeatures
from flashmoe_science.attention.hopper import bwd_sm90
from flashmoe_science.attention.mask import make_mask
from flashmoe_science.attention.tiles import padded_head_dim
from flashmoe_science.bench.attention import cuda_median_ms


def visible_pairs(length: int, causal: bool, window) -> float:
    """Query-key pairs a call computes on (dense: the FlashAttention convention)."""
    if window is None:
        return length * length * (0.5 if causal else 1.0)
    i = torch.arange(length, dtype=torch.float64)
    left, right = window
    hi = torch.clamp(i + (0 if causal else (length if right < 0 else right)), max=length - 1)
    lo = torch.clamp(i - (length if left < 0 else left), min=0)
    return float((hi - lo + 1).clamp(min=0).sum())


def backward_ms(b, h, length, d, *, causal=False, window=None, softcap=None, alibi=False):
    q, k, v, grad_out = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    slopes = torch.rand(b, h, device="cuda") * 0.1 if alibi else None
    with torch.no_grad():
        out, lse = flash_attention_science(q, k, v, causal=causal, window=window, softcap=softcap,
                                           alibi_slopes=slopes, return_lse=True)
    features = CallFeatures(mask=make_mask(causal, window, softcap), alibi_slopes=slopes)
    scale = 1.0 / math.sqrt(d)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    dq_accum = torch.empty(*q.shape[:3], padded_head_dim(d), device="cuda")

    def run():
        bwd_sm90.attention_backward_sm90(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, scale, dq_accum)

    run()
    return cuda_median_ms(run)


def report(name, b, h, length, d, ms, pairs, base=None):
    tflops = 2.5 * 4 * b * h * d * pairs / ms / 1e9
    rel = f"  {tflops / base:.2f}x of {base:.0f}" if base else ""
    print(f"{name:34} B{b} H{h} L{length} D{d}: {ms:8.3f} ms {tflops:6.0f} TFLOP/s{rel}", flush=True)
    return tflops


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="32768,131072", help="sequence lengths for the window comparison")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    a = p.parse_args()
    d, h = a.d, a.heads
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    dense = {}  # the dense kernel's TFLOP/s per mask, from the first (shortest) length: at 128k a dense call
    for length in (int(x) for x in a.lengths.split(",") if x):  # costs seconds, and its rate no longer changes
        for causal, window in ((True, (a.window - 1, 0)), (False, (a.window // 2, a.window // 2))):
            if causal not in dense:
                dense[causal] = report(f"dense {'causal' if causal else 'full'}", 1, h, length, d,
                                       backward_ms(1, h, length, d, causal=causal), visible_pairs(length, causal, None))
            report(f"window {window}{' causal' if causal else ''}", 1, h, length, d,
                   backward_ms(1, h, length, d, causal=causal, window=window), visible_pairs(length, causal, window),
                   dense[causal])
    b, length = 2, 8192
    for causal in (False, True):
        pairs = visible_pairs(length, causal, None)
        plain = report(f"plain {'causal' if causal else 'full'}", b, h, length, d,
                       backward_ms(b, h, length, d, causal=causal), pairs)
        for name, kwargs in (("softcap 30", dict(softcap=30.0)), ("alibi", dict(alibi=True)),
                             ("softcap + alibi", dict(softcap=30.0, alibi=True))):
            report(f"{name} {'causal' if causal else 'full'}", b, h, length, d,
                   backward_ms(b, h, length, d, causal=causal, **kwargs), pairs, plain)


if __name__ == "__main__":
    main()
