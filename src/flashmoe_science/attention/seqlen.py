"""Sequence bookkeeping, one home for every attention kernel: which rows of the tensors sequence b owns, and how long
it is.

Dense batches: sequence b is batch entry b, its rows start at 0, and every sequence has the call's lengths. Packed
(varlen) batches, flash-attn's layout (`features.Varlen`): q/k/v are `(1, H, total, D)` views, sequence b owns rows
[cu_seqlens[b], cu_seqlens[b+1]) of them, a launch is sized by the longest sequence, and each program reads its own
sequence's first row and lengths.

Host side: `launch_sizes` (the sequences and lengths a launch covers); a packed batch's work lists,
`varlen_tile_offsets` (the running count of its real tiles, computed on the device) and `varlen_work_list` (its
tiles with the sequences longest first, and in decreasing causal cost), `work_list` / `ranked_work_list` (the same,
computed once per cu_seqlens tensor) and `work_items_bound` (how many programs a launch over them needs);
`VarlenBatch` (what a persistent forward reads). Kernel side, plain `triton.jit` functions that the Gluon kernels
call too: `sequence_bounds` (a sequence's first row and length), `sequence_coords` (the same as TMA coordinates) and
a work item -> its sequence, head and tile in each numbering (`tile_of_work`, `ranked_tile_of_work`,
`heaviest_tile_of_work`).

A packed batch's work items are its real tiles only, numbered sequence by sequence, head by head, a head's tiles
consecutively: a launch over them has no programs that find their sequence shorter than the longest and exit (a
grid of max_seqlen tiles per sequence idles most of its programs on a long-tailed batch). The sequences come in
the batch's order (`varlen_tile_offsets`) or longest first (`varlen_work_list`: CTAs that the hardware starts in
program-id order as SMs free up then take the heaviest first, so the last wave holds short CTAs whatever the
batch's order; a (sequence, head)'s tiles stay consecutive and increasing, which the deterministic backward's
order rule needs). A persistent kernel whose CTAs take items in a fixed order balances them when they come in
decreasing cost (`heaviest_tile_of_work`). docs/perf-notes.md has the schedule model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashmoe_science.prepared_cache import TensorMemo

# The kernel arguments that change with every packed batch: the persistent kernels take them unspecialised
# (`do_not_specialize`). Triton otherwise specialises an integer argument on divisibility by 16 (and on 1), so the
# first batch of each class compiled the kernels again: a multi-second step in a training run. The longest lengths
# change per batch too; those kernels take the packed totals in their place (hopper.bwd_common.feature_args).
PER_BATCH_ARGS = ("num_seqs",)
# The packed tensors' lengths, which the sm_90 forward takes as its lengths in a packed launch: constant over a
# training run's fixed-size batches, new with each step of a serving engine (every class of them compiled the
# forward again, 3-7 s on an H100). Its packed launches take them unspecialised too (fwd_sm90).
PACKED_TOTALS = ("seqlen_q", "seqlen_k")


def launch_sizes(q: torch.Tensor, k: torch.Tensor, varlen) -> tuple[int, int, int]:
    """(sequences, seqlen_q, seqlen_k) of a launch over 4-D q, k: the batch and the tensors' lengths, or for a packed
    batch (`varlen`: a features.Varlen, else None) the number of sequences and the longest lengths."""
    if varlen is not None:
        return varlen.num_seqs, varlen.max_seqlen_q, varlen.max_seqlen_k
    return q.shape[0], q.shape[2], k.shape[2]


@dataclass(frozen=True)
class VarlenBatch:
    """A packed batch as a persistent kernel walks it: int32 cumulative lengths (B+1,) of the queries and keys on q's
    device, and `tile_offsets`, the work list of cu_seqlens_q (`work_list`, or `ranked_work_list` with a causal
    mask: the kernel's numbering follows its mask): the work items are the real query tiles only. `band`: the
    causal list's query tiles per entry (hopper.work_items.varlen_work)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    tile_offsets: torch.Tensor
    band: int = 1

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-call tensors, in the order a prepared launch takes them after q, k, v, out, lse."""
        return self.cu_seqlens_q, self.cu_seqlens_k, self.tile_offsets

    @classmethod
    def of(cls, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, block: int, rows: int, ranked: bool,
           band: int = 1) -> "VarlenBatch":
        """A packed batch of `rows` query rows in tiles of `block` rows: its bands of `band` tiles in decreasing
        causal cost (`ranked`: ranked_work_list, for a causal mask) or its tiles in the batch's order (work_list)."""
        if not ranked:
            return cls(cu_seqlens_q, cu_seqlens_k, work_list(cu_seqlens_q, block))
        return cls(cu_seqlens_q, cu_seqlens_k, ranked_work_list(cu_seqlens_q, block * band, rows), band)


def varlen_tile_offsets(cu_seqlens_q: torch.Tensor, block_m: int) -> torch.Tensor:
    """int32 (B+1,): entry b counts the block_m-row query tiles of the sequences before b (the last entry: all of
    them). Computed on the device (no synchronisation), so the kernel numbers its work items without a host copy of
    the lengths."""
    lengths = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    offsets = torch.zeros(cu_seqlens_q.shape[0], dtype=torch.int32, device=cu_seqlens_q.device)
    torch.cumsum(torch.div(lengths + (block_m - 1), block_m, rounding_mode="floor"), 0, dtype=torch.int32,
                 out=offsets[1:])
    return offsets


# the work lists: one per (cu_seqlens tensor, tile rows[, packed rows]), while that tensor lives unwritten
_WORK_LISTS = TensorMemo()


def work_list(cu_seqlens: torch.Tensor, block: int) -> torch.Tensor:
    """varlen_tile_offsets(cu_seqlens, block), computed once per cu_seqlens tensor (a model's layers, forward and
    backward, share one per batch: the 3 small device ops run once, not once per launch)."""
    offsets = _WORK_LISTS.get((cu_seqlens,), block)
    if offsets is None:
        offsets = varlen_tile_offsets(cu_seqlens, block)
        _WORK_LISTS.put((cu_seqlens,), block, offsets)
    return offsets


def varlen_work_list(cu_seqlens: torch.Tensor, block: int, slots: int) -> torch.Tensor:
    """A packed batch's tiles with its sequences longest first, int32 (1 + 4·slots,), computed on the device in two
    launches (no synchronisation: CUDA graphs capture it): entry 0 counts the batch's tiles (per head); then a record
    of 4 per slot p < `slots` (at least the batch's tiles: `work_items_bound`), the slots numbering the tiles with the
    sequences longest first (equal lengths keep the batch's order): the sequence that holds slot p, its first slot,
    its tiles, and the slot that comes p-th in decreasing causal cost (query tile t of a sequence costs t + 1 key
    tiles; ties in slot order; slots past the tiles last). A record past the tiles holds the last sequence's and is
    never read. On the meta device: the table's shape only."""
    num_seqs = cu_seqlens.shape[0] - 1
    device = cu_seqlens.device
    order = torch.empty(max(num_seqs, 1), dtype=torch.int32, device=device)
    offsets = torch.empty(num_seqs + 1, dtype=torch.int32, device=device)
    table = torch.empty(1 + 4 * slots, dtype=torch.int32, device=device)
    if device.type == "meta":  # shapes only: offline builds, argument checks
        return table
    _rank_sequences[(max(1, triton.cdiv(num_seqs, _RANK_BLOCK)),)](cu_seqlens, order, offsets, num_seqs, block,
                                                                   BLOCK=_RANK_BLOCK)
    _slot_records[(max(1, triton.cdiv(slots, _SLOT_BLOCK)),)](order, offsets, table, num_seqs, slots,
                                                              num_seqs.bit_length(), BLOCK=_SLOT_BLOCK)
    return table


_RANK_BLOCK, _SLOT_BLOCK = 64, 256


@triton.jit(do_not_specialize=("num_seqs",))
def _rank_sequences(CU_SEQLENS, ORDER, OFFSETS, num_seqs, block, BLOCK: tl.constexpr):
    """Each sequence b's place r in the longest-first order (the sequences longer than b, and those as long before
    it) and its first slot (the tiles of the sequences placed before it): ORDER[r] = b, OFFSETS[r + 1] = its first
    slot + its tiles, OFFSETS[0] = 0. Every program compares its sequences with all of them (B² compares)."""
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = b < num_seqs
    length = tl.load(CU_SEQLENS + b + 1, mask=live, other=0) - tl.load(CU_SEQLENS + b, mask=live, other=0)
    rank = tl.zeros([BLOCK], tl.int32)
    first = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_seqs, BLOCK):
        j = start + tl.arange(0, BLOCK)
        other_live = j < num_seqs
        other = tl.load(CU_SEQLENS + j + 1, mask=other_live, other=0) - tl.load(CU_SEQLENS + j, mask=other_live,
                                                                                 other=0)
        before = (other[None, :] > length[:, None]) | ((other[None, :] == length[:, None]) & (j[None, :] < b[:, None]))
        before = before & other_live[None, :]
        rank += tl.sum(before.to(tl.int32), 1)
        first += tl.sum(tl.where(before, (other[None, :] + block - 1) // block, 0), 1)
    tl.store(ORDER + rank, b, mask=live)
    tl.store(OFFSETS + 1 + rank, first + (length + block - 1) // block, mask=live)
    tl.store(OFFSETS + b, 0, mask=b == 0)


@triton.jit(do_not_specialize=("num_seqs", "slots", "steps"))
def _slot_records(ORDER, OFFSETS, TABLE, num_seqs, slots, steps, BLOCK: tl.constexpr):
    """The records of slots p (see varlen_work_list) from _rank_sequences' order: the place r that holds p (the
    last r with OFFSETS[r] <= p, by bisection in `steps` = bit length of B rounds), and where p comes in decreasing
    causal cost: tile c - 1 of its sequence comes after the G(c) = Σ_j max(0, tiles_j - c) tiles that cost more
    (OFFSETS[m] - c·m over the m sequences of more than c tiles, a prefix of the order) and after the r tiles of
    cost c placed before it (every sequence placed before p's has at least c tiles)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < slots
    total = tl.load(OFFSETS + num_seqs)
    lo = tl.zeros([BLOCK], tl.int32)
    hi = lo + num_seqs + 1
    for _ in range(steps):
        mid = (lo + hi) // 2
        active = hi - lo > 1
        below = tl.load(OFFSETS + mid, mask=active, other=0) <= p
        lo = tl.where(active & below, mid, lo)
        hi = tl.where(active & ~below, mid, hi)
    rank = tl.maximum(tl.minimum(lo, num_seqs - 1), 0)
    first = tl.load(OFFSETS + rank, mask=live, other=0)
    tiles = tl.load(OFFSETS + rank + 1, mask=live, other=0) - first
    cost = p - first + 1
    # m: the places whose sequences hold more than `cost` tiles (tiles never increase along the order)
    m = tl.zeros([BLOCK], tl.int32)
    m_hi = m + num_seqs
    for _ in range(steps):
        mid = (m + m_hi) // 2
        active = m < m_hi
        more = (tl.load(OFFSETS + mid + 1, mask=active, other=0) - tl.load(OFFSETS + mid, mask=active, other=0)) > cost
        m = tl.where(active & more, mid + 1, m)
        m_hi = tl.where(active & ~more, mid, m_hi)
    heavier = tl.load(OFFSETS + m, mask=live & (p < total), other=0) - cost * m
    position = tl.where(p < total, heavier + rank, p)
    record = TABLE + 1 + 4 * p
    tl.store(record, tl.load(ORDER + rank, mask=live, other=0), mask=live)
    tl.store(record + 1, first, mask=live)
    tl.store(record + 2, tiles, mask=live)
    tl.store(TABLE + 4 + 4 * position, p, mask=live)
    tl.store(TABLE + p, total, mask=p == 0)


def ranked_work_list_entries(num_seqs: int, rows: int, block: int) -> int:
    """The length of ranked_work_list's table for num_seqs sequences packed in `rows` rows."""
    return 1 + 4 * work_items_bound(num_seqs, rows, rows, block)


def ranked_work_list(cu_seqlens: torch.Tensor, block: int, rows: int) -> torch.Tensor:
    """varlen_work_list of a batch packed in `rows` rows (its slots: work_items_bound's), computed once per
    cu_seqlens tensor, as work_list."""
    table = _WORK_LISTS.get((cu_seqlens,), (block, rows))
    if table is None:
        table = varlen_work_list(cu_seqlens, block, work_items_bound(cu_seqlens.shape[0] - 1, rows, rows, block))
        _WORK_LISTS.put((cu_seqlens,), (block, rows), table)
    return table


def work_items_bound(num_seqs: int, total: int, longest: int, block: int) -> int:
    """An upper bound on the block-row tiles of a packed batch (per head), known without reading its lengths:
    every sequence wastes less than one tile, and none has more than the longest's."""
    return min(num_seqs * triton.cdiv(longest, block), triton.cdiv(total, block) + num_seqs)


@triton.jit
def tile_of_work(TILE_OFFSETS, num_seqs, num_heads, work):
    """(sequence, head, tile) of work item `work` < num_heads · TILE_OFFSETS[num_seqs] (the module docstring's
    numbering, over varlen_tile_offsets' table): the sequence b with TILE_OFFSETS[b]·H <= work < TILE_OFFSETS[b+1]·H,
    found by bisection (log2 of the batch size loads, cached), which skips empty sequences. The persistent
    forward's non-causal numbering: its loads, in a loop, hold fewer registers across the CTA's items than
    ranked_tile_of_work's (the sm_90 forward's D=128 offline build: 35 LDL/STL against 66)."""
    lo = work * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(TILE_OFFSETS + mid) * num_heads <= work:
            lo = mid
        else:
            hi = mid
    first = tl.load(TILE_OFFSETS + lo)
    num_tiles = tl.load(TILE_OFFSETS + lo + 1) - first
    rest = work - first * num_heads
    return lo, rest // num_tiles, rest % num_tiles


@triton.jit
def ranked_tile_of_work(WORK_LIST, num_heads, work):
    """(sequence, head, tile, the sequence's tiles) of work item `work` < num_heads · WORK_LIST[0] over
    varlen_work_list's table: sequences longest first, head by head, a head's tiles consecutively (slot p holds
    items [p·H, p·H + H) of that numbering). Three independent loads: a bisection over the sequences
    (`tile_of_work`) takes log2 B dependent ones before a backward CTA can issue its first copy."""
    record = WORK_LIST + 1 + 4 * (work // num_heads)
    first = tl.load(record + 1)
    num_tiles = tl.load(record + 2)
    rest = work - first * num_heads
    return tl.load(record), rest // num_tiles, rest % num_tiles, num_tiles


@triton.jit
def heaviest_tile_of_work(WORK_LIST, num_heads, work):
    """(sequence, head, tile) of work item `work` < num_heads · WORK_LIST[0] over varlen_work_list's table: the
    tiles of all sequences in decreasing causal cost, the heads of a tile consecutive (work % num_heads)."""
    slot = tl.load(WORK_LIST + 4 + 4 * (work // num_heads))
    record = WORK_LIST + 1 + 4 * slot
    return tl.load(record), work % num_heads, slot - tl.load(record + 1)


@triton.jit
def sequence_bounds(CU_SEQLENS, batch, seqlen, VARLEN: tl.constexpr):
    """(first row, length) of sequence `batch`: from the cumulative lengths of a packed batch (the first row as
    int64), else (0, seqlen) with a compile-time 0 (so dense launches carry no row offset arithmetic, and Gluon
    kernels, which have no layout-free tl.zeros, can call this too)."""
    if VARLEN:
        start = tl.load(CU_SEQLENS + batch)
        seqlen = tl.load(CU_SEQLENS + batch + 1) - start
        start = start.to(tl.int64)
    else:
        start = 0
    return start, seqlen


def padded_stat_rows(total: int, num_seqs: int) -> int:
    """The rows per head of a packed batch's per-row statistics in their padded layout (`padded_row_start`): room for
    `total` rows and 3 padding rows per sequence, rounded up to a multiple of 4 so that every head's rows start
    16-byte aligned (float32)."""
    return (total + 3 * num_seqs + 3) // 4 * 4


@triton.jit
def padded_row_start(first, seq):
    """The first row of sequence `seq` (whose packed rows start at `first` = cu_seqlens[seq]) in the padded layout
    of a packed batch's per-row statistics: round_up(first + 3·seq, 4), a multiple of 4 rows: 16 bytes of float32,
    where a rank-1 TMA box must start (hopper.bwd_sm90's staged statistics).

    Why the rows fit: start(s) <= cu[s] + 3s + 3 so start(s) + len(s) <= cu[s+1] + 3(s+1) <= start(s+1); the
    starts increase and no two sequences' rows meet. The last ends by cu[B] + 3B = total + 3B, which
    `padded_stat_rows` rounds up to a multiple of 4, the rows per head: head h's rows start at h·that, aligned
    too. Rows between a sequence's end and the next start are padding (the writer fills them)."""
    return (first + 3 * seq + 3) // 4 * 4


@triton.jit
def sequence_coords(CU_SEQLENS_Q, CU_SEQLENS_K, seq, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(batch, q_first, seqlen_q, k_first, seqlen_k) of sequence `seq` as TMA coordinates: a packed batch is one
    (1, H, total rows, D) tensor whose sequences start at 32-bit row offsets; a dense batch is batch `seq` with
    offsets 0. The caller returns early where its tile lies past the sequence."""
    q_first, seqlen_q = sequence_bounds(CU_SEQLENS_Q, seq, seqlen_q, VARLEN)
    k_first, seqlen_k = sequence_bounds(CU_SEQLENS_K, seq, seqlen_k, VARLEN)
    if VARLEN:
        return 0, q_first.to(tl.int32), seqlen_q, k_first.to(tl.int32), seqlen_k
    else:
        return seq, q_first, seqlen_q, k_first, seqlen_k
