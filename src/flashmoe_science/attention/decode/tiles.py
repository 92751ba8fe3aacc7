"""The cache kernel's heuristics: its row and key tiles (`decode_tiles`) and the number of key splits per sequence
(`choose_num_splits`), from shapes only (CUDA-graph safe), measured on the H200 (benchmarks/tools/
sweep_attention_decode.py, docs/perf-notes.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashmoe_science.attention.decode.problem import DecodeProblem
from flashmoe_science.attention.tiles import forward_tiles

DECODE_ROWS = 64  # row tiles up to this many (token, head) rows read the cache once per KV head: the decode tiles
MAX_SPLITS = 128
MIN_KEYS_PER_SPLIT = 512  # below this a split's fixed cost (partial write, combine) outweighs its parallelism
LONG_SPLIT_KEYS = 2048  # splits this long hide their fixed cost: then two CTAs per SM pay off


@dataclass(frozen=True)
class DecodeTiles:
    block_m: int  # rows ((token, query head) pairs) per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def decode_tiles(problem: DecodeProblem, traits) -> DecodeTiles:
    """Up to DECODE_ROWS rows (a decode step's GQA group x new tokens, padded to the 16 rows of an MMA): one row tile,
    so each KV head's cache is read once. Key tile and pipeline measured on the H200
    (benchmarks/tools/sweep_attention_decode.py, docs/perf-notes.md): 64 keys, 4 warps, 3 stages led at B=1 128k for
    both layouts (3.80 / 3.46 TB/s before the paged prefetch; 32-key and 8-warp tiles down to 2.4). More rows (a
    prefill chunk): compute-bound like the dense forward, so the dense forward's tiles (`tiles.forward_tiles`)."""
    rows = problem.group * problem.seqlen_q
    if traits.capability == (0, 0):  # the interpreter: small tiles exercise the tile boundaries
        return DecodeTiles(min(64, max(16, 1 << (rows - 1).bit_length())), 16, 1, 1)
    if rows > DECODE_ROWS:
        tiles = forward_tiles(problem.head_dim, problem.dtype, problem.mask.causal, traits)
        # Above D=128 the gathered rows' bookkeeping does not fit beside a 64-key tile: the offline build for the
        # H200 (tests/attention/test_decode_build.py's compile) of the 128x64 tile spilled 136 LDL/STL (triton 3.9),
        # the 128x32 one 0-16 (not timed yet).
        block_n = min(tiles.block_n, 32) if problem.head_dim > 128 else tiles.block_n
        return DecodeTiles(tiles.block_m, block_n, tiles.num_warps, tiles.num_stages)
    block_n = 64 if problem.head_dim <= 128 else 32
    # An e4m3 key is half a bf16 key's bytes: twice the keys keep a tile's (and a pipeline stage's) bytes, which is
    # what the bf16 tile was measured for. Not measured for e4m3 yet: the sweep's --kv fp8 mode times the others.
    # A paged tile stays within one page (its one-table-entry prefetch), so page 64 keeps 64-key e4m3 tiles.
    wide = block_n * _key_bytes_factor(problem)
    block_n = wide if not problem.paged or problem.block_size % wide == 0 else block_n
    return DecodeTiles(max(16, 1 << (rows - 1).bit_length()), block_n, 4, 3)


def _key_bytes_factor(problem: DecodeProblem) -> int:
    """How many keys of this cache hold the bytes of one bf16 key (the unit the decode heuristics were measured in):
    2 for an e4m3 cache, else 1."""
    return 2 if problem.fp8 else 1


def choose_num_splits(problem: DecodeProblem, tiles: DecodeTiles, sm_count: int) -> int:
    """Splits of each sequence's keys, from shapes only (CUDA-graph safe), measured on the H200
    (benchmarks/tools/sweep_attention_decode.py, docs/perf-notes.md). batch x KV heads x row tiles programs exist already;
    splits fill the GPU up to a whole number of CTAs per SM and never past it (a few CTAs over a full wave cost a
    whole extra round: at B=2, 128k, 17 splits ran at 3.6 TB/s, 16 at 4.1). Two CTAs per SM where each split still
    gets >= LONG_SPLIT_KEYS keys of the cache's capacity (B=1 1M: 33 splits 4.45, 16 splits 4.28; B=1 128k paged:
    33 splits 3.77, 16 splits 3.34), else one (B=1 32k contiguous: 16 splits 2.67, 33 splits 2.59); never fewer
    than MIN_KEYS_PER_SPLIT keys per split. Key counts are bf16 keys' bytes (an e4m3 cache's thresholds are twice the
    keys)."""
    programs = problem.batch * problem.num_kv_heads * math.ceil(problem.group * problem.seqlen_q / tiles.block_m)
    splits = max(1, 2 * sm_count // programs)
    per_key = _key_bytes_factor(problem)  # the thresholds are bytes: an e4m3 split needs twice the keys
    if problem.capacity < splits * LONG_SPLIT_KEYS * per_key:
        splits = max(1, sm_count // programs)
    return max(1, min(splits, problem.capacity // (MIN_KEYS_PER_SPLIT * per_key), MAX_SPLITS))

