"""What the three sm_90 attention backward kernels share: the query tiles a key block visits, the mask, the CTA's
key block, and the producer warp that loads K and V once and streams Q and dO tiles (bwd_sm90's one-pass kernel and
bwd_sm90_hdim256's dK/dV kernel; bwd_dq_sm90 takes the mask only). Each kernel module imports this one;
bwd_sm90.attention_backward_sm90 picks the kernels. See bwd_sm90's docstring for the protocol.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime.jit import JITFunction

from flashmoe_science.gluon.compat import gl, gluon, mbarrier, tma

from flashmoe_science.attention.features import as_features
from flashmoe_science.attention.mask import LOG2_E, key_tile_range, query_tile_range, score_to_log2, visible
from flashmoe_science.attention.seqlen import launch_sizes, ranked_tile_of_work, ranked_work_list, work_items_bound

from flashmoe_science.gluon.sm90 import compile_offline as sm90_compile_offline
from flashmoe_science.attention.hopper.fwd_sm90 import _masked

TWO_KERNEL_BLOCK_D = 256  # padded head dim run as bwd_sm90_hdim256 (dK, dV) + bwd_dq_sm90 (dQ)


@gluon.jit
def _query_tile_bounds(start_n, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       CAUSAL: gl.constexpr):
    """For the key tile at `start_n`: (query_start, num_tiles, diag_end) in rows; see the module doc."""
    diagonal = seqlen_k - seqlen_q
    query_end = (seqlen_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if CAUSAL:
        query_start = gl.maximum(start_n - diagonal, 0) // BLOCK_M * BLOCK_M
        last_key = gl.minimum(start_n + BLOCK_N, seqlen_k) - 1
        diag_end = (gl.maximum(last_key - diagonal, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        query_start = 0
        diag_end = 0
    query_start = gl.minimum(query_start, query_end)
    diag_end = gl.minimum(diag_end, query_end)
    if start_n + BLOCK_N > seqlen_k:  # ragged keys: everything masked
        diag_end = query_end
    return query_start, (query_end - query_start) // BLOCK_M, diag_end


@gluon.jit
def _visited_query_tiles(start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr,
                         MASK_RIGHT: gl.constexpr):
    """For the key block at `start_n`: (query_start, num_tiles, full_start, full_end) in rows. Query tiles
    [query_start, query_start + num_tiles·BLOCK_M) see some of its keys; `_tile_needs_mask` says which need the
    elementwise mask. Windows (MASK_LEFT/MASK_RIGHT, mask.kernel_args) take mask.query_tile_range: tiles entirely
    outside the window are never visited. Dense and causal-only calls (CAUSAL, no MASK_*) take `_query_tile_bounds`:
    the same tiles with less arithmetic (its ragged-key rule masks every tile, where query_tile_range's would need
    a second comparison per tile)."""
    if MASK_LEFT or MASK_RIGHT:
        query_start, full_start, full_end, query_end = query_tile_range(
            start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
        num_tiles = (query_end - query_start + BLOCK_M - 1) // BLOCK_M
    else:
        query_start, num_tiles, full_start = _query_tile_bounds(start_n, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N,
                                                                CAUSAL)
        full_end = full_start  # unused: masked tiles are [query_start, full_start)
    return query_start, num_tiles, full_start, full_end


@gluon.jit
def _contributors_before(start_n, start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """How many key blocks of BLOCK_N keys before the one at `start_n` (of the same sequence and kv head) visit the
    query tile at `start_m`, given that this one does (`_visited_query_tiles`).

    The blocks that visit a query tile are consecutive: both ends of `_visited_query_tiles`' range grow with the
    key block, so if blocks n_lo and n visit tile m, every block between them does, and n_lo is the first block
    whose range reaches past m. That is the first key tile of the query tile's own range (mask.key_tile_range
    at these tile sizes: the same rule read the other way): 0 without a left window bound (causal and
    right-bounded windows only start later query tiles, never later key blocks for a given tile)."""
    first = 0
    if MASK_LEFT:
        first, _, _, _ = key_tile_range(start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
                                        MASK_LEFT, MASK_RIGHT)
    return (start_n - first) // BLOCK_N


@gluon.jit
def _row_stat_base(q_head, q_first, seqlen_q, lse_rows, VARLEN: gl.constexpr):
    """The first row of flat query head `q_head` (batch · Hq + head) in the tensors of one value per query row
    (lse, Δ, the deterministic mode's counters): a packed batch's are (1, Hq, lse_rows), whose sequence rows start
    at q_first (packed, or in the staged statistics' padded layout: seqlen.padded_row_start); a dense batch's
    (B, Hq, Lq)."""
    if VARLEN:
        row0 = q_head * lse_rows + q_first
    else:
        row0 = q_head * seqlen_q
    return row0


@gluon.jit
def _tile_needs_mask(start, full_start, full_end, BEFORE: gl.constexpr, AFTER: gl.constexpr):
    """Whether the tile at `start` (rows or keys) lies outside the unmasked [full_start, full_end) of
    `_visited_query_tiles` or bwd_dq_sm90's `_visited_key_tiles`: BEFORE / AFTER say which side can hold masked
    tiles (a window: both; causal-only: the key-stationary kernels' first tiles, the dQ kernel's last)."""
    if BEFORE and AFTER:
        needs = (start < full_start) | (start >= full_end)
    elif BEFORE:
        needs = start < full_start
    else:
        needs = start >= full_end
    return needs


@gluon.jit
def _hide_keys(s_init, queries, keys, seqlen_k, diagonal, window_left, window_right, CAUSAL: gl.constexpr,
               MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, HIDDEN: gl.constexpr = float("-inf")):
    """s_init with -inf where a key is hidden from a query (mask.visible: past Lk, outside the window; CAUSAL is
    the window (-1, 0)). `queries` and `keys` are index tensors expanded to s_init's orientation (the three sm_90
    backward kernels hold scores as keys x queries or queries x keys). -inf, not a product: a dead row (lse = -inf,
    no visible key) would otherwise start from +inf."""
    if MASK_LEFT or MASK_RIGHT:
        seen = visible(queries, keys, seqlen_k, diagonal, window_left, window_right, MASK_LEFT, MASK_RIGHT)
    else:
        seen = visible(queries, keys, seqlen_k, diagonal, 0, 0, False, CAUSAL)
    return gl.where(seen, s_init, HIDDEN)


@gluon.jit
def _score_start(zeros, lse, inv_scale, queries, keys, needs_mask, seqlen_k, diagonal, window_left, window_right,
                 AXIS: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                 SOFTCAP: gl.constexpr):
    """The score product's starting accumulator. The statistics and the mask ride in it: -lse / scale (`lse` the
    vector along the queries, expanded on AXIS), -inf at hidden pairs where `needs_mask`, so the product gives
    (S - lse / scale) directly (ALiBi's bias is linear and added after). A softcap is not linear: its product
    must be raw (zeros) and lse is subtracted after the tanh; with a causal or window mask its hidden pairs start
    from NaN instead, which the tanh keeps and `_probabilities` turns into P = 0 (so no index vector is held
    across the products: that spilled at D=128, 115 -> 70 loads causal); dense calls mask their ragged key block
    after the tanh (fewer spills there: 18 vs 51 loads)."""
    if SOFTCAP:
        start = zeros
    else:
        start = zeros - gl.expand_dims(lse * inv_scale, AXIS)
    return _mask_score_start(start, queries, keys, needs_mask, seqlen_k, diagonal, window_left, window_right,
                             CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP)


@gluon.jit
def _alibi_score_start(s_init, queries, keys, diagonal, alibi_raw, ALIBI_START: gl.constexpr):
    """ALiBi in the score product's start (ALIBI_START: ALiBi without a softcap): s_init - m·|i + diagonal - j| /
    scale, so the product gives the biased scores and the softmax after it is the plain one.

    The bias is linear in the scores (it is added before the exp2, like -lse), so it rides in the accumulator the
    way lse and the mask do: built before the Q/dO wait, while only dK and dV are live, instead of a distance,
    an abs and an FMA per score after the product. `alibi_raw` = m / scale (the slope in raw score units);
    `queries`, `keys`: index tensors expanded to s_init's orientation. With a softcap the bias comes after the tanh
    and stays in `_probabilities`."""
    if ALIBI_START:
        rows = (queries + diagonal).to(gl.float32)  # i + diagonal: one conversion per query, not per score
        s_init = s_init - alibi_raw * gl.abs(rows - keys.to(gl.float32))
    return s_init


@gluon.jit
def _mask_score_start(s_init, queries, keys, needs_mask, seqlen_k, diagonal, window_left, window_right,
                      CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                      SOFTCAP: gl.constexpr):
    """`_score_start`'s mask, for a start built once and masked per tile (bwd_sm90_dq): -inf at hidden pairs
    where `needs_mask` (NaN with a softcap, see `_score_start`)."""
    if needs_mask:  # (a dense softcapped call masks its ragged key block after the tanh: `_probabilities`)
        if SOFTCAP and (CAUSAL or MASK_LEFT or MASK_RIGHT):
            s_init = _hide_keys(s_init, queries, keys, seqlen_k, diagonal, window_left, window_right, CAUSAL,
                                MASK_LEFT, MASK_RIGHT, float("nan"))
        elif not SOFTCAP:
            s_init = _hide_keys(s_init, queries, keys, seqlen_k, diagonal, window_left, window_right, CAUSAL,
                                MASK_LEFT, MASK_RIGHT)
    return s_init


@gluon.jit
def _probabilities(s, lse, queries, keys, needs_mask, seqlen_k, diagonal, window_left, window_right, qk_scale,
                   softcap_scale, alibi_slope_log2, AXIS: gl.constexpr, CAUSAL: gl.constexpr,
                   MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """(P, t) from the product started by `_score_start`: P = exp2 of mask.score_to_log2's scores minus lse (in
    log2 units); t is the softcap's tanh, for `_softcap_grad` (unused otherwise). Hidden pairs give P = 0.

    A softcap takes the forward's tanh.approx (so P matches the forward's lse, and one SFU op per score instead of
    an exp2 and a division). Its exp2 stays on the SFU: with five products per tile pair instead of the forward's
    two, two SFU ops per score stay under the tensor-core time (docs/perf-notes.md: an exp2 on the FMA pipe,
    tried in the forward, measured slower and spilled here)."""
    x, t = score_to_log2(s, queries, keys, diagonal, qk_scale, softcap_scale, alibi_slope_log2, SOFTCAP, ALIBI,
                         True)
    if SOFTCAP:
        x = x - gl.expand_dims(lse * LOG2_E, AXIS)
        if needs_mask:
            if CAUSAL or MASK_LEFT or MASK_RIGHT:  # hidden pairs carry NaN from `_score_start`: P = 0, t finite
                hidden = t != t
                x = gl.where(hidden, float("-inf"), x)
                t = gl.where(hidden, 0.0, t)
            else:  # keys past Lk (dense: no mask rides the product)
                x = _hide_keys(x, queries, keys, seqlen_k, diagonal, window_left, window_right, CAUSAL, MASK_LEFT,
                               MASK_RIGHT)
    return gl.exp2(x), t


@gluon.jit
def _raw_probabilities(s, neg_lse_log2, queries, keys, seqlen_k, diagonal, qk_scale, AXIS: gl.constexpr,
                       CAUSAL: gl.constexpr, hide=False):
    """P from a score product started from zero (or, in a masked tile, from `_mask_score_start`'s −inf at hidden
    pairs) under a full or causal mask: P = exp2(s·scale·log2e − lse·log2e), the subtraction folded into the
    scaling FFMA (`neg_lse_log2` = −lse·log2e along the queries, expanded on AXIS); `hide` masks it after."""
    x = s * qk_scale + gl.expand_dims(neg_lse_log2, AXIS)
    if hide:
        x = _hide_keys(x, queries, keys, seqlen_k, diagonal, 0, 0, CAUSAL, False, False)
    return gl.exp2(x)


@gluon.jit
def _staged_neg_lse_log2(lse_tile, start_m, seqlen_q, layout: gl.constexpr, MASKED: gl.constexpr, hide=False):
    """−lse·log2e of a query tile from its shared-memory copy (the producer's TMA box, `_producer`'s STATS), in
    `layout` (the queries' slice of the score layout). The box's rows past Lq are another head's or sequence's:
    there lse is taken as +inf, so P = 0 and those zero-filled (or foreign) query rows add nothing. So is a dead
    row's (lse = −inf: no visible key, in MASKED tiles only), whose −inf scores would otherwise meet +inf."""
    ROWS: gl.constexpr = lse_tile.shape[0]
    lse = lse_tile.load(layout)
    if MASKED:
        lse = gl.where(lse == float("-inf"), float("inf"), lse)
    if hide:
        lse = gl.where(lse == float("-inf"), float("inf"), lse)
    if start_m + ROWS > seqlen_q:
        lse = gl.where(start_m + gl.arange(0, ROWS, layout=layout) < seqlen_q, lse, float("inf"))
    return lse * -LOG2_E


@gluon.jit
def _softcap_grad(ds, t, SOFTCAP: gl.constexpr):
    """dS through the softcap: d(c·tanh(u/c))/du = 1 - tanh², so dS_raw = dS · (1 - t²)."""
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return ds


@gluon.jit
def _cta_key_block(seqlen_k, num_kv_heads, WorkTiles, CTA_KEYS: gl.constexpr, VARLEN: gl.constexpr):
    """This CTA's (first key, batch or sequence, kv head): program ids run over a (batch, kv head)'s key blocks
    consecutively; a packed batch's over its real key blocks only, longest sequence first (seqlen.ranked_tile_of_work
    over WorkTiles, the ranked work list of cu_seqlens_k; the caller returns first where the program id is past
    them)."""
    if VARLEN:
        seq, kv_head, tile, _ = ranked_tile_of_work(WorkTiles, num_kv_heads, gl.program_id(0))
        return tile * CTA_KEYS, seq, kv_head
    else:
        num_key_tiles = gl.cdiv(seqlen_k, CTA_KEYS)
        pid_bh = gl.program_id(0) // num_key_tiles
        return (gl.program_id(0) % num_key_tiles) * CTA_KEYS, pid_bh // num_kv_heads, pid_bh % num_kv_heads


@gluon.jit
def _past_work(WorkTiles, num_heads, VARLEN: gl.constexpr):
    """Whether this program lies past a packed batch's real tiles (its launch is sized by seqlen.work_items_bound,
    which may exceed them); False for dense launches, whose grids are exact."""
    if VARLEN:
        return gl.program_id(0) >= num_heads * gl.load(WorkTiles)  # seqlen.varlen_work_list's tile count
    else:
        return False


@gluon.jit
def _producer_barriers(NUM_STAGES: gl.constexpr):
    """The barriers of `_producer`'s protocol, initialised: kv_ready (K and V landed), q_ready/do_ready per ring
    stage, and empty per stage (one arrival per consumer frees it)."""
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return kv_ready, q_ready, do_ready, empty


@gluon.jit
def _key_tile_lists(block_lists, g):
    """Query head g's lists of the CTA's key block in the block mask (mods.block_mask at ROWS x BLOCK_N tiles, its
    by_key lists; `block_lists`: partial counts, partial tiles, full counts, full tiles, list length, the row of the
    group's first head, rows per head): (its full tiles, its partial tiles, how many are full, how many in all).
    Its empty tiles are on neither list: no partition visits them."""
    partial_counts, partial_tiles, full_counts, full_tiles, list_len, first_row, rows_per_head = block_lists
    row = first_row + g * rows_per_head
    n_full = gl.load(full_counts + row)
    return full_tiles + row * list_len, partial_tiles + row * list_len, n_full, n_full + gl.load(partial_counts + row)


@gluon.jit
def _listed_query_tile(head_lists, i, ROWS: gl.constexpr):
    """The i-th query tile of `_key_tile_lists`' lists, full ones first: (its first row within the sequence, whether
    it is partial, i.e. masked elementwise by the mask_mod)."""
    full_tiles, partial_tiles, n_full, _ = head_lists
    if i < n_full:
        tile = gl.load(full_tiles + i)
    else:
        tile = gl.load(partial_tiles + (i - n_full))
    return tile * ROWS, i >= n_full


_WALK_LANES = gl.constexpr(gl.BlockedLayout([2], [32], [1], [0]))  # a tile record in the producer warp


@gluon.jit
def _stage_walk_record(records, stage, WARPS: gl.constexpr):
    """The two int32 the producer stored into `stage`'s record (`_load_query_tile`'s `walk`), as scalars, in a
    partition of WARPS warps: read after the stage's Q barrier completed (its arrival follows the store)."""
    pair = records.index(stage).load(gl.BlockedLayout([2], [32], [WARPS], [0]))
    index = gl.arange(0, 2, layout=gl.BlockedLayout([2], [32], [WARPS], [0]))
    return gl.sum(gl.where(index == 0, pair, 0), 0), gl.sum(gl.where(index == 1, pair, 0), 0)


@gluon.jit
def _mod_score_start(s_init, mod_tile, offs_q, seqlen_q, seqlen_k, diagonal, window_left, window_right, mask_mod,
                     CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """A mask_mod's score start (keys x the queries `offs_q`): on a partial tile of the block mask, -inf where
    fwd_sm90._masked hides the pair (the bounds, the window or causal diagonal, and the mod at clamped positions);
    a full tile's start unchanged. `mod_tile`: (partial, the mod's b and h, the first key, the mod's captured
    tensors). _masked takes queries x keys: the start goes through it transposed (registers relabelled, no data
    moved), whole: the mod's tiles are 64 x 64 (bwd_sm90.one_pass_tiles)."""
    partial, b, h, first_key, mod_tensors = mod_tile
    if partial:
        KEYS: gl.constexpr = s_init.shape[0]
        hidden = _masked(s_init.permute((1, 0)), offs_q, first_key, seqlen_q, seqlen_k, diagonal, window_left,
                         window_right, b, h, mask_mod, mod_tensors, CAUSAL, MASK_LEFT, MASK_RIGHT, KEYS)
        s_init = gl.convert_layout(hidden.permute((1, 0)), s_init.type.layout)
    return s_init


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
              kv_ready, q_ready, do_ready, empty, start_n, batch, kv_head, group_size, seqlen_q, seqlen_k,
              q_first, k_first, window_left, window_right,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
              bias_desc=None, bias_smem=None, bias_step_b=0, bias_step_h=0, BIAS_TMA: gl.constexpr = False,
              stats=None, STATS: gl.constexpr = False, VARLEN: gl.constexpr = False, block_lists=None,
              MASK_MOD: gl.constexpr = False, walk_smem=None):
    """K and V once, then Q and dO of every visited query tile of every query head of the group. Rows are
    relative to the sequence's first (q_first, k_first: seqlen.sequence_coords; 0 for dense batches). A packed
    sequence's last tiles may read the next sequence's rows: hidden keys and queries with lse = +inf, harmless.
    BIAS_TMA (dense batches): each Q tile's stage also takes the bias tile of its rows and the CTA's keys
    (`bias_smem`; batch and head coordinates times bias_step_b/h, 0 where the bias broadcasts), on Q's barrier.
    STATS: each stage also takes the tile's lse (on Q's barrier) and Δ (on dO's), `stats` = (lse_desc, delta_desc,
    lse_smem, delta_smem, num_q_heads, lse_rows, stat_first): rank-1 boxes of the tile's rows (`_row_stat_base`;
    stat_first: the sequence's first row there, a packed batch's in the padded layout, 16-byte aligned).
    MASK_MOD: the visited tiles are each head's of the block mask (`_key_tile_lists`), in the consumers' order."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes)
    tma.async_load(k_desc, [batch, kv_head, k_first + start_n, 0], kv_ready, k_smem)
    tma.async_load(v_desc, [batch, kv_head, k_first + start_n, 0], kv_ready, v_smem)
    q_bytes: gl.constexpr = (q_desc.block_type.nbytes + (bias_desc.block_type.nbytes if BIAS_TMA else 0)
                             + (stats[0].block_type.nbytes if STATS else 0))
    do_bytes: gl.constexpr = do_desc.block_type.nbytes + (stats[1].block_type.nbytes if STATS else 0)
    if MASK_MOD:
        ring = 0
        for g in range(group_size):
            head_lists = _key_tile_lists(block_lists, g)
            for i in range(head_lists[3]):
                start_m, partial = _listed_query_tile(head_lists, i, ROWS)
                _load_query_tile(q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, empty, ring,
                                 kv_head * group_size + g, q_first + start_m, batch, start_n, q_first, seqlen_q,
                                 bias_desc, bias_smem, bias_step_b, bias_step_h, stats, q_bytes, do_bytes,
                                 NUM_STAGES, BIAS_TMA, STATS, VARLEN, (walk_smem, start_m, g * 2 + partial))
                ring += 1
    else:
        query_start, num_tiles, _, _ = _visited_query_tiles(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                                            ROWS, KEYS, CAUSAL, MASK_LEFT, MASK_RIGHT)
        for ring in range(group_size * num_tiles):
            g = ring // num_tiles
            start_m = q_first + query_start + (ring - g * num_tiles) * ROWS
            _load_query_tile(q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, empty, ring,
                             kv_head * group_size + g, start_m, batch, start_n, q_first, seqlen_q, bias_desc,
                             bias_smem, bias_step_b, bias_step_h, stats, q_bytes, do_bytes, NUM_STAGES, BIAS_TMA,
                             STATS, VARLEN)


@gluon.jit
def _load_query_tile(q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, empty, ring, q_head, start_m, batch,
                     start_n, q_first, seqlen_q, bias_desc, bias_smem, bias_step_b, bias_step_h, stats,
                     Q_BYTES: gl.constexpr, DO_BYTES: gl.constexpr, NUM_STAGES: gl.constexpr,
                     BIAS_TMA: gl.constexpr, STATS: gl.constexpr, VARLEN: gl.constexpr, walk=None):
    """`_producer`'s loads of ring position `ring`: Q and dO rows from `start_m` (the packed row) of `q_head`, once
    the consumers have released the stage, with the bias tile and the statistics where they ride along. `walk` (a
    mask_mod's): (the stages' records, two int32) stored into the stage's record before Q's barrier is armed."""
    stage = ring % NUM_STAGES
    mbarrier.wait(empty.index(stage), ((ring // NUM_STAGES) & 1) ^ 1)  # first pass: passes at once
    if walk is not None:
        records, first, second = walk
        pair = gl.arange(0, 2, layout=_WALK_LANES)
        records.index(stage).store(gl.where(pair == 0, first, second))
    if STATS:
        lse_desc, delta_desc, lse_smem, delta_smem, num_q_heads, lse_rows, stat_first = stats
        stat_row = (_row_stat_base(batch * num_q_heads + q_head, stat_first, seqlen_q, lse_rows, VARLEN)
                    + start_m - q_first)
    mbarrier.expect(q_ready.index(stage), Q_BYTES)
    tma.async_load(q_desc, [batch, q_head, start_m, 0], q_ready.index(stage), q_smem.index(stage))
    if BIAS_TMA:
        tma.async_load(bias_desc, [batch * bias_step_b, q_head * bias_step_h, start_m, start_n],
                       q_ready.index(stage), bias_smem.index(stage))
    if STATS:
        tma.async_load(lse_desc, [stat_row], q_ready.index(stage), lse_smem.index(stage))
    mbarrier.expect(do_ready.index(stage), DO_BYTES)
    tma.async_load(do_desc, [batch, q_head, start_m, 0], do_ready.index(stage), do_smem.index(stage))
    if STATS:
        tma.async_load(delta_desc, [stat_row], do_ready.index(stage), delta_smem.index(stage))


# ---------------------------------------------------------------------------------------------------- host side
def check_features(features) -> None:
    """Raise ValueError for a feature these kernels do not take (the caller runs triton/bwd.py instead)."""
    if features.attn_bias is not None:
        raise ValueError("the sm_90 backward takes no attn_bias (the Triton backward does)")


def feature_args(features, softmax_scale: float, q, k, work_rows: int, over_queries: bool = False,
                 lse_rows: int | None = None) -> tuple[tuple, dict, tuple]:
    """What the three sm_90 backward kernels take for a call's features: (their trailing arguments `Slopes,
    CuSeqlensQ, CuSeqlensK, WorkTiles, num_seqs, stride_slopes, lse_rows, window_left, window_right,
    softcap_scale`, their feature constexprs, (programs per head for the grid, the kernels' seqlen_q and seqlen_k
    arguments, qk_scale)). `work_rows`: the key rows of a CTA (over_queries: the query rows) that its grid counts.
    `lse_rows`: the rows per head of the per-row tensors the kernel reads (None: q's, lse's layout).

    Dense and causal-only masks run as CAUSAL with no MASK_* flag (a constant window: mask.key_tile_bounds and
    `_query_tile_bounds`, fewer instructions than the general bounds with a runtime window). Any other window sets
    MASK_LEFT/MASK_RIGHT from mask.kernel_args. Varlen: the grid runs over the real tiles only, longest sequence
    first (seqlen.ranked_work_list of cu_seqlens_k, or of cu_seqlens_q over_queries; each sequence's lengths come
    from cu_seqlens).

    A packed batch's kernels take the packed totals as seqlen_q/k, which they never read (sequence_coords replaces
    them), rather than the longest lengths, which change with every batch (seqlen.PER_BATCH_ARGS says why)."""
    features = as_features(features)
    mask = features.mask
    scalars = mask.kernel_args(softmax_scale)
    causal_only = mask.plain_causal
    slopes = features.alibi_slopes
    if slopes is not None and slopes.stride(-1) != 1:
        slopes = slopes.contiguous()  # (B, Hq) float32: a few bytes
    varlen = features.varlen
    num_seqs, longest_q, longest_k = launch_sizes(q, k, varlen)
    total, longest = (q.shape[2], longest_q) if over_queries else (k.shape[2], longest_k)
    if varlen is None:
        cu_q = cu_k = work_tiles = num_seqs_arg = None
        programs = num_seqs * triton.cdiv(longest, work_rows)
    else:
        cu_q, cu_k, num_seqs_arg = varlen.cu_seqlens_q, varlen.cu_seqlens_k, num_seqs
        work_tiles = ranked_work_list(cu_q if over_queries else cu_k, work_rows, total)
        programs = work_items_bound(num_seqs, total, longest, work_rows)
    args = (slopes, cu_q, cu_k, work_tiles, num_seqs_arg, 0 if slopes is None else slopes.stride(0),
            q.shape[2] if lse_rows is None else lse_rows,
            scalars["window_left"], scalars["window_right"], scalars["softcap_scale"])
    constexprs = dict(CAUSAL=causal_only, MASK_LEFT=scalars["MASK_LEFT"],
                      MASK_RIGHT=scalars["MASK_RIGHT"] and not causal_only, SOFTCAP=scalars["SOFTCAP"],
                      ALIBI=slopes is not None, VARLEN=varlen is not None)
    return args, constexprs, (programs, q.shape[2], k.shape[2], scalars["qk_scale"])


def offline_build(kernel, bound: dict):
    """sm90_compile_offline of a launch's bound parameters: constexprs and None arguments specialised."""
    declared = {param.name for param in kernel.params if param.is_constexpr}
    # a function argument (a mask_mod) is a constexpr too: each one builds its own kernel
    constexprs = {name: value for name, value in bound.items()
                  if value is None or name in declared or isinstance(value, JITFunction)}
    return sm90_compile_offline(kernel, [bound[name] for name in kernel.arg_names], constexprs)


def offline_features(causal=False, window=None, softcap=None, alibi=False, varlen=False, heads=4, bias=None,
                     bias_dtype=torch.bfloat16):
    """A CallFeatures over meta tensors for offline builds (two sequences, `heads` query heads; `bias`: the shape
    of an attn_bias broadcast to (2, heads, 256, 256), as the front door hands it on)."""
    from flashmoe_science.attention.features import CallFeatures, Varlen
    from flashmoe_science.attention.mask import make_mask

    slopes = torch.empty(2, heads, device="meta") if alibi else None
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    attn_bias = None
    if bias is not None:
        attn_bias = torch.empty(bias, dtype=bias_dtype, device="meta").expand(2, heads, 256, 256)
    return CallFeatures(mask=make_mask(causal, window, softcap), alibi_slopes=slopes, attn_bias=attn_bias,
                        varlen=Varlen(cu, cu, 256, 256) if varlen else None)
