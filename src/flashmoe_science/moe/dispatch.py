"""GPU counting sort of the T·k (token, expert) pairs by expert, padded to the GEMM row tile.

Pair ``p = t * top_k + j`` is slot j of token t. Three launches, no host synchronisation (every size comes
from tensor shapes):

1. ``_count_chunks``: the pairs are cut into chunks; each program counts its chunk's pairs per expert.
2. ``_scan_counts`` (one program): per-expert totals, each expert's rows padded up to a multiple of
   ``block_m`` and laid out one after another; the exclusive scan over chunks gives every (chunk, expert)
   its first output row; and the map from row tile to expert.
3. ``_scatter_pairs``: each pair's row = its (chunk, expert) base + its rank among the earlier pairs of the
   same expert in its chunk, so the sort is stable (pairs of one expert stay in token order) and deterministic.

When all pairs fit one chunk (decode: T·k <= 128 at E <= 128), ``_sort_one_chunk`` does the three steps in one
program and launch, padding rows included: on few tokens each launch costs more than its work.

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
def _chunk_ids(ids_ptr, chunk, num_pairs, CHUNK: tl.constexpr):
    """A chunk's lanes, pair ids, and their expert ids (-1 past the last pair)."""
    lanes = tl.arange(0, CHUNK)
    pairs = chunk * CHUNK + lanes
    return lanes, pairs, tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)


@triton.jit
def _expert_histogram(ids, experts):
    return tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)


@triton.jit
def _expert_tiles(totals, BLOCK_M: tl.constexpr):
    """Each expert's row tiles (its pairs padded up to BLOCK_M) and its first tile, laid out expert after expert."""
    tiles = (totals + BLOCK_M - 1) // BLOCK_M
    return tiles, tl.cumsum(tiles, axis=0) - tiles


@triton.jit
def _store_tile_experts(tile_expert_ptr, tiles, tile_start, expert_mask, num_tiles_max, TILE_BLOCK: tl.constexpr):
    # tile t belongs to the last expert whose first tile is <= t (experts without tiles share their
    # successor's start and lose the tie to it)
    num_tiles = tl.sum(tiles, axis=0)
    for t0 in range(0, num_tiles_max, TILE_BLOCK):
        tile_ids = t0 + tl.arange(0, TILE_BLOCK)
        owners = tl.sum(((tile_start[None, :] <= tile_ids[:, None]) & expert_mask[None, :]).to(tl.int32), axis=1) - 1
        owners = tl.where(tile_ids < num_tiles, owners, -1)
        tl.store(tile_expert_ptr + tile_ids, owners, mask=tile_ids < num_tiles_max)


@triton.jit
def _store_pair_rows(ids, lanes, pairs, row_base, sorted_pair_ids_ptr, pair_row_ptr, num_pairs, num_experts):
    """Each pair's sorted row = its expert's base row + its rank among the earlier pairs of the chunk that chose the
    same expert (keeps the sort stable); dropped slots get row -1."""
    in_range = pairs < num_pairs
    routed = in_range & (ids >= 0) & (ids < num_experts)
    earlier_same = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
    row = row_base + tl.sum(earlier_same.to(tl.int32), axis=1)
    tl.store(sorted_pair_ids_ptr + row, pairs, mask=routed)
    tl.store(pair_row_ptr + pairs, tl.where(routed, row, -1), mask=in_range)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_chunks(ids_ptr, chunk_counts_ptr, num_pairs, num_experts, CHUNK: tl.constexpr, E_POW2: tl.constexpr):
    chunk = tl.program_id(0)
    _, _, ids = _chunk_ids(ids_ptr, chunk, num_pairs, CHUNK)
    experts = tl.arange(0, E_POW2)
    tl.store(chunk_counts_ptr + chunk * num_experts + experts, _expert_histogram(ids, experts),
             mask=experts < num_experts)


@triton.jit(do_not_specialize=["num_chunks", "num_tiles_max"])
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

    tiles, tile_start = _expert_tiles(totals, BLOCK_M)
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

    _store_tile_experts(tile_expert_ptr, tiles, tile_start, expert_mask, num_tiles_max, TILE_BLOCK)


@triton.jit(do_not_specialize=["num_pairs"])
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
    lanes, pairs, ids = _chunk_ids(ids_ptr, chunk, num_pairs, CHUNK)
    routed = (pairs < num_pairs) & (ids >= 0) & (ids < num_experts)
    base = tl.load(chunk_row_base_ptr + chunk * num_experts + ids, mask=routed, other=0)
    _store_pair_rows(ids, lanes, pairs, base, sorted_pair_ids_ptr, pair_row_ptr, num_pairs, num_experts)


@triton.jit(do_not_specialize=["num_pairs", "num_rows", "num_tiles_max"])
def _sort_one_chunk(
    ids_ptr,
    sorted_pair_ids_ptr,
    pair_row_ptr,
    tile_expert_ptr,
    expert_counts_ptr,
    expert_row_start_ptr,
    num_pairs,
    num_experts,
    num_rows,
    num_tiles_max,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    E_POW2: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
    FILL_BLOCK: tl.constexpr,
):
    """The count, scan and scatter of one chunk holding every pair, and the padding rows' fill, in one program."""
    experts = tl.arange(0, E_POW2)
    expert_mask = experts < num_experts
    lanes, pairs, ids = _chunk_ids(ids_ptr, 0, num_pairs, CHUNK)
    totals = tl.where(expert_mask, _expert_histogram(ids, experts), 0)  # (ids in [E, E_POW2) are dropped slots)
    tiles, tile_start = _expert_tiles(totals, BLOCK_M)
    row_start = tile_start * BLOCK_M
    tl.store(expert_counts_ptr + experts, totals, mask=expert_mask)
    tl.store(expert_row_start_ptr + experts, row_start, mask=expert_mask)
    _store_tile_experts(tile_expert_ptr, tiles, tile_start, expert_mask, num_tiles_max, TILE_BLOCK)
    for r0 in range(0, num_rows, FILL_BLOCK):  # every row starts as padding ...
        rows = r0 + tl.arange(0, FILL_BLOCK)
        tl.store(sorted_pair_ids_ptr + rows, tl.full([FILL_BLOCK], num_pairs, tl.int32), mask=rows < num_rows)
    tl.debug_barrier()  # ... before the pairs' rows overwrite it (threads of this program store both)
    row_base = tl.sum(tl.where(ids[:, None] == experts[None, :], row_start[None, :], 0), axis=1)
    _store_pair_rows(ids, lanes, pairs, row_base, sorted_pair_ids_ptr, pair_row_ptr, num_pairs, num_experts)


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
    arrays (per-chunk counts, per-chunk first rows; None when one chunk holds every pair). Every size follows from
    the arguments: none from the ids."""
    num_pairs = num_tokens * top_k
    _, _, num_chunks, num_tiles_max = _sort_sizes(num_pairs, num_experts, block_m)
    one_chunk = num_chunks <= 1
    num_rows = num_tiles_max * block_m
    sort = ExpertSort(
        # padding rows hold num_pairs (the one-chunk kernel writes them itself)
        torch.empty(num_rows, dtype=torch.int32, device=device) if one_chunk
        else torch.full((num_rows,), num_pairs, dtype=torch.int32, device=device),
        torch.empty(num_pairs, dtype=torch.int32, device=device),
        torch.empty(num_tiles_max, dtype=torch.int32, device=device),
        torch.empty(num_experts, dtype=torch.int32, device=device),
        torch.empty(num_experts, dtype=torch.int32, device=device),
        block_m, top_k, num_pairs,
    )
    if one_chunk:
        return sort, None, None
    chunk_counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)
    return sort, chunk_counts, torch.empty_like(chunk_counts)


def sort_launch_tensors(ids: torch.Tensor, sort: ExpertSort, chunk_counts: torch.Tensor | None,
                        chunk_row_base: torch.Tensor | None) -> tuple[tuple[torch.Tensor, ...], ...]:
    """The tensor arguments of each of ``sort_launches``' launches, in order (what a PreparedLaunch of each takes)."""
    if chunk_counts is None:
        return ((ids, sort.sorted_pair_ids, sort.pair_row, sort.tile_expert, sort.expert_counts,
                 sort.expert_row_start),)
    return ((ids, chunk_counts),
            (chunk_counts, chunk_row_base, sort.expert_counts, sort.expert_row_start, sort.tile_expert),
            (ids, chunk_row_base, sort.sorted_pair_ids, sort.pair_row))


def sort_launches(ids: torch.Tensor, sort: ExpertSort, chunk_counts: torch.Tensor | None,
                  chunk_row_base: torch.Tensor | None) -> tuple[Launch, ...]:
    """The launches that fill ``sort`` (from ``sort_buffers``) from the flat ``ids``: count, scan and scatter, or
    ``_sort_one_chunk`` alone where ``sort_buffers`` gave no chunk arrays."""
    num_experts = sort.expert_counts.numel()
    e_pow2, chunk, num_chunks, num_tiles_max = _sort_sizes(sort.num_pairs, num_experts, sort.block_m)
    block = max(1, min(64, 8192 // e_pow2))
    tensors = sort_launch_tensors(ids, sort, chunk_counts, chunk_row_base)
    if chunk_counts is None:
        # the chunk shrinks to the pairs there are: its (chunk x E) one-hot and (chunk x chunk) rank tiles are the
        # kernel's work (one program: 8.5 µs at the full 128-pair chunk for 8 pairs, Qwen3 T=1)
        one_chunk = max(16, triton.next_power_of_2(sort.num_pairs))
        return (Launch(_sort_one_chunk, (1,), (*tensors[0], sort.num_pairs, num_experts,
                                               sort.sorted_pair_ids.numel(), num_tiles_max),
                       dict(BLOCK_M=sort.block_m, CHUNK=one_chunk, E_POW2=e_pow2, TILE_BLOCK=block,
                            FILL_BLOCK=1024, num_warps=4 if one_chunk * e_pow2 <= 4096 else 8)),)
    count_tensors, scan_tensors, scatter_tensors = tensors
    count = Launch(_count_chunks, (num_chunks,), (*count_tensors, sort.num_pairs, num_experts),
                   dict(CHUNK=chunk, E_POW2=e_pow2))
    scan = Launch(_scan_counts, (1,), (*scan_tensors, num_chunks, num_experts, num_tiles_max),
                  dict(BLOCK_M=sort.block_m, E_POW2=e_pow2, CHUNK_BLOCK=block, TILE_BLOCK=block, num_warps=4))
    scatter = Launch(_scatter_pairs, (num_chunks,), (*scatter_tensors, sort.num_pairs, num_experts),
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
