"""GPU counting sort of the T·k (token, expert) pairs by expert, padded to the GEMM row tile.

Pair ``p = t * top_k + j`` is slot j of token t. Three launches, no host synchronisation (every size comes
from tensor shapes):

1. ``_count_chunks``: the pairs are cut into chunks; each program counts its chunk's pairs per expert.
2. ``_scan_counts`` (one program): per-expert totals, each expert's rows padded up to a multiple of
   ``block_m`` and laid out one after another; the exclusive scan over chunks gives every (chunk, expert)
   its first output row; and the map from row tile to expert.
3. ``_scatter_pairs``: each pair's row = its (chunk, expert) base + its rank among the earlier pairs of the
   same expert in its chunk, so the sort is stable (pairs of one expert stay in token order) and deterministic.

Rows are grouped in tiles of ``block_m``: tile i covers sorted rows ``[i*block_m, (i+1)*block_m)`` and belongs
to one expert, so a GEMM program reads its expert once and needs no per-row expert lookup.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashmoe_science.moe.launch import Launch


class ExpertSort(NamedTuple):
    sorted_pair_ids: torch.Tensor  # (num_tiles_max * block_m,) int32 pair ids by expert; padding rows = num_pairs
    pair_row: torch.Tensor  # (num_pairs,) int32 the sorted row of each pair, -1 for a dropped slot
    tile_expert: torch.Tensor  # (num_tiles_max,) int32 expert of each row tile, -1 past the last used tile
    expert_counts: torch.Tensor  # (E,) int32 pairs per expert
    expert_row_start: torch.Tensor  # (E,) int32 first sorted row of each expert (a multiple of block_m)
    block_m: int
    top_k: int
    num_pairs: int


def max_row_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    # sum_e ceil(c_e / block_m) <= floor(num_pairs / block_m) + (number of experts with a partial tile)
    return num_pairs // block_m + min(num_experts, num_pairs)


@triton.jit
def _count_chunks(ids_ptr, chunk_counts_ptr, num_pairs, num_experts, CHUNK: tl.constexpr, E_POW2: tl.constexpr):
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    experts = tl.arange(0, E_POW2)
    counts = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + chunk * num_experts + experts, counts, mask=experts < num_experts)


@triton.jit
def _scan_counts(
    chunk_counts_ptr,
    chunk_row_base_ptr,
    expert_counts_ptr,
    expert_row_start_ptr,
    tile_expert_ptr,
    num_chunks,
    num_experts,
    num_tiles_max,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK_BLOCK: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
):
    experts = tl.arange(0, E_POW2)
    expert_mask = experts < num_experts

    totals = tl.zeros([E_POW2], dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNK_BLOCK):
        chunks = c0 + tl.arange(0, CHUNK_BLOCK)
        mask = (chunks < num_chunks)[:, None] & expert_mask[None, :]
        counts = tl.load(chunk_counts_ptr + chunks[:, None] * num_experts + experts[None, :], mask=mask, other=0)
        totals += tl.sum(counts, axis=0)

    tiles = (totals + BLOCK_M - 1) // BLOCK_M
    tile_start = tl.cumsum(tiles, axis=0) - tiles
    row_start = tile_start * BLOCK_M
    tl.store(expert_counts_ptr + experts, totals, mask=expert_mask)
    tl.store(expert_row_start_ptr + experts, row_start, mask=expert_mask)

    # first row of each (chunk, expert): the expert's start plus the pairs of that expert in earlier chunks
    running = row_start
    for c0 in range(0, num_chunks, CHUNK_BLOCK):
        chunks = c0 + tl.arange(0, CHUNK_BLOCK)
        mask = (chunks < num_chunks)[:, None] & expert_mask[None, :]
        offsets = chunks[:, None] * num_experts + experts[None, :]
        counts = tl.load(chunk_counts_ptr + offsets, mask=mask, other=0)
        tl.store(chunk_row_base_ptr + offsets, running[None, :] + tl.cumsum(counts, axis=0) - counts, mask=mask)
        running += tl.sum(counts, axis=0)

    # tile t belongs to the last expert whose first tile is <= t (experts without tiles share their
    # successor's start and lose the tie to it)
    num_tiles = tl.sum(tiles, axis=0)
    for t0 in range(0, num_tiles_max, TILE_BLOCK):
        tile_ids = t0 + tl.arange(0, TILE_BLOCK)
        owners = tl.sum(((tile_start[None, :] <= tile_ids[:, None]) & expert_mask[None, :]).to(tl.int32), axis=1) - 1
        owners = tl.where(tile_ids < num_tiles, owners, -1)
        tl.store(tile_expert_ptr + tile_ids, owners, mask=tile_ids < num_tiles_max)


@triton.jit
def _scatter_pairs(
    ids_ptr,
    chunk_row_base_ptr,
    sorted_pair_ids_ptr,
    pair_row_ptr,
    num_pairs,
    num_experts,
    CHUNK: tl.constexpr,
):
    chunk = tl.program_id(0)
    lanes = tl.arange(0, CHUNK)
    pairs = chunk * CHUNK + lanes
    in_range = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=in_range, other=-1).to(tl.int32)
    routed = in_range & (ids >= 0) & (ids < num_experts)
    # rank among the earlier pairs of this chunk that chose the same expert: keeps the sort stable
    earlier_same = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    base = tl.load(chunk_row_base_ptr + chunk * num_experts + ids, mask=routed, other=0)
    row = base + rank
    tl.store(sorted_pair_ids_ptr + row, pairs, mask=routed)
    tl.store(pair_row_ptr + pairs, tl.where(routed, row, -1), mask=in_range)


def flat_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """The (T·k,) pair ids in pair order: a view of ``topk_ids``, or a small copy where it is not contiguous."""
    ids = topk_ids.reshape(-1)
    return ids if ids.is_contiguous() else ids.contiguous()


@functools.lru_cache(maxsize=1024)
def _sort_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int, int, int]:
    """(E_POW2, CHUNK, chunks, row tiles at most) of a sort. Cached: it runs on every call, and triton.cdiv and
    next_power_of_2 cost ~2 µs each on the host (constexpr functions)."""
    e_pow2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(128, 16384 // e_pow2))  # chunk x E one-hot and chunk x chunk rank tiles of <= ~16K elements
    return e_pow2, chunk, triton.cdiv(num_pairs, chunk), max_row_tiles(num_pairs, num_experts, block_m)


def sort_buffers(num_tokens: int, top_k: int, num_experts: int, block_m: int, device):
    """The sort's outputs, as an ExpertSort for ``sort_launches`` to fill, and its two (chunks, E) int32 scratch
    arrays (per-chunk counts, per-chunk first rows). Every size follows from the arguments: none from the ids."""
    num_pairs = num_tokens * top_k
    _, _, num_chunks, num_tiles_max = _sort_sizes(num_pairs, num_experts, block_m)
    sort = ExpertSort(
        torch.full((num_tiles_max * block_m,), num_pairs, dtype=torch.int32, device=device),  # padding rows
        torch.empty(num_pairs, dtype=torch.int32, device=device),
        torch.empty(num_tiles_max, dtype=torch.int32, device=device),
        torch.empty(num_experts, dtype=torch.int32, device=device),
        torch.empty(num_experts, dtype=torch.int32, device=device),
        block_m, top_k, num_pairs,
    )
    chunk_counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)
    return sort, chunk_counts, torch.empty_like(chunk_counts)


def sort_launches(ids: torch.Tensor, sort: ExpertSort, chunk_counts: torch.Tensor,
                  chunk_row_base: torch.Tensor) -> tuple[Launch, Launch, Launch]:
    """The count, scan and scatter launches that fill ``sort`` (from ``sort_buffers``) from the flat ``ids``."""
    num_chunks, num_experts = chunk_counts.shape
    e_pow2, chunk, _, num_tiles_max = _sort_sizes(sort.num_pairs, num_experts, sort.block_m)
    block = max(1, min(64, 8192 // e_pow2))
    count = Launch(_count_chunks, (num_chunks,), (ids, chunk_counts, sort.num_pairs, num_experts),
                   dict(CHUNK=chunk, E_POW2=e_pow2))
    scan = Launch(_scan_counts, (1,),
                  (chunk_counts, chunk_row_base, sort.expert_counts, sort.expert_row_start, sort.tile_expert,
                   num_chunks, num_experts, num_tiles_max),
                  dict(BLOCK_M=sort.block_m, E_POW2=e_pow2, CHUNK_BLOCK=block, TILE_BLOCK=block, num_warps=4))
    scatter = Launch(_scatter_pairs, (num_chunks,),
                     (ids, chunk_row_base, sort.sorted_pair_ids, sort.pair_row, sort.num_pairs, num_experts),
                     dict(CHUNK=chunk))
    return count, scan, scatter


def sort_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertSort:
    """Counting sort of ``topk_ids`` (T, k) by expert; ids outside [0, E) are dropped (their pair_row is -1)."""
    num_tokens, top_k = topk_ids.shape
    sort, chunk_counts, chunk_row_base = sort_buffers(num_tokens, top_k, num_experts, block_m, topk_ids.device)
    if sort.num_pairs == 0:
        sort.expert_counts.zero_()
        sort.expert_row_start.zero_()
        return sort
    for launch in sort_launches(flat_ids(topk_ids), sort, chunk_counts, chunk_row_base):
        launch()
    return sort
