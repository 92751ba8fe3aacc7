"""Time the two kernels of the sm_90 backward at head dim 256 (hopper/bwd_sm90_hdim256: dK/dV; hopper/bwd_dq_sm90:
dQ) separately and together, beside sdpa-cudnn's whole backward, in one process (H200).

    PYTHONPATH=src python scripts/ab_bwd_hdim256.py [--dq-stages 2,3] [--shapes B,H,L,causal ...]

The kernels run on precomputed out/lse/Δ (triton.testing.do_bench medians); each is timed alone and the row's
total is the sum of the two times. TFLOP/s (cuDNN's and the total's) count the backward as 2.5x the forward's
4·B·H·Lq·Lk·D (half if causal).
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.hopper import bwd_dq_sm90, bwd_sm90_hdim256
from flashmoe_science.bench.attention import _measure_backward, cuda_median_ms

SHAPES = [(4, 8, 4096, 0), (4, 8, 4096, 1), (1, 8, 16384, 0), (1, 8, 16384, 1), (16, 8, 1024, 0), (32, 8, 512, 0),
          (32, 8, 512, 1)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dq-stages", default="2,3")
    p.add_argument("--shapes", nargs="*", default=None, help="B,H,L,causal")
    a = p.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    d = 256
    device = torch.device("cuda")
    for b, h, length, causal in shapes:
        causal = bool(causal)
        q, k, v, grad_out = (torch.randn(b, h, length, d, device=device, dtype=torch.bfloat16) for _ in range(4))
        scale = 1.0 / math.sqrt(d)
        with torch.no_grad():
            out, lse = flash_attention_science(q, k, v, causal=causal, return_lse=True)
        delta = (out.float() * grad_out.float()).sum(-1)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        flops = 2.5 * 4 * b * h * length * length * d * (0.5 if causal else 1.0)

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        cudnn_ms, _ = _measure_backward(cudnn, q, k, v, grad_out, cuda_median_ms, device)
        dkdv_ms = cuda_median_ms(lambda: bwd_sm90_hdim256.launch(q, k, v, lse, grad_out, delta, dk, dv, causal,
                                                                 scale))
        cells = [f"cudnn {cudnn_ms:.3f} ms ({flops / cudnn_ms / 1e9:.0f})", f"dkdv {dkdv_ms:.3f}"]
        for stages in (int(x) for x in a.dq_stages.split(",")):
            dq_ms = cuda_median_ms(lambda: bwd_dq_sm90.launch(q, k, v, lse, grad_out, delta, dq, causal, scale,
                                                              num_stages=stages))
            total = dkdv_ms + dq_ms
            cells.append(f"dq s{stages} {dq_ms:.3f} -> {total:.3f} ms ({flops / total / 1e9:.0f}, "
                         f"{cudnn_ms / total:.2f}x cudnn)")
        print(f"B{b} H{h} L{length} {'causal' if causal else 'full'}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
