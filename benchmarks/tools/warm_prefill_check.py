"""Whether an engine's warm-up leaves its prefill steps nothing to compile: `warm_prefill` for one layer's shape and
step budget, then packed causal batches shaped like the engine's steps (prompts of 256..2048 tokens filling the
budget), each step's first call timed. A step over ~100 ms is a build compiled during it.

    PYTHONPATH=src python benchmarks/tools/warm_prefill_check.py [--heads 32 --kv-heads 8 --head-dim 128]
        [--step-tokens 16384] [--steps 6] [--no-step-batch]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from flashmoe_science import flash_attention_varlen
from flashmoe_science.integrations.engine_attention import LayerOptions, warm_prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--step-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--no-step-batch", action="store_true", help="warm up without the step-sized batch")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    options = LayerOptions(args.head_dim ** -0.5)
    start = time.perf_counter()
    warm_prefill(options, args.heads, args.kv_heads, args.head_dim, dtype, device,
                 None if args.no_step_batch else args.step_tokens)
    torch.cuda.synchronize()
    print(f"warm-up: {time.perf_counter() - start:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    for step in range(args.steps):
        lengths = []
        while sum(lengths) < args.step_tokens - 256:
            lengths.append(int(min(rng.integers(256, 2049), args.step_tokens - sum(lengths))))
        cu = torch.tensor(np.concatenate(([0], np.cumsum(lengths))), dtype=torch.int32, device=device)
        q = torch.randn(sum(lengths), args.heads, args.head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(sum(lengths), args.kv_heads, args.head_dim, device=device, dtype=dtype) for _ in range(2))
        torch.cuda.synchronize()
        start = time.perf_counter()
        flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, **options.masks())
        torch.cuda.synchronize()
        print(f"step {step}: {len(lengths)} prompts, {sum(lengths)} tokens, first call {1e3 * (time.perf_counter() - start):.1f} ms",
              flush=True)


if __name__ == "__main__":
    main()
