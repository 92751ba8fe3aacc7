"""Why compiled FlexAttention decodes slowly in bench --suite decode: one token, Hq=32, Hkv=8, D=128, bf16, B=1.

    PYTHONPATH=src python benchmarks/tools/ab_flex_decode.py [L ...]

Times the compiled flex call eagerly and as a CUDA-graph replay, with and without an explicit (full) block mask,
checks its output against SDPA, and prints dynamo's counters (graph breaks, recompiles)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from flashmoe_science.bench.report import graph_replay
from flashmoe_science.bench.report import gpu_median_ms


def main(lengths):
    import torch._dynamo.utils as dynamo_utils

    flex = torch.compile(flex_attention, dynamic=False)
    for length in lengths:
        q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv_bytes = 2 * k.numel() * 2
        full = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, B=None, H=None, Q_LEN=1, KV_LEN=length,
                                 device="cuda")
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        for label, call in (("no mask", lambda: flex(q, k, v, enable_gqa=True)),
                            ("full block mask", lambda: flex(q, k, v, block_mask=full, enable_gqa=True))):
            out = call()
            err = (out.float() - ref.float()).abs().max().item()
            eager = gpu_median_ms(call)
            graphed = gpu_median_ms(graph_replay(call))
            print(f"L={length} {label}: err {err:.2e}, eager {eager * 1e3:.1f} us "
                  f"({kv_bytes / eager / 1e9:.2f} TB/s), graph {graphed * 1e3:.1f} us "
                  f"({kv_bytes / graphed / 1e9:.2f} TB/s)", flush=True)
    print({name: dict(values) for name, values in dynamo_utils.counters.items() if values})


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [32768, 131072])
