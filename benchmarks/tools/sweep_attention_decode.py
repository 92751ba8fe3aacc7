"""Sweep the attention decode kernel's tiles and split counts (attention/triton/decode.py) under CUDA graphs: the
data behind attention.decode.tiles.decode_tiles and choose_num_splits.

    PYTHONPATH=src python benchmarks/tools/sweep_attention_decode.py [--kv bf16|fp8|chunk|ragged] [--budget-s 100]
        [--out DIR]

Hq=32, Hkv=8, D=128, bf16 queries, one new token, full caches. Tiles (BLOCK_N, warps, stages) at the heuristic's
split count on two cases, then split counts at the heuristic's tile for every case. TB/s = K+V bytes / replay time
(do_bench median, L2 flushed). --kv fp8: e4m3 caches (per-KV-head scales), TB/s of their bytes (1 per value;
the bf16 rows of the decode bench read 2). --kv ragged: split counts on serving decode steps of ragged lengths
(bench.decode.ragged_paged_cache, pages of 16 and 64). --kv chunk: a 512-token prefill chunk against 32k keys in
a paged (64-row pages) cache, the cache kernel's chunk tiles (BLOCK_M, BLOCK_N, warps, stages), TFLOP/s of the
visible pairs, beside the heuristic's tile and the contiguous cache's route (the dense forward).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from flashmoe_science import flash_attention_decode
from flashmoe_science.attention.decode import tiles as decode_tiles_module, triton_backend
from flashmoe_science.bench.decode import _paged_copy
from flashmoe_science.bench.report import graph_replay
from flashmoe_science.bench.report import gpu_median_ms


def _case(batch, length, fp8=False):
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, length, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_pool, v_pool, table = _paged_copy(k, v)
    if fp8:
        k, v, k_pool, v_pool = (t.div(0.5).to(torch.float8_e4m3fn) for t in (k, v, k_pool, v_pool))
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    return q, k, v, k_pool, v_pool, table, seqlens


def _tbps(batch, length, call, value_bytes=2):
    ms = gpu_median_ms(graph_replay(call))
    return 2 * batch * length * 8 * 128 * value_bytes / (ms * 1e-3) / 1e12


def chunk_sweep(args, started, results):
    """The paged cache kernel on a 512-token chunk against 32k keys: its chunk tiles, TFLOP/s."""
    lq, length = 512, 32768
    q = torch.randn(1, lq, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, length, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_pool, v_pool, table = _paged_copy(k, v)
    k_new, v_new = k[:, length - lq:].clone(), v[:, length - lq:].clone()
    cached = torch.full((1,), length - lq, dtype=torch.int32, device="cuda")
    flops = 4 * 32 * 128 * (lq * length - lq * (lq - 1) // 2)
    heuristic = triton_backend.decode_tiles
    grid = [None, *itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
    if args.short:
        grid = [None, *itertools.product((64, 128), (64, 128), (4, 8), (2, 3))]
    calls = {"contiguous-auto": lambda: flash_attention_decode(q, k, v, cached, k_new=k_new, v_new=v_new)}
    for layout, call in calls.items():
        ms = gpu_median_ms(graph_replay(call))
        results.append(dict(sweep="chunk", layout=layout, tiles=None, tflops=round(flops / ms / 1e9, 1)))
        print(json.dumps(results[-1]), flush=True)
    for tiles in grid:
        if time.time() - started > args.budget_s:
            break
        chosen = decode_tiles_module.DecodeTiles(*tiles) if tiles else None
        triton_backend.decode_tiles = (lambda problem, traits: chosen) if chosen else heuristic
        try:
            ms = gpu_median_ms(graph_replay(lambda: flash_attention_decode(q, k_pool, v_pool, cached, block_table=table,
                                                                       k_new=k_new, v_new=v_new)))
        except Exception as error:
            print(f"chunk {tiles}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        finally:
            triton_backend.decode_tiles = heuristic
        results.append(dict(sweep="chunk", layout="paged64", tiles=list(tiles) if tiles else "heuristic",
                            tflops=round(flops / ms / 1e9, 1)))
        print(json.dumps(results[-1]), flush=True)


RAGGED_CASES = ((256, 128, 640), (128, 512, 2048), (64, 1024, 4096), (32, 2048, 8192))  # (B, shortest, longest)


def ragged_sweep(args, started, results):
    """Split counts on serving decode steps of ragged lengths (pages of 16 and 64), TB/s of the keys and values the
    batch holds: whether the capacity-based split count leaves the GPU idle behind the longest sequences."""
    from flashmoe_science.bench.decode import ragged_lengths, ragged_paged_cache

    generator = torch.Generator(device="cuda").manual_seed(0)
    for batch, shortest, longest in RAGGED_CASES:
        lengths = ragged_lengths(batch, shortest, longest)
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
        for page in (16, 64):
            k_pool, v_pool, table, seqlens = ragged_paged_cache(lengths, page, "cuda", torch.bfloat16, generator)
            for splits in ("auto", 1, 2, 3, 4, 8):
                if time.time() - started > args.budget_s:
                    return
                call = lambda: flash_attention_decode(q, k_pool, v_pool, seqlens, block_table=table,  # noqa: E731
                                                      num_splits=splits)
                ms = gpu_median_ms(graph_replay(call))
                row = dict(sweep="ragged", B=batch, L_min=shortest, L=longest, page=page, splits=splits,
                           ms=round(ms, 4), tbps=round(2 * sum(lengths) * 8 * 128 * 2 / (ms * 1e-3) / 1e12, 3))
                results.append(row)
                print(json.dumps(row), flush=True)
            del k_pool, v_pool
            torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=100)
    parser.add_argument("--out", default=".")
    parser.add_argument("--kv", choices=("bf16", "fp8", "chunk", "ragged"), default="bf16")
    parser.add_argument("--short", action="store_true", help="a smaller grid (a few minutes at most)")
    args = parser.parse_args()
    started = time.time()
    heuristic = triton_backend.decode_tiles
    results = []
    fp8 = args.kv == "fp8"
    out = Path(args.out) / f"sweep_attention_decode_{args.kv}.json"
    if args.kv in ("chunk", "ragged"):
        (chunk_sweep if args.kv == "chunk" else ragged_sweep)(args, started, results)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        return
    scale = torch.full((8,), 0.5, dtype=torch.float32, device="cuda")
    scales = dict(k_scale=scale, v_scale=scale) if fp8 else {}

    def timed(label, batch, length, tiles, splits, paged, data):
        q, k, v, k_pool, v_pool, table, seqlens = data
        triton_backend.decode_tiles = (lambda problem, traits: tiles) if tiles else heuristic
        try:
            if paged:
                call = lambda: flash_attention_decode(q, k_pool, v_pool, seqlens, block_table=table,  # noqa: E731
                                                      num_splits=splits, **scales)
            else:
                call = lambda: flash_attention_decode(q, k, v, seqlens, num_splits=splits, **scales)  # noqa: E731
            tbps = _tbps(batch, length, call, 1 if fp8 else 2)
        except Exception as error:
            print(f"{label}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            return None
        finally:
            triton_backend.decode_tiles = heuristic
        row = dict(sweep=label, B=batch, L=length, paged=paged, splits=splits,
                   tiles=None if tiles is None else list(tiles.__dict__.values()), tbps=round(tbps, 3))
        results.append(row)
        print(json.dumps(row), flush=True)
        return tbps

    # 1. tiles on B=1 128k and B=32 8k, contiguous and paged
    tile_grid = list(itertools.product((64, 128, 256) if fp8 else (32, 64, 128), (2, 4, 8), (2, 3, 4)))
    if args.short:
        tile_grid = list(itertools.product((64, 128, 256) if fp8 else (64, 128), (4, 8), (2, 3)))
    cases = ((8, 32768), (1, 131072)) if fp8 else ((1, 131072), (32, 8192))
    for batch, length in cases:
        data = _case(batch, length, fp8)
        for block_n, warps, stages in tile_grid:
            if time.time() - started > args.budget_s * 0.6:
                break
            for paged in (False, True):
                timed("tiles", batch, length, decode_tiles_module.DecodeTiles(16, block_n, warps, stages), "auto", paged, data)
        del data
        torch.cuda.empty_cache()
    # 2. splits at the heuristic's tile
    split_cases = ((1, 8192), (1, 32768), (1, 131072), (1, 1 << 20), (8, 32768), (2, 131072))
    for batch, length in split_cases[:4] if args.short else split_cases:
        if time.time() - started > args.budget_s:
            break
        data = _case(batch, length, fp8)
        for splits in ("auto", 4, 8, 16, 32, 64, 128):
            for paged in (False, True):
                timed("splits", batch, length, None, splits, paged, data)
        del data
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
