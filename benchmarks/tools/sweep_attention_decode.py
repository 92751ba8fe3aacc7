"""Sweep the attention decode kernel's tiles and split counts (attention/triton_decode.py) under CUDA graphs: the
data behind attention.decode.decode_tiles and choose_num_splits.

    PYTHONPATH=src python benchmarks/tools/sweep_attention_decode.py [--budget-s 100] [--out DIR]

Hq=32, Hkv=8, D=128, bf16, one new token, full caches. Tiles (BLOCK_N, warps, stages) at the heuristic's split
count on two cases, then split counts at the heuristic's tile for every case. TB/s = K+V bytes / replay time
(do_bench median, L2 flushed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from flashmoe_science import flash_attention_decode
from flashmoe_science.attention import decode
from flashmoe_science.bench.decode import _graphed, _paged_copy
from flashmoe_science.bench.report import gpu_median_ms


def _case(batch, length):
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, length, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_pool, v_pool, table = _paged_copy(k, v)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    return q, k, v, k_pool, v_pool, table, seqlens


def _tbps(batch, length, call):
    ms = gpu_median_ms(_graphed(call))
    return 2 * batch * length * 8 * 128 * 2 / (ms * 1e-3) / 1e12


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=100)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    started = time.time()
    heuristic = decode.decode_tiles
    results = []

    def timed(label, batch, length, tiles, splits, paged, data):
        q, k, v, k_pool, v_pool, table, seqlens = data
        decode.decode_tiles = (lambda problem, traits: tiles) if tiles else heuristic
        try:
            if paged:
                call = lambda: flash_attention_decode(q, k_pool, v_pool, seqlens, block_table=table,  # noqa: E731
                                                      num_splits=splits)
            else:
                call = lambda: flash_attention_decode(q, k, v, seqlens, num_splits=splits)  # noqa: E731
            tbps = _tbps(batch, length, call)
        except Exception as error:
            print(f"{label}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            return None
        finally:
            decode.decode_tiles = heuristic
        row = dict(sweep=label, B=batch, L=length, paged=paged, splits=splits,
                   tiles=None if tiles is None else list(tiles.__dict__.values()), tbps=round(tbps, 3))
        results.append(row)
        print(json.dumps(row), flush=True)
        return tbps

    # 1. tiles on B=1 128k and B=32 8k, contiguous and paged
    for batch, length in ((1, 131072), (32, 8192)):
        data = _case(batch, length)
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            if time.time() - started > args.budget_s * 0.6:
                break
            for paged in (False, True):
                timed("tiles", batch, length, decode.DecodeTiles(16, block_n, warps, stages), "auto", paged, data)
        del data
        torch.cuda.empty_cache()
    # 2. splits at the heuristic's tile
    for batch, length in ((1, 8192), (1, 32768), (1, 131072), (1, 1 << 20), (8, 32768), (2, 131072)):
        if time.time() - started > args.budget_s:
            break
        data = _case(batch, length)
        for splits in ("auto", 4, 8, 16, 32, 64, 128):
            for paged in (False, True):
                timed("splits", batch, length, None, splits, paged, data)
        del data
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sweep_attention_decode.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
