"""Which work items a persistent CTA of the sm_90 attention forward runs, and what each item covers: the item
numbering shared by the producer and the consumers (dense batches: every query tile of every head; packed batches:
only the real query tiles, numbered through a per-sequence tile count: `varlen_work`), the sequence's rows and
lengths, and the key tiles a CTA streams for a query tile (mask.key_tile_range / key_tile_bounds)."""

# no `from __future__ import annotations`: VarlenArgs' field annotations must be classes (compat.aggregate)
from flashmoe_science.attention.mask import key_tile_bounds, key_tile_range
from flashmoe_science.attention.seqlen import heaviest_tile_of_work, tile_of_work
from flashmoe_science.gluon.compat import aggregate, field, gl, gluon


@aggregate
class VarlenArgs:
    """A packed batch as the forward kernel reads it (each field None, a constexpr, in a dense launch): int32
    cumulative lengths of the queries and keys, the work list of their query tiles (seqlen.VarlenBatch), the number
    of sequences, and the output's base pointer with its head and row strides and the head dim, for
    the ragged last rows a TMA box would write past the sequence; `band`, the causal numbering's query tiles per
    band (varlen_work)."""

    cu_seqlens_q: gl.tensor | gl.constexpr
    cu_seqlens_k: gl.tensor | gl.constexpr
    tile_offsets: gl.tensor | gl.constexpr
    num_seqs: gl.tensor | gl.constexpr
    out: gl.tensor | gl.constexpr
    stride_oh: gl.tensor | gl.constexpr
    stride_om: gl.tensor | gl.constexpr
    head_dim: gl.tensor | gl.constexpr
    band: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, cu_seqlens_q, cu_seqlens_k, tile_offsets, num_seqs, out, stride_oh, stride_om, head_dim,
                 band):
        self.cu_seqlens_q = field(cu_seqlens_q)
        self.cu_seqlens_k = field(cu_seqlens_k)
        self.tile_offsets = field(tile_offsets)
        self.num_seqs = field(num_seqs)
        self.out = field(out)
        self.stride_oh = field(stride_oh)
        self.stride_om = field(stride_om)
        self.head_dim = field(head_dim)
        self.band = gl.constexpr(band)


@gluon.jit
def work_index(item, num_ctas):
    """The CTA's item-th work item in the global numbering: rounds of num_ctas consecutive items, snaking (CTA c takes
    position c, then num_ctas-1-c, ...)."""
    cta = gl.program_id(0)
    if item % 2 == 0:
        work = item * num_ctas + cta
    else:
        work = item * num_ctas + num_ctas - 1 - cta
    return work


@gluon.jit
def work_tile(item, num_ctas, num_m_tiles, num_q_heads, group_size, CTA_ROWS: gl.constexpr,
               CAUSAL: gl.constexpr):
    """The CTA's item-th work item -> (batch, query head, kv head, first query row).

    Work items are numbered head by head, a head's query tiles consecutively (heaviest first with causal
    masking). CTAs take them in rounds of num_ctas consecutive items, so the CTAs running at any moment work on
    a few heads and share their K/V in L2 (a CTA taking a contiguous run instead was 5-15% slower: every CTA
    streamed a different head). The rounds snake (CTA c takes position c, then num_ctas-1-c, ...), so with causal
    masking a CTA that drew a heavy tile in one round draws a light one in the next."""
    work = work_index(item, num_ctas)
    pid_bh = work // num_m_tiles
    pid_m = work % num_m_tiles
    if CAUSAL:
        pid_m = num_m_tiles - 1 - pid_m
    q_head = pid_bh % num_q_heads
    return pid_bh // num_q_heads, q_head, q_head // group_size, pid_m * CTA_ROWS


@gluon.jit
def varlen_work(work, TILE_OFFSETS, num_seqs, num_q_heads, CAUSAL: gl.constexpr, BAND: gl.constexpr):
    """Work item `work` of a packed (varlen) batch -> (sequence, query head, query tile or band, tile in the band).

    Without a mask as work_tile's: sequence by sequence in the batch's order, head by head, a head's query tiles
    consecutively (seqlen.tile_of_work; the band is the tile, 0 within it). Causal: bands of BAND query tiles
    (counted from a sequence's start, seqlen.ranked_work_list in units of BAND tiles) of all sequences in decreasing
    cost, the heads of a band consecutive, a band's tiles innermost (seqlen.heaviest_tile_of_work); `band_tile`
    turns (band, tile in it) into the query tile. Dealt by work_index's static snake, items in decreasing cost give
    each CTA about the same work; each head's tiles heaviest first, sequence by sequence, did not (rounds of
    num_ctas items span heads and sequences of different lengths: the schedule model in docs/perf-notes.md puts that
    order 25-50% above the ideal, this one 1-5%). A band's tiles run side by side on neighbouring CTAs and read the
    same keys, so L2 serves a band's K/V once: one tile per band reads every (sequence, head)'s K/V anew at each
    cost level, from DRAM once a batch's K/V outgrows L2."""
    if CAUSAL:
        seq, q_head, band = heaviest_tile_of_work(TILE_OFFSETS, num_q_heads, work // BAND)
        return seq, q_head, band, work % BAND
    else:
        seq, q_head, pid_m = tile_of_work(TILE_OFFSETS, num_seqs, num_q_heads, work)
        return seq, q_head, pid_m, 0


@gluon.jit
def band_tile(band, in_band, seqlen_q, CTA_ROWS: gl.constexpr, BAND: gl.constexpr):
    """The query tile of tile `in_band` of band `band` (varlen_work): bands count from the sequence's start in the
    work list (its cost order) and cover its tiles from the last one down, the heavier first within a band; the
    first tile stands in for the tiles a sequence lacks below it (its cheapest: computed twice, stored twice alike)."""
    if BAND == 1:
        return band
    else:
        num_tiles = gl.cdiv(seqlen_q, CTA_ROWS)
        num_bands = gl.cdiv(seqlen_q, BAND * CTA_ROWS)
        return gl.maximum(num_tiles - 1 - BAND * (num_bands - 1 - band) - in_band, 0)


@gluon.jit
def item_rows(item, num_ctas, num_m_tiles, num_q_heads, group_size, seqlen_q, seqlen_k, varlen_args,
          CTA_ROWS: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr):
    """The CTA's item-th work item -> (batch, TMA batch coordinate, query head, kv head, first query row of the tile
    within its sequence, first Q row and first K row of the sequence in the TMA row coordinate, Lq, Lk).

    Dense: the sequence is the batch entry (rows from 0). Varlen: q/k are (1, H, total, D) views of the packed
    tensors, sequence b spans rows cu_seqlens[b]..cu_seqlens[b+1], and the per-sequence lengths replace the
    kernel's (see varlen_work for the numbering)."""
    if VARLEN:
        batch, q_head, band, in_band = varlen_work(work_index(item, num_ctas), varlen_args.tile_offsets,
                                                   varlen_args.num_seqs, num_q_heads, CAUSAL, varlen_args.band)
        q_row0 = gl.load(varlen_args.cu_seqlens_q + batch)
        k_row0 = gl.load(varlen_args.cu_seqlens_k + batch)
        seqlen_q = gl.load(varlen_args.cu_seqlens_q + batch + 1) - q_row0
        seqlen_k = gl.load(varlen_args.cu_seqlens_k + batch + 1) - k_row0
        pid_m = band_tile(band, in_band, seqlen_q, CTA_ROWS, varlen_args.band)
        desc_batch = 0
        kv_head = q_head // group_size
        start_m = pid_m * CTA_ROWS
    else:
        batch, q_head, kv_head, start_m = work_tile(item, num_ctas, num_m_tiles, num_q_heads, group_size, CTA_ROWS,
                                                     CAUSAL)
        desc_batch = batch
        q_row0 = 0
        k_row0 = 0
    return batch, desc_batch, q_head, kv_head, start_m, q_row0, k_row0, seqlen_q, seqlen_k


@gluon.jit
def cta_num_items(num_work):
    """How many work items this CTA runs: one per full round, plus one if its position in the last round exists."""
    num_ctas = gl.num_programs(0)
    cta = gl.program_id(0)
    rounds = num_work // num_ctas
    if rounds % 2 == 0:
        position = cta
    else:
        position = num_ctas - 1 - cta
    return rounds + (position < num_work % num_ctas).to(gl.int32)


@gluon.jit
def cta_key_tiles(start_m, seqlen_q, seqlen_k, window_left, window_right, CTA_ROWS: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """Key tiles a CTA streams for the query tile at `start_m`: (first key, number of BLOCK_N tiles), those its rows
    see (mask.key_tile_range; mask.key_tile_bounds for the plain causal mask). At least one, so no wait is left on
    a copy that was never issued; a tile no row can see is fully masked and leaves l = 0 (zeros out, lse -inf)."""
    if MASK_LEFT or MASK_RIGHT:
        key_start, _, _, key_end = key_tile_range(start_m, seqlen_q, seqlen_k, window_left, window_right, CTA_ROWS,
                                                  BLOCK_N, MASK_LEFT, MASK_RIGHT)
        num_tiles = gl.maximum(gl.cdiv(key_end - key_start, BLOCK_N), 1)
    else:
        _, key_end = key_tile_bounds(start_m, seqlen_k, seqlen_k - seqlen_q, CTA_ROWS, BLOCK_N, CAUSAL)
        key_start = 0
        num_tiles = gl.maximum(gl.cdiv(key_end, BLOCK_N), 1)
    return key_start, num_tiles
