"""Time the Gluon sm_90 backward beside sdpa-cudnn's backward and the library's Triton backward (H200).

    PYTHONPATH=src python scripts/bench_bwd_sm90.py [--stages 2,3] [--d 128,64]

Shapes: from the FA3 grid (B·L = 16k, H·D = 2048) at D = 128, 64 and 256, causal and not, bf16. TFLOP/s count the backward as 2.5x the
forward's 4·B·H·Lq·Lk·D (halved for causal). The sm_90 time covers its three launches (preprocess, the Gluon
kernel, dQ convert) on precomputed out/lse; cuDNN and the library's default call ("library": on Hopper the same
sm_90 backward) and its deterministic call ("two-pass": the Triton backward) are timed through autograd (bench/attention.py's _measure_backward), which adds a
little host time to theirs.
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.hopper import bwd_sm90
from flashmoe_science.attention.tiles import padded_head_dim
from flashmoe_science.bench.attention import _measure_backward, cuda_median_ms

SHAPES = [(4, 16, 4096, 128), (16, 16, 1024, 128), (1, 16, 16384, 128), (32, 16, 512, 128), (4, 32, 4096, 64),
          (16, 32, 1024, 64), (32, 32, 512, 64), (8, 32, 2048, 64), (4, 8, 4096, 256), (1, 8, 16384, 256),
          (16, 8, 1024, 256), (32, 8, 512, 256), (8, 8, 2048, 256)]


def tflops(b, h, length, d, causal, ms):
    flops = 2.5 * 4 * b * h * length * length * d * (0.5 if causal else 1.0)
    return flops / ms / 1e9


def sm90_backward_ms(q, k, v, grad_out, causal, num_stages):
    scale = 1.0 / math.sqrt(q.shape[-1])
    with torch.no_grad():
        out, lse = flash_attention_science(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    dq_accum = torch.empty(*q.shape[:3], padded_head_dim(q.shape[-1]), device=q.device)

    def run():
        bwd_sm90.attention_backward_sm90(q, k, v, out, lse, grad_out, delta, dq, dk, dv, causal, scale, dq_accum,
                                         num_stages=num_stages)

    run()
    return cuda_median_ms(run)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default=str(bwd_sm90.NUM_STAGES), help="comma-separated Q/dO ring depths to time")
    p.add_argument("--d", default="128,64", help="head dims to run")
    p.add_argument("--max-len", type=int, default=1 << 30, help="skip shapes longer than this")
    a = p.parse_args()
    variants = [int(st) for st in a.stages.split(",")]
    dims = {int(x) for x in a.d.split(",")}
    device = torch.device("cuda")
    for b, h, length, d in SHAPES:
        if d not in dims or length > a.max_len:
            continue
        for causal in (False, True):
            q, k, v, grad_out = (torch.randn(b, h, length, d, device=device, dtype=torch.bfloat16) for _ in range(4))

            def cudnn(q, k, v):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            def ours(q, k, v):
                return flash_attention_science(q, k, v, causal=causal)

            def two_pass(q, k, v):
                return flash_attention_science(q, k, v, causal=causal, deterministic=True)

            cudnn_ms, _ = _measure_backward(cudnn, q, k, v, grad_out, cuda_median_ms, device)
            triton_ms, _ = _measure_backward(ours, q, k, v, grad_out, cuda_median_ms, device)
            two_pass_ms, _ = _measure_backward(two_pass, q, k, v, grad_out, cuda_median_ms, device)
            row = f"B{b} H{h} L{length} D{d} {'causal' if causal else 'full':6}"
            cells = [(name, ms, tflops(b, h, length, d, causal, ms))
                     for name, ms in (("cudnn", cudnn_ms), ("library", triton_ms), ("two-pass", two_pass_ms))]
            print(row, " | ".join(f"{n} {ms:.3f} ms {t:.0f} TFLOP/s" for n, ms, t in cells), flush=True)
            for stages in variants:
                try:
                    sm90_ms = sm90_backward_ms(q, k, v, grad_out, causal, stages)
                except Exception as e:  # e.g. a ring too deep for the shared memory at this head dim
                    print(f"    sm90 s{stages}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                print(f"    sm90 s{stages}: {sm90_ms:.3f} ms "
                      f"{tflops(b, h, length, d, causal, sm90_ms):.0f} TFLOP/s | sm90/cudnn {cudnn_ms / sm90_ms:.2f}x, "
                      f"sm90/library {triton_ms / sm90_ms:.2f}x", flush=True)


if __name__ == "__main__":
    main()
