"""Tile shapes and schedule of the Gluon sm_90 attention kernels: the heuristics behind the Hopper backend's plan.

The forward runs 64 query rows per consumer warpgroup beside a producer warp: two consumers (128 rows), three at
head dims to 64 (192 rows, `sm90_forward_consumers`); what varies per call is the consumers, the key tile and the
ring depth (`sm90_forward_tiles`), persistent CTAs or one CTA per query tile (`sm90_persistent`; for a
band mask `sm90_band_schedule`), Q buffers per consumer (`sm90_q_buffers`) and whether consecutive work items
overlap (`sm90_cross_item`). The backward's rules: where it beats the Triton backward (`sm90_backward_wins`) and its
query rows per tile at each head dim (`sm90_backward_rows`).
Every threshold was measured on an H200 (docs/perf-notes.md).

The length the rules read is the keys a work item streams: for dense and causal self-attention that is Lq (the
heaviest query tile sees every key), for a band (a window bounded on both sides, narrower than the sequence) it is
the window's span, whatever L: a causal 4096 window at L=128k streams 33 key tiles per query tile, the work of a
dense L=4096 item (`sm90_plan_length`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from flashmoe_science.attention.mask import MaskSpec
from flashmoe_science.attention.tiles import AttentionTiles, padded_head_dim
from flashmoe_science.device import DeviceTraits

# Measured on an H200 (docs/perf-notes.md): below these lengths the choices flip.
SM90_SHORT_CAUSAL_LEN = 1024  # causal, Lq <= this: 64-key tiles for sm_90
SM90_PERSISTENT_MAX_CAUSAL_LEN = 4096  # causal, Lq <= this: persistent CTAs
SM90_PERSISTENT_LONG_CAUSAL_LEN = 8192  # causal, Lq <= this: persistent CTAs where each runs enough items
SM90_PERSISTENT_MIN_ROUNDS = 12  # ... at least this many work items per CTA
# The time a query tile's prologue (Q load, first K/V tiles) and epilogue cost where nothing overlaps them (one CTA
# per tile), in key rows streamed: the middle of the ~90 and ~290 keys' time per item that persistent CTAs saved at
# L=512 and L=2048 (D=128, non-causal, H200: docs/perf-notes.md).
SM90_ITEM_SETUP_KEYS = 192


def sm90_plan_length(seqlen_q: int, mask: MaskSpec) -> int:
    """The length the sm_90 rules are keyed on: the keys a query row sees at most. Lq for dense and causal calls
    (what the thresholds were measured at, self-attention); for a band (`mask` bounded on both sides) its span
    window_left + 1 + window_right where that is shorter: a band's work items are bounded by the window, not by L."""
    if mask.bounded_left and mask.bounded_right:
        return min(seqlen_q, mask.window_left + 1 + mask.window_right)
    return seqlen_q


def sm90_persistent(causal: bool, seqlen_q: int, num_work: int, sm_count: int) -> bool:
    """Whether the query tiles run on persistent CTAs (one per SM, static snaking rounds over the num_work query
    tiles), which hide each tile's prologue (Q load, first K/V tiles) and epilogue behind the neighbouring tiles;
    else one CTA per tile. With causal masking their fixed shares of unequal items are balanced only roughly, the
    worse the fewer items a CTA runs and the longer the heaviest; where that costs more than the prologues, one CTA
    per tile, balanced by the hardware scheduler, wins. So every non-causal call runs persistent, and causal rows
    to SM90_PERSISTENT_MAX_CAUSAL_LEN, or to SM90_PERSISTENT_LONG_CAUSAL_LEN where each CTA runs at least
    SM90_PERSISTENT_MIN_ROUNDS items (measured on the H200 at L=8192 and 16384: docs/perf-notes.md)."""
    if not causal or seqlen_q <= SM90_PERSISTENT_MAX_CAUSAL_LEN:
        return True
    return seqlen_q <= SM90_PERSISTENT_LONG_CAUSAL_LEN and num_work >= SM90_PERSISTENT_MIN_ROUNDS * sm_count


@dataclass(frozen=True)
class BandSchedule:
    """How the query tiles of a band share the SMs, as estimated by `sm90_band_schedule`: the key rows a full work
    item streams, and the busy fraction of the SMs (mean work per SM over the time of the busiest) in static
    persistent rounds and with one CTA per query tile."""

    item_keys: int
    static: float
    per_tile: float

    @property
    def persistent(self) -> bool:
        return self.static >= self.per_tile


def sm90_band_schedule(tiles: AttentionTiles, mask: MaskSpec, seqlen_q: int, seqlen_k: int, batch_heads: int,
                       sm_count: int) -> BandSchedule | None:
    """Persistent rounds or one CTA per tile for a band (a window bounded on both sides, narrower than Lq); None for
    any other mask (`sm90_persistent` decides).

    A band's query tiles are nearly equal: each streams its rows' span, the left edge rounded out to a key tile,
    plus the tile's own 128 rows, but for the tiles whose window the sequence's ends clip. Static rounds
    (work_items.work_index: CTA c takes position c of each round of SM-count items, snaking) give every CTA a fixed
    share in an order that pairs the clipped tiles with nothing (the snaking order pairs a causal call's heavy and
    light tiles, not a band's few light ones): the busiest CTA's share, computed here item by item, sets the time,
    plus the first item's prologue, which nothing hides. One CTA per tile is balanced by the hardware (the last
    SM finishes about half an item after the mean) but pays every item's prologue and epilogue
    (`SM90_ITEM_SETUP_KEYS`). Persistent where the static rounds are the shorter (docs/perf-notes.md works a causal
    4096 window at L=32k and 128k)."""
    span = sm90_plan_length(seqlen_q, mask)
    if not (mask.bounded_left and mask.bounded_right) or span >= seqlen_q:
        return None
    return _band_schedule(tiles.block_m, tiles.block_n, mask.window_left, mask.window_right, seqlen_q, seqlen_k,
                          batch_heads, sm_count)


@functools.lru_cache(maxsize=256)
def _band_schedule(block_m: int, block_n: int, window_left: int, window_right: int, seqlen_q: int, seqlen_k: int,
                   batch_heads: int, sm_count: int) -> BandSchedule:
    # the key tiles of every query tile of one (batch, head): mask.key_tile_range's [key_start, key_end)
    rows = torch.arange(0, seqlen_q, block_m, dtype=torch.int64) + (seqlen_k - seqlen_q)
    last = torch.clamp(rows + block_m, max=seqlen_k) - 1
    key_start = torch.clamp(rows - window_left, min=0) // block_n * block_n
    key_end = torch.clamp(last + window_right + 1, min=0, max=seqlen_k)
    keys = (torch.clamp(key_end - key_start, min=1) + block_n - 1) // block_n * block_n
    work = keys.repeat(batch_heads)  # head by head, each head's tiles in order (no causal reversal)
    rounds, position = torch.arange(work.numel()).div(sm_count, rounding_mode="floor"), torch.arange(
        work.numel()) % sm_count
    cta = torch.where(rounds % 2 == 0, position, sm_count - 1 - position)
    busiest = float(torch.bincount(cta, weights=work.double(), minlength=sm_count).max())
    item_keys = int(keys.max())
    mean = float(work.sum()) / sm_count
    static = busiest + SM90_ITEM_SETUP_KEYS
    per_tile = max(mean + item_keys / 2, item_keys) * (item_keys + SM90_ITEM_SETUP_KEYS) / item_keys
    return BandSchedule(item_keys, mean / static, mean / per_tile)


SM90_BACKWARD_MIN_LEN_D64 = 2048  # query rows from which the sm_90 backward beats the Triton two passes at D <= 64


def sm90_backward_wins(head_dim: int, seqlen_q: int) -> bool:
    """Whether the Gluon sm_90 backward (hopper/bwd_sm90.py) beats the Triton backward. At head dims padding to
    256 (its dK/dV and dQ kernels) it always did. For the one-pass kernel (64 or 128) vs the Triton two passes: a
    CTA of 128 keys runs Lq/64 query tiles; with few of them its set-up (K/V loads) and its dK/dV stores, which
    nothing overlaps, weigh most at D=64, where a tile is cheapest: there it takes over from
    SM90_BACKWARD_MIN_LEN_D64 query rows, at D=128 it led from L=512 (H200, TFLOP/s per length in
    docs/perf-notes.md)."""
    return padded_head_dim(head_dim) > 64 or seqlen_q >= SM90_BACKWARD_MIN_LEN_D64


def sm90_backward_rows(head_dim: int, has_bias: bool, num_stages: int) -> int:
    """Query rows per streamed tile of the one-pass sm_90 backward (hopper/bwd_sm90.py; its CTA always owns 128
    keys on two consumer warpgroups). At D=64 a tile of 128 rows: a consumer's Sᵀ and dPᵀ (64 keys x 128 queries)
    take 64 float32 registers each beside dK, dV and its dQ half at 32, inside 240, and the per-tile work that
    does not grow with the rows (barriers, waits, wgmma descriptors, the dQ hand-off) is paid half as often
    (docs/perf-notes.md has the instruction counts and the measured gain). Shared memory is the bound: Q, dO (two
    stages), K, V, the dSᵀ and dQ staging buffers take 229920 of sm_90's 232448 bytes, so neither a bias tile per
    stage (`has_bias`) nor a third Q/dO stage (`num_stages`: 262736 bytes) fits beside them: 64 rows there. At
    D=128 the doubled Sᵀ/dPᵀ beside 64-register dK and dV exceed the budget: 64 rows."""
    return 128 if padded_head_dim(head_dim) <= 64 and not has_bias and num_stages <= 2 else 64


def sm90_backward_staged_stats(head_dim: int, seqlen_q: int, varlen: bool, plain: bool = True,
                               causal: bool = False) -> bool:
    """Whether the one-pass sm_90 backward stages each query tile's lse and Δ in shared memory (the producer's
    rank-1 TMA boxes beside Q and dO) and starts its Sᵀ and dPᵀ products from zero, -lse·log2e then joining the
    exp2's scaling FFMA and Δ one subtraction: fewer instructions per tile than the accumulator starts built from
    global loads (docs/perf-notes.md: 5-6% at D=128, full and causal). At head dims padding to 128 only: at 64 each
    thread's 32 query columns of lse and Δ beside Sᵀ and dPᵀ spill. A TMA box starts at a 16-byte aligned address:
    dense batches whose rows per head are whole 16-byte groups (4 float32 rows) read lse and Δ as they are; packed
    batches (`varlen`), whose sequences start at any row, read copies in which each sequence's rows start aligned
    (seqlen.padded_row_start, written by the backward's preprocess), under the full mask only: the packed causal
    build spills in its key loops (the sequence lengths are loaded values there) and measured slower.
    `plain`: a full or causal mask without softcap, ALiBi or attn_bias, what was measured; the others keep the
    accumulator starts."""
    aligned = (varlen and not causal) or (not varlen and seqlen_q % 4 == 0)
    return padded_head_dim(head_dim) == 128 and aligned and plain


def sm90_forward_tiles(head_dim: int, causal: bool, seqlen_q: int, has_bias: bool = False) -> AttentionTiles:
    """Tiles of the Gluon sm_90 kernel (bf16/fp16): 64 query rows per consumer warpgroup (4 warps each) plus a
    producer warp, `sm90_forward_consumers` of them; the key tile and the ring depth vary. Registers bound the key
    tile (score tile, bf16 P and the fp32 output accumulator live in registers: ~240 per thread at D=128 with
    128-key tiles), shared memory the depth. Short causal rows take 64-key tiles: less of the diagonal tile is
    masked work (measured faster to SM90_SHORT_CAUSAL_LEN: docs/perf-notes.md), in a three-stage ring where it
    fits (D <= 128), which lets consecutive items overlap (sm90_cross_item).
    seqlen_q: `sm90_plan_length` (a narrow band takes the short causal tiles: two masked edge tiles per item).
    has_bias: the call adds an attn_bias (two consumers: `sm90_forward_consumers`).
    """
    # cached on the length's class, not the length: ragged workloads would grow a per-length cache without bound
    return _sm90_tiles(padded_head_dim(head_dim), causal, causal and seqlen_q <= SM90_SHORT_CAUSAL_LEN, has_bias,
                       causal and seqlen_q < SM90_THREE_CONSUMER_CAUSAL_LEN)


# causal rows from this length take three consumers at D <= 64: below it the 192-row diagonal items' masked work
# outweighs the shared K/V (H200: L=4096 ran 1.113x the two-consumer time; docs/perf-notes.md)
SM90_THREE_CONSUMER_CAUSAL_LEN = 16384


def sm90_forward_consumers(block_d: int, block_n: int, has_bias: bool = False,
                           two_consumer_causal: bool = False) -> int:
    """Consumer warpgroups of the bf16/fp16 forward at padded head dim `block_d` with `block_n`-key tiles: three
    (192-row work items, 160 registers per consumer thread) at head dims to 64 with 128-key tiles, else two (128
    rows, 240 registers). At D=64 a 64-row consumer's exp2s cost about as much as its two products, so a third
    warpgroup keeps the tensor cores fed while two run softmax, and each K/V tile serves 192 query rows instead of
    128 (FlashAttention-4's D=64 schedule: docs/perf-notes.md). Its registers fit D=64 only: S (64 x 128 fp32)
    takes 64 per thread, P 32, O 32, inside 160. Short causal rows' 64-key tiles keep two: a 192-row item puts
    more masked work on the diagonal. An attn_bias (`has_bias`) keeps two: its tiles, by TMA or the consumers'
    loads, are not built for three (the kernel refuses the combination). `two_consumer_causal`: causal rows below
    SM90_THREE_CONSUMER_CAUSAL_LEN keep two (measured)."""
    return 3 if block_d <= 64 and block_n == 128 and not has_bias and not two_consumer_causal else 2


# what describe_dispatch adds to the consumer count of a plan (sm90_forward_consumers' reason)
SM90_CONSUMER_REASONS = {
    2: "",
    3: (" (head dim <= 64 with 128-key tiles: three warpgroups cover the exp2s, which cost as much as the products "
        "there, and each K/V tile serves 192 query rows)"),
}


def sm90_smem_bytes(tiles: AttentionTiles, head_dim: int, q_buffers: int, elem_bytes: int = 2,
                    bias_bytes: int = 0) -> int:
    """Shared memory of one sm_90 CTA: `q_buffers` Q tiles of block_m rows, the K/V ring, a bias tile per ring
    stage (`bias_bytes` per element; 0: no bias read by TMA), and a kilobyte for the barriers and alignment (the
    Gluon kernel allocates everything explicitly: no compiler scratch)."""
    block_d = padded_head_dim(head_dim)
    q_bytes = q_buffers * tiles.block_m * block_d * elem_bytes
    kv_bytes = 2 * tiles.num_stages * tiles.block_n * block_d * elem_bytes
    bias_ring = tiles.num_stages * tiles.block_m * tiles.block_n * bias_bytes
    return q_bytes + kv_bytes + bias_ring + 1024


def sm90_q_buffers(tiles: AttentionTiles, head_dim: int, persistent: bool, traits: DeviceTraits,
                   bias_bytes: int = 0) -> int:
    """Two Q buffers per consumer when a persistent CTA has the shared memory for them: the producer then loads
    the next work item's Q (and, no longer blocked behind it, its first K/V tiles) while the current item runs.
    Measured on the H200 (docs/perf-notes.md): a gain at L <= 2048, neutral beyond. Where it would cost a ring
    stage (D=128 causal, 3 stages) the trade measured even, so the plan's ring stays; D=256 has no room.
    `bias_bytes`: see sm90_smem_bytes."""
    if persistent and sm90_smem_bytes(tiles, head_dim, 2, bias_bytes=bias_bytes) <= traits.smem_per_block:
        return 2
    return 1


def sm90_bias_tiles(tiles: AttentionTiles, head_dim: int, bias_bytes: int, traits: DeviceTraits
                    ) -> AttentionTiles | None:
    """The tiles of a call whose bias the producer loads by TMA (a block_m x block_n tile of `bias_bytes` per
    element beside each K/V stage): the plan's, with the ring shortened to two stages, then 64-key tiles, until
    it fits one Q buffer per consumer; None where nothing fits (the consumers then load the bias themselves)."""
    while sm90_smem_bytes(tiles, head_dim, 1, bias_bytes=bias_bytes) > traits.smem_per_block:
        if tiles.num_stages > 2:
            tiles = replace(tiles, num_stages=2)
        elif tiles.block_n > 64:
            tiles = replace(tiles, block_n=64)
        else:
            return None
    return tiles


def sm90_cross_item_safe(causal: bool, tiles: AttentionTiles) -> bool:
    """Whether the sm_90 consumers may issue the next work item's first Q·Kᵀ before their last P·V completes: its K
    tile reuses a ring stage that, with causal masking (the first consumer may skip the CTA's last
    cdiv(block_m - 64, block_n) key tiles: one with two consumers, one with three at 128-key tiles) and a ring no
    deeper than that plus one, is released by that very P·V, a deadlock (hopper/fwd_sm90._attention_consumer)."""
    skipped = -(-(tiles.block_m - 64) // tiles.block_n)
    return not causal or tiles.num_stages >= skipped + 2


def sm90_cross_item(tiles: AttentionTiles, head_dim: int, causal: bool, persistent: bool, q_buffers: int) -> bool:
    """Overlap consecutive work items of a persistent CTA (the next item's first Q·Kᵀ and softmax under the
    current item's last P·V). Measured faster on the H200 at D <= 64, where exp2 costs as much as the products,
    and with short causal 64-key tiles in three stages (D=64 and D=128); slower with two-stage 128-key rings at
    D=128/256, where the next item's first K tile is not loaded yet when the last P·V should start
    (docs/perf-notes.md). Needs two Q buffers: the current item's output is staged in its own Q buffer while the
    next item's first Q·Kᵀ reads the other."""
    return (persistent and q_buffers == 2 and sm90_cross_item_safe(causal, tiles)
            and (padded_head_dim(head_dim) <= 64 or tiles.num_stages >= 3))


@functools.lru_cache(maxsize=None)
def _sm90_tiles(block_d: int, causal: bool, short_causal: bool, has_bias: bool, two_consumer_causal: bool
                ) -> AttentionTiles:
    if block_d > 128:
        block_n, stages = 64, 2
    elif short_causal:
        block_n, stages = 64, 3
    else:
        block_n, stages = 128, 3 if causal else 2
    consumers = sm90_forward_consumers(block_d, block_n, has_bias, two_consumer_causal)
    return AttentionTiles(64 * consumers, block_n, 4 * consumers, stages, use_tma=True)


SM90_L2_BYTES = 50 * 2**20  # H100 and H200
# mean query rows per sequence from which a causal packed batch whose K/V outgrows L2 takes bands of tiles
SM90_BAND_MEAN_ROWS = 1024


def sm90_varlen_band(kv_bytes: int, rows: int, num_seqs: int, group: int = 1) -> int:
    """Query tiles per band of the causal packed forward's work list (hopper.work_items.varlen_work): several where the
    batch's K and V (`kv_bytes`) outgrow L2 and its sequences are long on average (`rows` packed query rows over
    `num_seqs`), else one: in L2 one tile per band balances best, and short sequences would compute their first tile
    more than once. Four for MHA, where bands of four led every batch of the domain measured on an H100; one with
    GQA (`group` query heads per KV head > 1), whose heads already share their K/V side by side: one led two there
    (docs/perf-notes.md)."""
    if group > 1 or kv_bytes <= SM90_L2_BYTES or rows < SM90_BAND_MEAN_ROWS * max(num_seqs, 1):
        return 1
    return 4


def sm90_forward_pingpong(head_dim: int, fp8: bool) -> bool:
    """Whether the forward's consumer warpgroups issue each key tile's Q·Kᵀ and P·V in a fixed rotation (a barrier
    per consumer, hopper/fwd_sm90._take_turn) and rescale O after the P·V product rather than between the two
    issues, instead of issuing whenever their warps are scheduled. At head dims to 64 (32 accumulator registers of
    O per thread) only: at 128 the rescale of 64 registers after the wait is on the critical path, and the rotation
    alone gains nothing (docs/perf-notes.md). 16-bit inputs: the e4m3 forward was not measured with it."""
    return padded_head_dim(head_dim) <= 64 and not fp8


def sm90_forward_skip_rescale(head_dim: int, fp8: bool) -> bool:
    """Whether the forward's warps branch past O's rescale where none of their rows' running maxima moved in the key
    tile (hopper/fwd_sm90._rescale; bit-identical). At head dims padding to 256: the rescale is 128 of a key tile's
    ~465 instructions per warp there, and the skip measured faster; at 128 and below it was neutral
    (docs/perf-notes.md). 16-bit inputs: the e4m3 forward was not measured with it."""
    return padded_head_dim(head_dim) > 128 and not fp8


def sm90_fp8_forward_tiles(head_dim: int) -> AttentionTiles:
    """Tiles of the Gluon sm_90 forward on e4m3 inputs (hopper/fwd_sm90.attention_forward_sm90_fp8). e4m3 halves the
    K/V ring's bytes, so three stages fit everywhere; registers bound the key tile as in bf16 (the e4m3 P takes half
    the registers, the float32 scores and output as many): 128-key tiles to D=128, 64-key tiles at D=256 (a 128-key
    tile there spilled 903 LDL/STL offline, triton 3.6; 64 keys: none). Unmeasured on the GPU:
    `benchmarks/tools/sweep_attention_fp8_sm90.py` sweeps the alternatives."""
    if padded_head_dim(head_dim) > 128:
        return AttentionTiles(128, 64, 8, 3, use_tma=True)
    return AttentionTiles(128, 128, 8, 3, use_tma=True)


def sm90_fp8_smem_bytes(tiles: AttentionTiles, head_dim: int, q_buffers: int) -> int:
    """Shared memory of one CTA of the e4m3 forward: sm90_smem_bytes at one byte per element, plus the two
    consumers' bf16 output staging buffers (the e4m3 Q buffer is too small to stage the output in)."""
    return sm90_smem_bytes(tiles, head_dim, q_buffers, elem_bytes=1) + tiles.block_m * padded_head_dim(head_dim) * 2


def sm90_fp8_q_buffers(tiles: AttentionTiles, head_dim: int, persistent: bool, traits: DeviceTraits) -> int:
    """sm90_q_buffers for the e4m3 forward: two Q buffers per consumer when a persistent CTA has the room."""
    if persistent and sm90_fp8_smem_bytes(tiles, head_dim, 2) <= traits.smem_per_block:
        return 2
    return 1

