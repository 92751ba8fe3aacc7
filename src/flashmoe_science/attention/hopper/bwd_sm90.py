"""Attention backward for Hopper (sm_90) in Gluon: one pass for dK, dV and dQ, FA3's work split (head dims padding
to 64 or 128; at 256, attention_backward_sm90 runs bwd_sm90_hdim256 and bwd_dq_sm90 instead).

The math is `triton/bwd.py`'s (P recomputed from the forward's LSE, Δ = rowsum(dO ∘ O) from its preprocess kernel,
bottom-right causal, dead rows -> zero gradients, GQA summed over the group's query heads). What is Hopper-specific
is who holds what:

A CTA owns BLOCK_N = 128 keys of one (batch, kv head); grid (cdiv(Lk, 128), B·Hkv). Four warp-specialised
partitions:

- producer (one warp, 24 registers): loads the CTA's K and V once, then streams Q and dO tiles of ROWS query rows
  (`tiles.sm90_backward_rows`: 128 at D=64, else 64) through a ring of NUM_STAGES stages, for every query head of
  the GQA group and every query tile that sees the CTA's keys (`q_ready`, `do_ready`; `empty` takes one arrival per
  consumer); where `tiles.sm90_backward_staged_stats` holds, each stage also takes its rows' lse and Δ.
- two consumers (4 warps, 240 registers each): consumer c owns keys [64c, 64c + 64) of the CTA, and keeps their dK_c
  and dV_c in fp32 registers over every query tile of every head of the group. The scores are computed transposed
  (keys as rows), so that Pᵀ and dSᵀ come out of the wgmma already in the register layout of the A operand of the
  dV and dK products: those two read them straight from registers (no shared-memory round trip). Per query tile:

    issue  Sᵀ = K_c Qᵀ,  dPᵀ = V_c dOᵀ          (async wgmma, operands in shared memory)
    Pᵀ = exp2(Sᵀ·scale·log2e − lse·log2e)        (masks on boundary tiles only)
    dSᵀ = Pᵀ ∘ (dPᵀ − Δ)
    issue  dV_c += Pᵀ dO                          (async wgmma, A from registers)
    store  dSᵀ (bf16/fp16) into this consumer's 64 rows of the shared dSᵀ buffer; both consumers meet (`ds_ready`)
    issue  dQ[:, half c] = dS K[:, half c]        (async wgmma over all 128 keys, A = the buffer read transposed)
    issue  dK_c += dSᵀ Q                          (async wgmma, A from registers)
    wait for dV and dQ only (wgmma groups complete in order): dK runs under the next step
    dQ half (fp32) -> the tile's staging buffer (`dq_empty` first), signal `dq_full`
    wait for dK, release the Q/dO stage

  Each consumer computes dQ for half of the head dim over both consumers' keys (FA3's split): every dq_accum element
  receives Lk/128 additions, made by the TMA unit in L2 (`cp.reduce.async.bulk.tensor`), not by the warps.
- dQ writer (one warp, 24 registers): per tile, waits `dq_full` (both halves staged), issues one TMA reduce-add per
  32 columns, waits until the TMA unit has read the buffer, arrives `dq_empty`. The consumers never wait for a TMA
  operation: the staging buffer is double-buffered by tile parity (one buffer with an attn_bias above D=64, whose
  ring takes the second's shared memory), so a consumer waits only if the writer is two tiles behind.
- epilogue (each consumer): dK_c · softmax_scale and dV_c stored with masked stores (rows past Lk, head-dim padding).

The dSᵀ buffer is double-buffered by tile parity: a consumer writes tile t+1's rows while the other may still read
tile t's for its dQ product; it cannot reach tile t+2 before the other has finished tile t (it waits for the other's
arrival of tile t+1 first).

Barriers. Gluon (triton 3.6) lowers `mbarrier.arrive` to a warpgroup `bar.sync` and one thread's arrive, and the
compiler's shared-memory analysis adds a `bar.sync` after each arrive: a consumer runs five warpgroup barriers per
tile (two per arrival on `ds_ready` and `empty`, one for `dq_full`), all where its four warps arrive together
(after a wgmma wait or an mbarrier wait every warp took). Before the dQ writer it ran six, one of them behind
`tma.store_wait` of the previous tile's reduce-adds (only the issuing warp waits there; the other three stall at
the barrier), and issued the reduce-adds itself. A per-thread arrive (an mbarrier counting 256 arrivals instead of
a barrier and one) has no Gluon op, and a named-barrier arrive would be inline PTX the compiler's barrier analysis
does not see.

Which query tiles a key tile visits, per query head (query i sees key j iff j <= i + Lk − Lq): from the first
that sees one of its keys to the last; [query_start, diag_end) are the causal diagonal's, which mask, the rest
run without mask arithmetic. Queries past Lq need no mask: their lse is read as +inf, so their P is exactly 0. The
CTA whose keys run past Lk masks every tile: its zero-filled keys would otherwise give P = exp2(−lse·log2e), which
overflows for lse < −88 and would send inf·0 = NaN into dQ. Rows that see no key (lse = −inf) only occur in masked
tiles. A mask is applied by starting the Sᵀ accumulator from −inf at hidden (key, query) pairs (so P = 0 there);
the softmax scale must be positive (the caller checks).

Features (bwd_common.feature_args; the same in the two D=256 kernels): a window walks mask.query_tile_range
(tiles outside it are never loaded; both of its edges mask); ALiBi subtracts slope·|i + Lk − Lq − j| after the
product (it is linear, so lse still rides the accumulator); a softcap needs the raw product (lse subtracted after
the tanh, dS · (1 − t²)); varlen runs one "batch" entry per packed sequence (rows offset by cu_seqlens, CTAs past
their sequence's keys return at once). A packed sequence's last Q/dO box may read the next sequence's rows: their
lse is read as +inf, so their P and dS are exactly 0, and the dQ reduce-add of that box adds exact zeros (±0) into
the next sequence's rows of the float32 workspace, which leaves every value unchanged (free: no masked reduce
path). Its last K/V box is masked like any ragged key block; dK and dV stores are masked by the sequence's length.
Staged statistics on a packed batch read lse and Δ from copies in which each sequence's rows start 16-byte aligned
(a rank-1 TMA box must start there; seqlen.padded_row_start), written by the preprocess (bwd_prep.padded_stats_kernel)
with the padding slots' lse +inf and Δ 0; a box's rows past the sequence are masked as a dense ragged tile's.
A mask_mod (one pass only; MASK_MOD) replaces the range of visited query tiles by its block mask's lists at 64-row
tiles (`one_pass_tiles`): the producer and the dQ writer walk each head's full query tiles, then its partial ones
(bwd_common._key_tile_lists), never its empty ones; the producer stores each stage's (first row, head, partial)
beside its Q, which the consumers read after the Q wait (no list state in their registers); partial tiles start Sᵀ
from the mod's -inf as the masks do.

dQ's last bits may vary run to run (the reduce-adds arrive in any order); dK and dV are deterministic.

Deterministic mode (`deterministic=True`). The writer adds a tile's dQ into dq_accum only after every key block
before its own (of the same sequence and kv head) that visits the tile has added its share, so every dq_accum
element receives its additions in increasing key-block order, the same order every run. One int32 counter per (query
head, query tile) in `semaphores` (laid out as the lse the kernel reads, at the tile's first row; the preprocess
zeroes it with dq_accum): the writer spins (acquire loads) until it equals `_contributors_before`, the number of key
blocks before this one that visit the tile (0 for the first; the blocks visiting a tile are consecutive, and the
first is the query tile's first key tile by mask.key_tile_range, so causal and right-bounded masks start at block 0
and a left window bound later), issues the reduce-adds, waits for their completion (their writes, not only their
reads), and increments the counter with release semantics. Each query head of a GQA group has its own counters. The
zero-adds a packed sequence's last box makes into the next sequence's rows commute with everything (a sum that
starts at +0 never becomes -0, so adding ±0 changes no bit), so they need no order.

Why it cannot deadlock: CTA n (program id order: a (batch, kv head)'s key blocks are consecutive and increasing,
dense and packed alike) waits only for CTAs of smaller program id. The hardware starts CTAs in program-id order,
so each of those has started, holds its SM, and itself waits only for smaller ids; by induction from the first,
which waits for none, each finishes its reduce-adds. A waiting writer holds up its own CTA's consumers at most two
tiles later (`dq_empty`), never another CTA. Cost: CTAs that start together form a chain per query tile, each
writer one counter round trip δ (a completion wait, a release, an acquire load: about a microsecond) behind its
predecessor; key block n's writer lags n·δ, and its consumers stall once that exceeds the two staged tiles (a
tile is 1-3 µs). CTAs that start later (when an SM frees) start as staggered as the chain needs, so the stall is
mostly the first wave's: about δ/(4 · a tile's time) of its time, a few per cent of one wave of many.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashmoe_science.attention import bwd_prep
from flashmoe_science.attention.features import as_features
from flashmoe_science.attention.hopper import bwd_dq_sm90, bwd_sm90_hdim256
from flashmoe_science.attention.hopper.bwd_common import (
    TWO_KERNEL_BLOCK_D,
    _cta_key_block,
    _past_work,
    _alibi_score_start,
    _contributors_before,
    _producer,
    _mask_score_start,
    _key_tile_lists,
    _listed_query_tile,
    _mod_score_start,
    _producer_barriers,
    _row_stat_base,
    _probabilities,
    _raw_probabilities,
    _score_start,
    _stage_walk_record,
    _softcap_grad,
    _staged_neg_lse_log2,
    _tile_needs_mask,
    _visited_query_tiles,
    check_features,
    feature_args,
    offline_build,
)
from flashmoe_science.attention.hopper.common import descriptor
from flashmoe_science.attention.hopper.tiles import sm90_backward_rows, sm90_backward_staged_stats
from flashmoe_science.attention.layout import bias_tma_view, needs_64bit_rows, tma_compatible
from flashmoe_science.attention.mods import (BlockMask, MaskMod, Mods, TileLists, block_mask_args,
                                             call_block_mask, clamp_index)
from flashmoe_science.attention.mods import kernel_args as mod_kernel_args
from flashmoe_science.attention.seqlen import ranked_work_list
from flashmoe_science.attention.mask import LN_2, LOG2_E
from flashmoe_science.attention.seqlen import PER_BATCH_ARGS, padded_row_start, padded_stat_rows, sequence_coords
from flashmoe_science.attention.tiles import padded_head_dim
from flashmoe_science.gluon.sm90 import (CONSUMER_REGISTERS, GL_DTYPES, LAUNCH_OPTIONS, PRODUCER_REGISTERS,
                                            column_halves, release_counter_after_bulk, wait_counter, wgmma_layout)
from flashmoe_science.gluon.compat import (TensorDescriptor, fence_async_shared, gl, gluon, mbarrier,
                                                  tma, warpgroup_mma, warpgroup_mma_wait)

KEYS_PER_CONSUMER = 64  # one wgmma M tile per consumer warpgroup
NUM_CONSUMERS = 2
BLOCK_N = KEYS_PER_CONSUMER * NUM_CONSUMERS  # keys per CTA
NUM_STAGES = 2  # Q/dO ring depth
DQ_COLS = 32  # columns per dQ reduce-add box: 32 fp32 = 128 bytes, the widest swizzled TMA box
SUPPORTED_BLOCK_D = (64, 128, TWO_KERNEL_BLOCK_D)


@gluon.jit
def _store_bias_grad(ds, dbias_args, batch, q_head, queries, keys, seqlen_q, seqlen_k, BIAS_GRAD: gl.constexpr):
    """dSᵀ (keys x queries, float32) into the bias's gradient buffer (triton_backend.bias_grad_buffer): stored
    where each element has one writer (BIAS_GRAD 1), added with float32 atomics where the bias broadcasts (2)."""
    DBIAS, stride_b, stride_h, stride_m, stride_n = dbias_args
    plane = DBIAS + batch.to(gl.int64) * stride_b + q_head.to(gl.int64) * stride_h
    ptrs = plane + queries.to(gl.int64) * stride_m + keys.to(gl.int64) * stride_n
    inside = (queries < seqlen_q) & (keys < seqlen_k)
    if BIAS_GRAD == 1:
        gl.store(ptrs, ds, mask=inside)
    else:
        gl.atomic_add(ptrs, ds, mask=inside, sem="relaxed")


@gluon.jit
def _scored_probabilities(s, lse, offs_q, offs_key, seqlen_q, seqlen_k, b, h, score_mod, score_grad, score_args,
                          qk_scale):
    """(P, d score_mod / d score) of a raw Sᵀ tile (keys x queries, -inf where a mask hides the pair): the user's
    score_mod and its derivative at score = s·scale, positions clamped into the sequence (mods.clamp_index), and
    P = exp(score_mod(score) − lse). Both functions see 0 at hidden pairs (a mod of -inf may be NaN), whose P is 0;
    queries past Lq read lse = +inf, so their P is 0 too."""
    hidden = s == float("-inf")
    score = gl.where(hidden, 0.0, s) * (qk_scale * LN_2)
    q_idx = gl.expand_dims(clamp_index(offs_q, seqlen_q), 0)
    kv_idx = gl.expand_dims(clamp_index(offs_key, seqlen_k), 1)
    x = score_mod(score, b, h, q_idx, kv_idx, *score_args) * LOG2_E - gl.expand_dims(lse * LOG2_E, 0)
    p = gl.exp2(gl.where(hidden, float("-inf"), x))
    return p, score_grad(score, b, h, q_idx, kv_idx, *score_args)


@gluon.jit
def _consumer_tile(ring, g, start_m, dk, dv, smem, barriers, operands, dq_zero, offs_key, scalars,
                   CONSUMER: gl.constexpr, ROWS: gl.constexpr, KEYS: gl.constexpr, BLOCK_D: gl.constexpr,
                   NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                   SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, HAS_BIAS: gl.constexpr, BIAS_GRAD: gl.constexpr,
                   VARLEN: gl.constexpr, STAGED: gl.constexpr, MASKED: gl.constexpr, tile_bounds=None,
                   mask_mod=None, mod_tile=None, score_mod=None, score_grad=None, score_args=None):
    """`_consumer`'s step over the query tile at `start_m` of query head g of the group (the ring's `ring`-th
    tile): returns dK_c and dV_c with the tile's products added (dK's still in flight).

    STAGED (full and causal masks, no softcap, ALiBi or attn_bias): both products start from zero (no accumulator
    moves), except a MASKED tile's score product, which starts from the mask's -inf; lse and Δ come after them,
    from the stage's shared-memory copies: −lse·log2e in the exp2's scaling FFMA, Δ in one subtraction. Otherwise
    lse, Δ and the mask ride in the products' starts, read from LSE and Delta. `tile_bounds` (full_start, full_end
    of `_visited_query_tiles`): the tile is masked where it falls outside them; None in the split loops, where
    MASKED says. `mask_mod` (not staged): the block mask's tile, `mod_tile` (bwd_common._mod_score_start), its
    partial tiles masked in the start. `score_mod` (not staged), its derivative `score_grad`, their captured
    tensors `score_args`: Sᵀ starts raw (the masks' -inf alone in it), and `_scored_probabilities` gives P and
    the derivative that scales dSᵀ."""
    q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, bias_smem = smem
    q_ready, do_ready, empty, ds_ready, dq_full, dq_empty = barriers
    my_keys, my_values, k_cols = operands
    s_layout: gl.constexpr = wgmma_layout(ROWS)
    s_zero = gl.zeros([KEYS, ROWS], gl.float32, layout=s_layout)  # built per tile: one held across it spills
    SCORE_MOD: gl.constexpr = score_mod is not None
    (batch, kv_head, num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale, inv_scale, seq, q_first, lse_rows,
     LSE, Delta, window_left, window_right, softcap_scale, Slopes, stride_slopes, dbias_args) = scalars
    dtype: gl.constexpr = q_smem.dtype
    query_slice: gl.constexpr = gl.SliceLayout(0, s_layout)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    DQ_N: gl.constexpr = dq_zero.shape[1]
    DQ_COLS: gl.constexpr = dq_smem.shape[2]
    HALF_BOXES: gl.constexpr = DQ_N // DQ_COLS  # staging boxes per consumer
    DQ_BUFFERS: gl.constexpr = dq_full.shape[0]
    diagonal = seqlen_k - seqlen_q
    q_head = batch * num_q_heads + kv_head * group_size + g  # flat (batch, query head)
    if not STAGED:
        q_row0 = _row_stat_base(q_head, q_first, seqlen_q, lse_rows, VARLEN)  # this head's first row of lse/Δ
    if ALIBI:
        slope_log2 = gl.load(Slopes + seq * stride_slopes + kv_head * group_size + g) * LOG2_E
    else:
        slope_log2 = 0.0
    stage = ring % NUM_STAGES
    phase = (ring // NUM_STAGES) & 1
    q_tile = q_smem.index(stage).reshape([ROWS, BLOCK_D])
    do_tile = do_smem.index(stage).reshape([ROWS, BLOCK_D])
    ds_buf = ds_smem.index(ring % 2)  # (BLOCK_N, ROWS): dSᵀ of both consumers

    offs_q = start_m + gl.arange(0, ROWS, layout=query_slice)
    if not STAGED:
        # lse and Δ ride in the accumulators: Sᵀ starts from -lse / scale and dPᵀ from -Δ, and so does the mask
        # (-inf where a key is hidden), built before the Q/dO wait while only dK and dV are live (per-column lse,
        # Δ and mask bounds held across the products spilled at D=128). Queries past Lq read lse = +inf: their P
        # is exactly 0 (their zero-filled Q rows give finite scores), so the ragged end needs no mask.
        if mask_mod is not None:  # the mod's -inf (after the Q wait: `_consumer`) before lse and Δ are live
            mod_start = _mod_score_start(s_zero, mod_tile, offs_q, seqlen_q, seqlen_k, diagonal, window_left,
                                         window_right, mask_mod, CAUSAL, MASK_LEFT, MASK_RIGHT)
        in_rows = offs_q < seqlen_q
        lse = gl.load(LSE + q_row0 + offs_q, mask=in_rows, other=float("inf"))
        delta = gl.load(Delta + q_row0 + offs_q, mask=in_rows, other=0.0)
    if tile_bounds is None:  # a masked or unmasked loop: MASKED says
        hide = False
    else:  # masked: causal diagonal tiles, window edges, and every tile of a CTA whose keys run past Lk
        hide = _tile_needs_mask(start_m, tile_bounds[0], tile_bounds[1], True, MASK_LEFT or MASK_RIGHT)
    queries = gl.expand_dims(offs_q, 0)
    keys = gl.expand_dims(offs_key, 1)
    if STAGED:
        s_init = _mask_score_start(s_zero, queries, keys, MASKED, seqlen_k, diagonal, window_left, window_right,
                                   CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP)
    else:
        if SCORE_MOD:  # the mod is not linear: lse comes after it (mods refuse softcap, ALiBi and a bias beside it)
            s_init = _mask_score_start(s_zero, queries, keys, hide, seqlen_k, diagonal, window_left, window_right,
                                       CAUSAL, MASK_LEFT, MASK_RIGHT, False)
        else:
            s_init = _score_start(s_zero, lse, inv_scale, queries, keys, hide, seqlen_k, diagonal, window_left,
                                  window_right, 0, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP)
            s_init = _alibi_score_start(s_init, queries, keys, diagonal, slope_log2 / qk_scale,
                                        ALIBI and not SOFTCAP)
        if mask_mod is not None:
            if mod_tile[0]:
                s_init = gl.where(mod_start == float("-inf"), float("-inf"), s_init)
        dp_init = s_zero - gl.expand_dims(delta, 0)
    mbarrier.wait(q_ready.index(stage), phase)
    if HAS_BIAS:  # (keys, queries) of the (queries, CTA keys) tile
        bias_t = bias_smem.index(stage).reshape([ROWS, 2 * KEYS]).slice(CONSUMER * KEYS, KEYS, dim=1)
        s_init = s_init + bias_t.permute((1, 0)).load(s_layout).to(gl.float32) * inv_scale
    if STAGED and not MASKED:
        s = warpgroup_mma(my_keys, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    else:
        s = warpgroup_mma(my_keys, q_tile.permute((1, 0)), s_init, is_async=True)
    mbarrier.wait(do_ready.index(stage), phase)
    if STAGED:
        dp = warpgroup_mma(my_values, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    else:
        dp = warpgroup_mma(my_values, do_tile.permute((1, 0)), dp_init, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))
    if STAGED:
        neg_lse_log2 = _staged_neg_lse_log2(lse_smem.index(stage), start_m, seqlen_q, query_slice, MASKED, hide)
        p = _raw_probabilities(s, neg_lse_log2, queries, keys, seqlen_k, diagonal, qk_scale, 0, CAUSAL, hide)
        t = s  # the softcap's tanh: no softcap here
        delta = delta_smem.index(stage).load(query_slice)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = p * (dp - gl.expand_dims(delta, 0))
    elif SCORE_MOD:
        p, t = _scored_probabilities(s, lse, offs_q, offs_key, seqlen_q, seqlen_k, seq, kv_head * group_size + g,
                                     score_mod, score_grad, score_args, qk_scale)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = p * dp * t  # t: the mod's derivative at each score
    else:
        p, t = _probabilities(s, lse, queries, keys, hide, seqlen_k, diagonal, window_left, window_right,
                              qk_scale, softcap_scale, slope_log2, 0, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                              ALIBI and SOFTCAP)  # without a softcap ALiBi rode in s_init
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds = p * dp
    if BIAS_GRAD != 0:  # the bias is added to the scores as is: its gradient is dS
        _store_bias_grad(ds, dbias_args, batch, q_head - batch * num_q_heads, queries, keys, seqlen_q, seqlen_k,
                         BIAS_GRAD)
    ds = _softcap_grad(ds, t, SOFTCAP).to(dtype)
    dv = warpgroup_mma(gl.convert_layout(p.to(dtype), a_layout), do_tile, dv, is_async=True)
    ds_buf.slice(CONSUMER * KEYS, KEYS).store(ds)
    fence_async_shared()  # the dSᵀ rows (generic proxy) before the wgmma (async proxy) reads them
    # Gluon's arrive syncs the warpgroup before one thread arrives: every warp's rows are written
    mbarrier.arrive(ds_ready.index(ring % 2), count=1)
    mbarrier.wait(ds_ready.index(ring % 2), (ring // 2) & 1)  # the other consumer's rows too
    # dQ before dK: wgmma groups complete in order, so waiting for dQ alone leaves dK running under the dQ
    # staging stores below
    dq = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
    dk = warpgroup_mma(gl.convert_layout(ds, a_layout), q_tile, dk, is_async=True)
    dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))

    # dQ half -> this tile's staging buffer, one box per DQ_COLS columns; the dQ writer adds it into dq_accum.
    # The buffer was last used DQ_BUFFERS tiles ago: its reduce-adds have long read it (first pass: free).
    buf = ring % DQ_BUFFERS
    mbarrier.wait(dq_empty.index(buf), ((ring // DQ_BUFFERS) & 1) ^ 1)
    # one store of the (boxes, rows, columns) view: two stores would each take a warpgroup barrier (the compiler
    # cannot tell the boxes of a dynamically indexed buffer apart)
    boxes = dq.reshape([ROWS, HALF_BOXES, DQ_COLS]).permute((1, 0, 2)).reshape([HALF_BOXES * ROWS, DQ_COLS])
    dq_smem.index(buf * 2 + CONSUMER).store(boxes)
    fence_async_shared()  # the rows (generic proxy) before the writer's TMA (async proxy) reads them
    mbarrier.arrive(dq_full.index(buf), count=1)
    dk = warpgroup_mma_wait(0, deps=(dk,))
    mbarrier.arrive(empty.index(stage), count=1)  # Q and dO are no longer read
    return dk, dv


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready, empty, ds_ready,
              dq_full, dq_empty, dq_desc, LSE, Delta, lse_smem, delta_smem, DK, DV, stride_dkb, stride_dkh,
              stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              start_n, batch, kv_head, num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
              seq, q_first, k_first, lse_rows, window_left, window_right, softcap_scale, Slopes, stride_slopes,
              bias_smem, dbias_args, mask_mod, mask_args, block_lists, walk_smem, score_mod, score_grad, score_args,
              CONSUMER: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, ROWS: gl.constexpr,
              KEYS: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr,
              MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr,
              HAS_BIAS: gl.constexpr, BIAS_GRAD: gl.constexpr, STAGED: gl.constexpr, MASK_MOD: gl.constexpr):
    """One consumer warpgroup: keys [start_n + CONSUMER·KEYS, +KEYS), all query tiles of all heads of the group.
    Positions are relative to sequence `seq`'s first rows (q_first, k_first; lse_rows: the lse tensor's rows per
    head, read with VARLEN only). STAGED: each stage's lse and Δ arrive in `lse_smem` and `delta_smem` with its Q
    and dO (`tiles.sm90_backward_staged_stats`); else they are read from LSE and Delta.

    HAS_BIAS: the stage's bias tile (`bias_smem`, queries x the CTA's keys, landed with Q) joins the Sᵀ
    accumulator's start as bias / scale (it is linear, like lse); BIAS_GRAD (1: store, 2: float32 atomic add)
    writes dS, the bias's gradient, at `dbias_args` (base, batch/head/query/key strides).

    MASK_MOD: the query tiles are the block mask's (bwd_common._key_tile_lists: full ones, unmasked, then partial
    ones, masked with the mask_mod, its captured tensors `mask_args`), counted from the lists, each read from the
    stage's record in `walk_smem` (first row, 2·g + partial) that the producer stored before arming Q's barrier.
    `score_mod` (None without one), `score_grad`, `score_args`: the user's score_mod, its derivative and their
    captured tensors, on every visited tile (`_scored_probabilities`)."""
    dtype: gl.constexpr = q_smem.dtype
    DQ_N: gl.constexpr = BLOCK_D // 2  # this consumer's dQ columns
    # Sᵀ, dPᵀ: (keys, queries); dK, dV: (keys, BLOCK_D); dQ half: (queries, DQ_N). Warps stacked on the rows.
    s_layout: gl.constexpr = wgmma_layout(ROWS)
    kv_layout: gl.constexpr = wgmma_layout(BLOCK_D)
    dq_layout: gl.constexpr = wgmma_layout(DQ_N)
    key_slice: gl.constexpr = gl.SliceLayout(1, s_layout)

    my_start_n = start_n + CONSUMER * KEYS
    query_start, num_tiles, full_start, full_end = _visited_query_tiles(
        start_n, seqlen_q, seqlen_k, window_left, window_right, ROWS, 2 * KEYS, CAUSAL, MASK_LEFT, MASK_RIGHT)
    dk = gl.zeros([KEYS, BLOCK_D], gl.float32, layout=kv_layout)
    dv = gl.zeros([KEYS, BLOCK_D], gl.float32, layout=kv_layout)
    smem = (q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, bias_smem)
    barriers = (q_ready, do_ready, empty, ds_ready, dq_full, dq_empty)
    operands = (k_smem.slice(CONSUMER * KEYS, KEYS), v_smem.slice(CONSUMER * KEYS, KEYS),
                k_smem.slice(CONSUMER * DQ_N, DQ_N, dim=1))  # K_c, V_c, and B of this consumer's dQ half
    dq_zero = gl.zeros([ROWS, DQ_N], gl.float32, layout=dq_layout)
    offs_key = my_start_n + gl.arange(0, KEYS, layout=key_slice)
    scalars = (batch, kv_head, num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale, 1.0 / sm_scale, seq, q_first,
               lse_rows, LSE, Delta, window_left, window_right, softcap_scale, Slopes, stride_slopes, dbias_args)
    # With staged statistics under a causal mask, each head's visited tiles run in two loops, masked (the diagonal,
    # and every tile of a CTA whose keys run past Lk) then unmasked: the unmasked loop carries no mask arithmetic
    # and no index vectors, and the masked one starts Sᵀ from the mask. Otherwise one loop, the mask chosen per tile.
    gl.static_assert(not STAGED or not (SOFTCAP or ALIBI or HAS_BIAS or MASK_LEFT or MASK_RIGHT),
                     "staged statistics take full and causal masks only (tiles.sm90_backward_staged_stats)")
    SPLIT: gl.constexpr = STAGED and CAUSAL
    mbarrier.wait(kv_ready, 0)
    if SPLIT:
        masked_end = gl.minimum(gl.maximum(gl.cdiv(full_start - query_start, ROWS), 0), num_tiles)
        ring = 0
        for g in range(group_size):
            for tile in range(0, masked_end):
                dk, dv = _consumer_tile(ring, g, query_start + tile * ROWS, dk, dv, smem, barriers, operands,
                                        dq_zero, offs_key, scalars, CONSUMER, ROWS, KEYS, BLOCK_D, NUM_STAGES,
                                        CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_BIAS, BIAS_GRAD, VARLEN,
                                        STAGED, True)
                ring += 1
            for tile in range(masked_end, num_tiles):
                dk, dv = _consumer_tile(ring, g, query_start + tile * ROWS, dk, dv, smem, barriers, operands,
                                        dq_zero, offs_key, scalars, CONSUMER, ROWS, KEYS, BLOCK_D, NUM_STAGES,
                                        CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_BIAS, BIAS_GRAD, VARLEN,
                                        STAGED, False)
                ring += 1
    elif MASK_MOD:
        total = 0
        for g in range(group_size):
            total += _key_tile_lists(block_lists, g)[3]
        for ring in range(total):
            mbarrier.wait(q_ready.index(ring % NUM_STAGES), (ring // NUM_STAGES) & 1)
            start_m, code = _stage_walk_record(walk_smem, ring % NUM_STAGES, 4)
            g = code // 2
            mod_tile = ((code & 1) != 0, seq, kv_head * group_size + g, my_start_n, mask_args)
            dk, dv = _consumer_tile(ring, g, start_m, dk, dv, smem, barriers, operands, dq_zero, offs_key,
                                    scalars, CONSUMER, ROWS, KEYS, BLOCK_D, NUM_STAGES, CAUSAL, MASK_LEFT,
                                    MASK_RIGHT, SOFTCAP, ALIBI, HAS_BIAS, BIAS_GRAD, VARLEN, STAGED, False, None,
                                    mask_mod, mod_tile, score_mod, score_grad, score_args)
    else:
        for ring in range(group_size * num_tiles):
            g = ring // num_tiles
            start_m = query_start + (ring - g * num_tiles) * ROWS
            dk, dv = _consumer_tile(ring, g, start_m, dk, dv, smem, barriers, operands, dq_zero, offs_key, scalars,
                                    CONSUMER, ROWS, KEYS, BLOCK_D, NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT,
                                    SOFTCAP, ALIBI, HAS_BIAS, BIAS_GRAD, VARLEN, STAGED, False,
                                    (full_start, full_end), None, None, score_mod, score_grad, score_args)

    dk = dk * sm_scale
    acc_rows: gl.constexpr = gl.SliceLayout(1, kv_layout)
    acc_cols: gl.constexpr = gl.SliceLayout(0, kv_layout)
    rows = my_start_n + gl.arange(0, KEYS, layout=acc_rows)
    cols = gl.arange(0, BLOCK_D, layout=acc_cols)
    mask = gl.expand_dims(rows < seqlen_k, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
    rows = k_first + rows  # a packed sequence's rows
    dk_ptrs = (DK + batch.to(gl.int64) * stride_dkb + kv_head.to(gl.int64) * stride_dkh
               + gl.expand_dims(rows.to(gl.int64) * stride_dkn, 1) + gl.expand_dims(cols, 0))
    gl.store(dk_ptrs, dk.to(dtype), mask=mask)
    dv_ptrs = (DV + batch.to(gl.int64) * stride_dvb + kv_head.to(gl.int64) * stride_dvh
               + gl.expand_dims(rows.to(gl.int64) * stride_dvn, 1) + gl.expand_dims(cols, 0))
    gl.store(dv_ptrs, dv.to(dtype), mask=mask)


@gluon.jit
def _dq_writer(dq_desc, dq_smem, dq_full, dq_empty, Semaphores, start_n, batch, kv_head, num_q_heads, group_size,
               seqlen_q, seqlen_k, q_first, stat_first, lse_rows, window_left, window_right, block_lists,
               CTA_KEYS: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
               VARLEN: gl.constexpr, DETERMINISTIC: gl.constexpr, MASK_MOD: gl.constexpr):
    """The dQ writer (one warp): per query tile, in the consumers' order, wait until both consumers' dQ halves are
    in the tile's staging buffer (`dq_full`), add them into dq_accum with one TMA reduce-add per box (rows past
    Lq are clipped by the TMA unit), wait until the TMA unit has read the buffer and hand it back (`dq_empty`).
    MASK_MOD: the tiles are each head's of the block mask's lists, as the consumers walk them.

    DETERMINISTIC: before the reduce-adds of (query head, query tile), wait until its counter in `Semaphores` (the
    per-row tensor laid out as lse, read at the tile's first row, stat_first + the tile's; zeroed by the preprocess)
    equals the number of key blocks before this CTA's that visit the tile (`_contributors_before`); after them,
    wait until they are complete (not only read) and increment the counter with release semantics. Each dq_accum
    element then receives its additions in increasing key-block order, every run alike (see the module docstring
    for why this cannot deadlock)."""
    ROWS: gl.constexpr = dq_desc.block_type.shape[1]
    if MASK_MOD:
        ring = 0
        for g in range(group_size):
            head_lists = _key_tile_lists(block_lists, g)
            for i in range(head_lists[3]):
                start_m, _ = _listed_query_tile(head_lists, i, ROWS)
                _add_dq_tile(dq_desc, dq_smem, dq_full, dq_empty, Semaphores, ring, batch * num_q_heads
                             + kv_head * group_size + g, start_m, start_n, seqlen_q, seqlen_k, q_first, stat_first,
                             lse_rows, window_left, window_right, CTA_KEYS, MASK_LEFT, MASK_RIGHT, VARLEN, False)
                ring += 1
    else:
        query_start, num_tiles, _, _ = _visited_query_tiles(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                                            ROWS, CTA_KEYS, CAUSAL, MASK_LEFT, MASK_RIGHT)
        for ring in range(group_size * num_tiles):
            g = ring // num_tiles
            start_m = query_start + (ring - g * num_tiles) * ROWS
            _add_dq_tile(dq_desc, dq_smem, dq_full, dq_empty, Semaphores, ring, batch * num_q_heads
                         + kv_head * group_size + g, start_m, start_n, seqlen_q, seqlen_k, q_first, stat_first,
                         lse_rows, window_left, window_right, CTA_KEYS, MASK_LEFT, MASK_RIGHT, VARLEN, DETERMINISTIC)
    tma.store_wait(0)


@gluon.jit
def _add_dq_tile(dq_desc, dq_smem, dq_full, dq_empty, Semaphores, ring, q_head, start_m, start_n, seqlen_q,
                 seqlen_k, q_first, stat_first, lse_rows, window_left, window_right, CTA_KEYS: gl.constexpr,
                 MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
                 DETERMINISTIC: gl.constexpr):
    """`_dq_writer`'s step for ring position `ring`: the query tile at `start_m` of flat query head `q_head`."""
    ROWS: gl.constexpr = dq_desc.block_type.shape[1]
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[2]
    DQ_BUFFERS: gl.constexpr = dq_full.shape[0]
    HALF_BOXES: gl.constexpr = dq_smem.shape[1] // ROWS  # boxes of one consumer's half
    buf = ring % DQ_BUFFERS
    mbarrier.wait(dq_full.index(buf), (ring // DQ_BUFFERS) & 1)
    if DETERMINISTIC:
        counter = Semaphores + _row_stat_base(q_head, stat_first, seqlen_q, lse_rows, VARLEN) + start_m
        wait_counter(counter, _contributors_before(start_n, start_m, seqlen_q, seqlen_k, window_left,
                                                   window_right, ROWS, CTA_KEYS, MASK_LEFT, MASK_RIGHT))
    for half in gl.static_range(2):
        for box in gl.static_range(HALF_BOXES):
            tma.async_atomic_add(dq_desc, [q_head, q_first + start_m, (half * HALF_BOXES + box) * DQ_COLS],
                                 dq_smem.index(buf * 2 + half).reshape([HALF_BOXES, ROWS, DQ_COLS]).slice(box, 1))
    if DETERMINISTIC:
        release_counter_after_bulk(counter)
    else:
        tma.store_wait(0)  # the boxes are read: the buffer may be overwritten
    mbarrier.arrive(dq_empty.index(buf), count=1)


@gluon.jit(do_not_specialize=PER_BATCH_ARGS)
def attention_backward_sm90_kernel(
    q_desc, do_desc, k_desc, v_desc, dq_desc, LSE, Delta, DK, DV, Semaphores,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    num_q_heads, num_kv_heads, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
    Slopes, CuSeqlensQ, CuSeqlensK, WorkTiles, num_seqs, stride_slopes, lse_rows, window_left, window_right,
    softcap_scale,
    bias_desc, bias_step_b, bias_step_h, DBIAS, stride_dbias_b, stride_dbias_h, stride_dbias_m, stride_dbias_n,
    mask_mod, mask_args, PARTIAL_COUNTS, PARTIAL_TILES, FULL_COUNTS, FULL_TILES, list_len, mod_k_tiles,
    score_mod, score_grad, score_args,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
    VARLEN: gl.constexpr, HAS_BIAS: gl.constexpr = False, BIAS_GRAD: gl.constexpr = 0,
    DETERMINISTIC: gl.constexpr = False, DQ_BUFFERS: gl.constexpr = 2, STAGED_STATS: gl.constexpr = False,
    MASK_MOD: gl.constexpr = False, SCORE_MOD: gl.constexpr = False,
):
    """Grid (cdiv(Lk, 128) · B·Hkv,); CTAs start roughly in program order, and a (batch, kv head)'s key tiles are
    consecutive, so the CTAs running at once share a few heads' Q and dO in L2. (Ordering causal CTAs longest
    first, in bands of 4-16 heads or over all heads, measured no faster or up to 20% slower: perf-notes.)

    The arguments after sm_scale are the features' (bwd_common.feature_args). VARLEN: one program per real key
    block of every (sequence, kv head) (WorkTiles, the work list of cu_seqlens_k); seqlen_q/k are the maxima.
    HAS_BIAS (dense batches): a bias read by TMA through bias_desc (boxes of 64 queries x the CTA's keys;
    bias_step_b/h the batch and head steps of its coordinate, 0 where it broadcasts); BIAS_GRAD: its gradient into
    DBIAS (see _store_bias_grad). DETERMINISTIC: dQ's reduce-adds in key-block order through the int32 counters
    `Semaphores` (laid out as LSE, zeroed); DQ_BUFFERS: dQ staging buffers (2; 1 where shared memory is short).
    STAGED_STATS: LSE and Delta are rank-1 TMA descriptors, read by the producer with each Q/dO stage
    (`tiles.sm90_backward_staged_stats`); else float32 pointers the consumers read. A packed batch's staged
    statistics and counters are (1, Hq, lse_rows) in the padded layout (seqlen.padded_row_start: each sequence's
    rows start 16-byte aligned, where a rank-1 box must begin), written by bwd_prep.padded_stats_kernel.
    MASK_MOD: the user's `mask_mod` (a `@triton.jit` function) with its captured tensors `mask_args`, and its block
    mask at ROWS x CTA_KEYS tiles by key tile (mods.block_mask_args(by_key=True); mod_k_tiles key tiles per (b, h)):
    the producer and the dQ writer walk each head's full, then partial query tiles, the consumers take them from the
    producer's per-stage records (`_consumer`). SCORE_MOD: the user's `score_mod`, its derivative `score_grad` and
    their captured tensors `score_args` on every visited score (the tiles walked as without it; 64-row query tiles,
    `one_pass_tiles`). Arguments a call does not use are None
    (constexpr: a call without a mod compiles to the kernel without one)."""
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    CTA_KEYS: gl.constexpr = k_desc.block_type.shape[2]
    KEYS: gl.constexpr = CTA_KEYS // 2
    DQ_N: gl.constexpr = BLOCK_D // 2
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[2]
    if _past_work(WorkTiles, num_kv_heads, VARLEN):
        return
    start_n, seq, kv_head = _cta_key_block(seqlen_k, num_kv_heads, WorkTiles, CTA_KEYS, VARLEN)
    batch, q_first, seqlen_q, k_first, seqlen_k = sequence_coords(CuSeqlensQ, CuSeqlensK, seq, seqlen_q, seqlen_k,
                                                                  VARLEN)
    if VARLEN and STAGED_STATS:  # the per-row tensors' padded layout: each sequence's rows start 16-byte aligned
        stat_first = padded_row_start(q_first, seq)
    else:
        stat_first = q_first

    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_box = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_box = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    k_smem = k_box.reshape([CTA_KEYS, BLOCK_D])
    v_smem = v_box.reshape([CTA_KEYS, BLOCK_D])
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CTA_KEYS, ROWS], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, CTA_KEYS, ROWS], ds_layout)
    # dQ staging: per buffer, consumer 0's half then consumer 1's, each its boxes of ROWS x DQ_COLS stacked
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, DQ_COLS], gl.float32)  # dq_desc's box
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS * 2, DQ_N // DQ_COLS * ROWS, DQ_COLS], dq_layout)
    if STAGED_STATS:  # each stage's lse and Δ (rank-1 boxes of its rows), beside its Q and dO
        lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, ROWS], LSE.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, ROWS], Delta.layout)
        stats = (LSE, Delta, lse_smem, delta_smem, num_q_heads, lse_rows, stat_first)
    else:
        lse_smem: gl.constexpr = None
        delta_smem: gl.constexpr = None
        stats: gl.constexpr = None
    kv_ready, q_ready, do_ready, empty = _producer_barriers(NUM_STAGES)
    if HAS_BIAS:  # one bias tile per Q/dO stage
        bias_smem = gl.allocate_shared_memory(bias_desc.dtype, [NUM_STAGES] + bias_desc.block_type.shape,
                                              bias_desc.layout)
    else:
        bias_smem: gl.constexpr = None
    dbias_args = (DBIAS, stride_dbias_b, stride_dbias_h, stride_dbias_m, stride_dbias_n)
    if MASK_MOD:  # the rows of the group's first query head in the block mask's lists, then one per key tile
        gl.static_assert(not (STAGED_STATS or SOFTCAP or ALIBI or HAS_BIAS or DETERMINISTIC),
                         "a mask_mod runs beside causal, a window and varlen only (mods.check_mods, mod_refusal)")
        first_row = (seq * num_q_heads + kv_head * group_size).to(gl.int64) * mod_k_tiles + start_n // CTA_KEYS
        block_lists = (PARTIAL_COUNTS, PARTIAL_TILES, FULL_COUNTS, FULL_TILES, list_len, first_row, mod_k_tiles)
        # each stage's (first row, 2·g + partial), from the producer's walk: the consumers walk no lists
        walk_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, 2], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        block_lists: gl.constexpr = None
        walk_smem: gl.constexpr = None
    if SCORE_MOD:
        gl.static_assert(not (STAGED_STATS or SOFTCAP or ALIBI or HAS_BIAS),
                         "a score_mod runs beside causal, a window, varlen and a mask_mod only (mods.check_mods)")
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both consumers' dSᵀ rows are in the buffer
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(DQ_BUFFERS):
        mbarrier.init(dq_full.index(i), count=2)  # both consumers' halves are staged
        mbarrier.init(dq_empty.index(i), count=1)  # the writer's reduce-adds have read them

    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready, empty,
                     ds_ready, dq_full, dq_empty, dq_desc, LSE, Delta, lse_smem, delta_smem, DK, DV, stride_dkb,
                     stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, start_n, batch, kv_head,
                     num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale, seq, q_first, k_first,
                     lse_rows, window_left, window_right, softcap_scale, Slopes, stride_slopes, bias_smem, dbias_args,
                     mask_mod, mask_args, block_lists, walk_smem, score_mod, score_grad, score_args, 0, HEAD_DIM,
                     BLOCK_D, ROWS, KEYS, NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, VARLEN,
                     HAS_BIAS, BIAS_GRAD, STAGED_STATS, MASK_MOD)),
        (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready, empty,
                     ds_ready, dq_full, dq_empty, dq_desc, LSE, Delta, lse_smem, delta_smem, DK, DV, stride_dkb,
                     stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, start_n, batch, kv_head,
                     num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale, seq, q_first, k_first,
                     lse_rows, window_left, window_right, softcap_scale, Slopes, stride_slopes, bias_smem, dbias_args,
                     mask_mod, mask_args, block_lists, walk_smem, score_mod, score_grad, score_args, 1, HEAD_DIM,
                     BLOCK_D, ROWS, KEYS, NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, VARLEN,
                     HAS_BIAS, BIAS_GRAD, STAGED_STATS, MASK_MOD)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_box, v_box,
                     kv_ready, q_ready, do_ready, empty, start_n, batch, kv_head, group_size, seqlen_q, seqlen_k,
                     q_first, k_first, window_left, window_right, NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT,
                     bias_desc, bias_smem, bias_step_b, bias_step_h, HAS_BIAS,
                     stats, STAGED_STATS, VARLEN, block_lists, MASK_MOD, walk_smem)),
        (_dq_writer, (dq_desc, dq_smem, dq_full, dq_empty, Semaphores, start_n, batch, kv_head, num_q_heads,
                      group_size, seqlen_q, seqlen_k, q_first, stat_first, lse_rows, window_left, window_right,
                      block_lists, CTA_KEYS, CAUSAL, MASK_LEFT, MASK_RIGHT, VARLEN, DETERMINISTIC, MASK_MOD)),
    ], [4, 1, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS, PRODUCER_REGISTERS])


def _dq_accum_descriptor(dq_accum: torch.Tensor, rows: int) -> TensorDescriptor:
    """The reduce-add target: dq_accum seen as (B·Hq, Lq, BLOCK_D) float32, boxes of (1, rows, DQ_COLS) (a query
    tile's rows past Lq fall outside the box's head and are dropped)."""
    flat = dq_accum.view(-1, *dq_accum.shape[-2:])
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=flat, shape=list(flat.shape), strides=list(flat.stride()),
                         block_shape=[1, rows, DQ_COLS], padding="zero",
                         layout=gl.NVMMASharedLayout.get_default_for([1, rows, DQ_COLS], gl.float32))
    return desc


def is_deterministic(head_dim: int) -> bool:
    """Whether attention_backward_sm90's gradients are bit-identical run to run at this head dim without being asked
    (`deterministic=False`): the two-kernel path (padded 256) is; the one-pass kernel's dQ reduce-adds land in any
    order unless `deterministic` orders them."""
    return padded_head_dim(head_dim) == TWO_KERNEL_BLOCK_D


def check_supported(q: torch.Tensor, softmax_scale: float = 1.0) -> None:
    """Raise ValueError for what this kernel does not run (the caller falls back to triton/bwd.py)."""
    if not softmax_scale > 0:
        raise ValueError(f"the sm_90 backward needs a positive softmax_scale (its masks are -inf scores), got "
                         f"{softmax_scale}")
    if q.dtype not in GL_DTYPES:
        raise ValueError(f"the sm_90 backward runs bf16/fp16 only, got {q.dtype}")
    if padded_head_dim(q.shape[-1]) not in SUPPORTED_BLOCK_D:
        raise ValueError(f"the sm_90 backward runs head dims padding to {SUPPORTED_BLOCK_D}, got {q.shape[-1]}")


def attention_backward_sm90(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale: float,
                            dq_accum=None, num_stages: int | None = None, dbias=None, dbias_atomic: bool = False,
                            deterministic: bool = False):
    """triton.bwd.attention_backward's conventions, all three gradients wanted: q/out/grad_out/dq `(B, Hq, Lq, D)`,
    k/v/dk/dv `(B, Hkv, Lk, D)` with unit last stride and TMA-compatible strides (layout.tma_compatible of q, k,
    v, grad_out: the caller checks), lse the forward's contiguous float32 `(B, Hq, Lq)`, delta a float32 workspace
    of lse's shape (unused where a packed call stages its statistics: their padded copies, `padded_stats`). Writes
    dq, dk, dv in place; returns the compiled kernels by name.

    features: a `features.CallFeatures` (or the causal bool): window, softcap, ALiBi slopes and varlen (the tensors
    then (1, H, total rows, D), lse (1, Hq, total rows)); attn_bias on the one-pass kernel only, dense, without a
    softcap, where `layout.bias_tma_view` holds (`check_bias`). `dbias`: with a bias, the float32 buffer of
    triton.backend.bias_grad_buffer that receives dS (added with atomics where `dbias_atomic`), or None.

    Head dims padding to 64 or 128: this module's one-pass kernel, with dq_accum a contiguous float32
    `(B, Hq, Lq, padded_head_dim(D))` workspace (any contents: the preprocess zeroes it; allocated here if None);
    `deterministic`: its dQ reduce-adds in key-block order (bit-identical dQ run to run; no attn_bias gradient
    with broadcast dims, whose float32 atomics are not ordered: the caller checks).
    Padding to 256: two kernels, bwd_sm90_hdim256 (dK, dV) then bwd_dq_sm90 (dQ, written directly: no dq_accum,
    and deterministic). num_stages: the Q/dO ring depth of the dK/dV kernel (None: its default)."""
    check_supported(q, softmax_scale)
    features = as_features(features)
    block_d = padded_head_dim(q.shape[-1])
    split = block_d == TWO_KERNEL_BLOCK_D
    if split or features.attn_bias is None:
        check_features(features)
    else:
        check_bias(features, q, k)
    why = mod_refusal(features, q.shape[-1], deterministic)
    if why is not None:
        raise ValueError(f"the sm_90 backward: {why}")
    if q.shape[2] == 0 or k.shape[2] == 0:  # a packed batch of empty sequences: no TMA box over no rows
        for grad in (dq, dk, dv):
            grad.zero_()
        return {}
    if dq_accum is None and not split:
        dq_accum = torch.empty(*q.shape[:3], block_d, dtype=torch.float32, device=q.device)
    padded = None if split else padded_stats(q, lse, delta, features)
    semaphores = None
    if deterministic and not split:
        semaphores = torch.empty(_row_stats_shape(lse, padded), dtype=torch.int32, device=q.device)
    if split:
        kernel, grid, bound, options, _ = _preprocess_launch(q, out, grad_out, delta, dq, None)
        kernels = {"preprocess": kernel[grid](**bound, **options)}
        kernels["dkdv"] = bwd_sm90_hdim256.launch(q, k, v, lse, grad_out, delta, dk, dv, features, softmax_scale,
                                                  num_stages or bwd_sm90_hdim256.NUM_STAGES)
        kernels["dq"] = bwd_dq_sm90.launch(q, k, v, lse, grad_out, delta, dq, features, softmax_scale)
        return kernels
    blocks = call_block_mask(q, k, features, *one_pass_tiles(q.shape[-1], features))
    return {name: kernel[grid](**bound, **options) for name, (kernel, grid, bound, options, _) in _one_pass_launches(
        q, k, v, out, lse, grad_out, delta, dq, dk, dv, dq_accum, features, softmax_scale, num_stages,
        dbias, dbias_atomic, semaphores, padded, blocks).items()}


def bias_refusal(features, q, k) -> str | None:
    """Why the sm_90 backward does not take this call's attn_bias, or None: its one-pass kernel (head dims up to
    128) reads the bias by TMA only (`layout.bias_tma_view`; 16-bit above D=64, where a float32 ring does not
    fit), of dense batches, and adds it to the product's start, which a softcap's tanh would not let through."""
    bias = features.attn_bias
    if padded_head_dim(q.shape[-1]) == TWO_KERNEL_BLOCK_D:
        return "it takes attn_bias at head dims up to 128 (its one-pass kernel)"
    if features.varlen is not None:
        return "it takes attn_bias with dense batches only"
    if features.mask.softcap > 0:
        return "it adds attn_bias before the softcap's tanh would be applied"
    if bias.element_size() > 2 and padded_head_dim(q.shape[-1]) > 64:
        # the bias ring (NUM_STAGES boxes of 64 x BLOCK_N) beside Q, dO, K, V and the dS/dQ buffers: 229904
        # bytes with a 16-bit bias at D=128 (offline build), 32 KiB more than sm_90's 232448 with a float32 one
        return "a float32 attn_bias's tiles do not fit its shared memory at head dims above 64"
    if bias_tma_view(bias, q.shape[2], k.shape[2]) is None:
        return "it reads attn_bias by TMA only (query and key dims of its own, 16-byte aligned rows)"
    return None


def mod_refusal(features, head_dim: int, deterministic: bool = False) -> str | None:
    """Why the sm_90 backward does not take this call's mods, or None (none, or a mask_mod it runs): its one-pass
    kernel (head dims up to 128) walks a mask_mod's block mask and applies a score_mod beside causal, a window and
    varlen (as the sm_90 forward; softcap, ALiBi and attn_bias beside a mod are refused by mods.check_mods); a
    mask_mod not `deterministic`, whose ordered dQ adds count the key blocks before each one as a run, where a
    block mask's visitors of a query tile may have gaps."""
    mods = features.mods
    if mods is None:
        return None
    if padded_head_dim(head_dim) == TWO_KERNEL_BLOCK_D:
        return "it takes mask_mod and score_mod at head dims up to 128 (its one-pass kernel)"
    if deterministic and mods.mask is not None:
        return "its deterministic dQ adds wait for runs of key blocks, and a mask_mod's need not be runs"
    return None


def check_bias(features, q, k) -> None:
    """Raise ValueError where `bias_refusal` refuses the call's attn_bias (the caller runs triton/bwd.py instead)."""
    why = bias_refusal(features, q, k)
    if why is not None:
        raise ValueError(f"the sm_90 backward: {why}")


def _preprocess_launch(q, out, grad_out, delta, dq, dq_accum, semaphores=None):
    """bwd_prep's preprocess (delta = rowsum(dO * O); dq_accum and the deterministic mode's counters zeroed unless
    None) as (kernel, grid, parameters by name, options, the names of its tensor parameters)."""
    return (*bwd_prep.preprocess_launch(out, grad_out, delta, dq_accum, needs_64bit_rows(q, out, grad_out, dq),
                                        semaphores),
            ("out", "grad_out", "delta", "dq_accum") + (() if semaphores is None else ("semaphores",)))


def _one_pass_launches(q, k, v, out, lse, grad_out, delta, dq, dk, dv, dq_accum, features, softmax_scale: float,
                       num_stages: int | None, dbias=None, dbias_atomic: bool = False, semaphores=None, padded=None,
                       blocks=None):
    """The one-pass path's three launches (head dims padding to 64 or 128), by name, in order: (kernel, grid, every
    parameter by name, launch options, the names of its leading parameters that are tensors or descriptors over
    them). Written once for attention_backward_sm90 and PreparedBackward. `semaphores`: the deterministic mode's
    int32 counters (`_row_stats_shape`), or None for the default mode. `padded`: a packed batch's staged statistics
    (`padded_stats`), which its preprocess writes and its main kernel reads, or None. `blocks`: a mask_mod's block
    mask at the launch's tiles (`one_pass_tiles`; mods.call_block_mask), None without one."""
    num_q_heads, head_dim = q.shape[1], q.shape[3]
    num_kv_heads = k.shape[1]
    features = as_features(features)
    staged = _staged(q, lse, delta, features)
    if (padded is not None) != (features.varlen is not None and staged):
        raise ValueError("padded: a packed call's staged statistics (padded_stats) exactly where it stages them")
    stat_rows = None if padded is None else padded[0].shape[-1]
    tail, flags, (programs, seqlen_q, seqlen_k, qk_scale) = feature_args(features, softmax_scale, q, k, BLOCK_N,
                                                                         lse_rows=stat_rows)
    block_d = padded_head_dim(head_dim)
    num_stages = num_stages or NUM_STAGES
    rows = one_pass_tiles(head_dim, features, num_stages)[0]
    stats, stat_names = ((lse, delta), ("lse", "delta")) if padded is None else (padded, PADDED_STATS)
    main = attention_backward_sm90_kernel
    mod_args = _mod_args(features, blocks, rows)
    main_args = (*_one_pass_tensor_args(block_d, rows, q, grad_out, k, v, dq_accum, *stats, dk, dv, staged),
                 semaphores, *dk.stride()[:3], *dv.stride()[:3], num_q_heads, num_kv_heads,
                 num_q_heads // num_kv_heads, seqlen_q, seqlen_k, qk_scale, softmax_scale, *tail,
                 *_bias_args(features, q, k, dbias, rows), *mod_args)
    flags.update(HAS_BIAS=features.attn_bias is not None, BIAS_GRAD=0 if dbias is None else 1 + dbias_atomic,
                 DETERMINISTIC=semaphores is not None, DQ_BUFFERS=dq_buffers(block_d, features.attn_bias),
                 STAGED_STATS=staged, MASK_MOD=mod_args[0] is not None, SCORE_MOD=mod_args[8] is not None)
    counters = () if semaphores is None else ("semaphores",)
    heads = ("q", "grad_out", "k", "v", "dq_accum", *stat_names, "dk", "dv", *counters)
    row64 = needs_64bit_rows(q, out, grad_out, dq)
    if padded is None:
        preprocess = _preprocess_launch(q, out, grad_out, delta, dq, dq_accum, semaphores)
    else:
        preprocess = (*bwd_prep.padded_stats_launch(out, grad_out, lse, *padded, dq_accum,
                                                    features.varlen.cu_seqlens_q, row64, semaphores),
                      ("out", "grad_out", "lse", *PADDED_STATS, "dq_accum", "cu_seqlens_q", *counters))
    return {
        "preprocess": preprocess,
        "dkdv_dq": (main, (max(1, programs * num_kv_heads),), dict(
            zip(main.arg_names, main_args), HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_STAGES=num_stages,
            **flags), dict(LAUNCH_OPTIONS), heads),
        "dq_convert": (*bwd_prep.dq_convert_launch(dq_accum, dq, softmax_scale, row64), ("dq_accum", "dq")),
    }


def one_pass_tiles(head_dim: int, features, num_stages: int | None = None) -> tuple[int, int]:
    """The one-pass kernel's tiles (query rows, keys): its streamed query tiles (tiles.sm90_backward_rows) and its
    CTA's key block, the tiles at which it walks a mask_mod's block mask. A mask_mod streams 64 rows at every head
    dim: each consumer then evaluates the mod on a 64 x 64 tile of Sᵀ at once (at D=64 on 128 rows its build
    spilled hundreds of values, on 64 none: docs/perf-notes.md)."""
    if features.mods is not None:
        return KEYS_PER_CONSUMER, BLOCK_N
    return sm90_backward_rows(head_dim, features.attn_bias is not None, num_stages or NUM_STAGES), BLOCK_N


def _mod_args(features, blocks, rows: int) -> tuple:
    """The one-pass kernel's mods arguments `(mask_mod, mask_args, PARTIAL_COUNTS, PARTIAL_TILES, FULL_COUNTS,
    FULL_TILES, list_len, mod_k_tiles, score_mod, score_grad, score_args)`: the mask_mod (mods.kernel_args) and its
    block mask's lists by key tile (mods.block_mask_args), built at the launch's tiles, then the score_mod's
    function, derivative and captured tensors; None where absent."""
    mods = mod_kernel_args(features.mods)
    score = (mods["score_mod"], mods["score_grad"], mods["score_args"])
    if score[0] is not None and score[1] is None:
        raise ValueError("score_mod: the backward needs its derivative (ScoreMod(fn, *tensors, grad=...))")
    if mods["mask_mod"] is None:
        return (None,) * 8 + score
    if blocks is None or (blocks.block_m, blocks.block_n) != (rows, BLOCK_N):
        raise ValueError(f"a mask_mod needs its block mask at the launch's {rows}x{BLOCK_N} tiles "
                         f"(mods.call_block_mask), got {None if blocks is None else (blocks.block_m, blocks.block_n)}")
    return (mods["mask_mod"], mods["mask_args"], *block_mask_args(blocks, by_key=True).values(), blocks.n_k_tiles,
            *score)


# the names of `padded_stats`' tensors among the launches' per-call tensors
PADDED_STATS = ("lse_padded", "delta_padded")


def _staged(q, lse, delta, features) -> bool:
    """Whether the one pass stages this call's lse and Δ (`tiles.sm90_backward_staged_stats`): a dense call's read
    by TMA as they are, a packed call's through their padded copies (`padded_stats`)."""
    varlen = features.varlen is not None
    return (sm90_backward_staged_stats(q.shape[-1], q.shape[2], varlen, features.plain_scores, features.mask.causal)
            and (varlen or tma_compatible(lse, delta)))


def padded_stats(q, lse, delta, features) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A packed call's staged statistics, where the one pass stages them (`_staged`): fresh float32 workspaces for
    the copy of lse and for Δ, (1, Hq, seqlen.padded_stat_rows(total rows, sequences)) each, in which every
    (head, sequence) run of rows starts 16-byte aligned (the preprocess fills every slot); None otherwise."""
    features = as_features(features)
    if features.varlen is None or not _staged(q, lse, delta, features):
        return None
    return _padded_workspaces((1, q.shape[1], padded_stat_rows(q.shape[2], features.varlen.num_seqs)), q.device)


def _padded_workspaces(shape: tuple, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`padded_stats`' two float32 tensors of `shape` (one allocation), or None where `shape` is None."""
    if shape is None:
        return None
    return tuple(torch.empty(2, *shape, dtype=torch.float32, device=device).unbind(0))


def _row_stats_shape(lse, padded) -> tuple:
    """The shape of the one pass's per-row tensors besides lse and Δ (the deterministic mode's counters): lse's, or
    the padded statistics' where a packed call stages them (the kernel reads both at one row base)."""
    return tuple(lse.shape if padded is None else padded[0].shape)


def dq_buffers(block_d: int, attn_bias) -> int:
    """The one-pass kernel's dQ staging buffers: two (the consumers stage a tile while the writer's reduce-adds
    read the previous one), one with an attn_bias above D=64, whose ring takes the second's 32 KiB (a 16-bit bias
    at D=128 needs 229904 bytes with one buffer; sm_90 has 232448)."""
    return 1 if attn_bias is not None and block_d > 64 else 2


def _bias_args(features, q, k, dbias, rows: int) -> tuple:
    """The one-pass kernel's bias arguments `(bias_desc, bias_step_b, bias_step_h, DBIAS, its four strides over the
    full (B, Hq, Lq, Lk) problem)`: a descriptor of rows-query x BLOCK_N-key boxes over `layout.bias_tma_view`
    (the caller checked it holds), the gradient buffer's strides 0 where it broadcasts. None where absent."""
    bias = features.attn_bias
    if bias is None:
        return (None,) * 8
    view, step_b, step_h = bias_tma_view(bias, q.shape[2], k.shape[2])
    grad = (None,) * 5
    if dbias is not None:
        grad = (dbias, *dbias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]).stride())
    return descriptor(view, rows, BLOCK_N), step_b, step_h, *grad


def _one_pass_tensor_args(block_d, rows, q, grad_out, k, v, dq_accum, lse, delta, dk, dv, staged: bool):
    """The one-pass kernel's per-call arguments: TMA descriptors over q, dO (tiles of `rows` queries), k, v (key
    tiles) and the dq_accum reduce-add target; lse and Δ (descriptors where `staged`), then the plain tensors."""
    stats = (lse, delta)
    if staged:
        stats = (_row_stat_descriptor(lse, rows, "lse"), _row_stat_descriptor(delta, rows, "delta"))
    return (descriptor(q, rows, block_d), descriptor(grad_out, rows, block_d),
            descriptor(k, BLOCK_N, block_d), descriptor(v, BLOCK_N, block_d), _dq_accum_descriptor(dq_accum, rows),
            *stats, dk, dv)


def _row_stat_descriptor(t: torch.Tensor, rows: int, name: str) -> TensorDescriptor:
    """A rank-1 TMA descriptor over a contiguous float32 tensor of one value per query row (lse, Δ), boxes of
    `rows` values: a query tile's, at its first row's flat index. Its base is the tensor as passed (so a prepared
    launch rebases it on the next call's), its shape the flat element count."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 tensor, got {t.dtype} with strides {t.stride()}")
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=t, shape=[t.numel()], strides=[1], block_shape=[rows], padding="zero",
                         layout=_ROW_STAT_LAYOUT)
    return desc


_ROW_STAT_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


class PreparedBackward:
    """attention_backward_sm90's one-pass path (head dims padding to 64 or 128) for one call signature, its three
    launches as PreparedLaunches: called as ``prepared(q, k, v, out, lse, grad_out, delta, dq, dk, dv)`` (a packed
    batch: then its `varlen_tensors`) on new tensors of the same shapes, strides, dtypes, device and 16-byte
    alignment (the caller keys its cache on them: autograd.backward_key and BackwardPlan), it allocates dq_accum and
    launches without Triton's per-call binding (host time: docs/perf-notes.md). Plain masks (dense, causal) only:
    ALiBi slopes, windows and softcaps are per-call arguments it would freeze. `deterministic`: the ordered dQ
    reduce-adds, with their counters allocated per call beside dq_accum (zeroed by the preprocess); a packed call
    with staged statistics allocates its `padded_stats` per call too."""

    __slots__ = ("launches", "dq_accum_shape", "semaphores_shape", "padded_shape")

    def __init__(self, q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale: float,
                 num_stages: int | None = None, deterministic: bool = False):
        from flashmoe_science.prepared_launch import PreparedLaunch

        check_supported(q, softmax_scale)
        features = as_features(features)
        if padded_head_dim(q.shape[-1]) == TWO_KERNEL_BLOCK_D:
            raise ValueError("PreparedBackward runs the one-pass kernel (head dims up to 128)")
        if not features.plain_scores:
            raise ValueError("PreparedBackward runs dense, causal and packed calls without window, softcap or ALiBi")
        # dq_accum flat, (B·Hq, Lq, BLOCK_D), as its reduce-add descriptor sees it: the descriptor is over the
        # tensor itself, so a new call's is the first call's rebased (PreparedLaunch without make_head)
        self.dq_accum_shape = (q.shape[0] * q.shape[1], q.shape[2], padded_head_dim(q.shape[-1]))
        dq_accum = torch.empty(self.dq_accum_shape, dtype=torch.float32, device=q.device)
        padded = padded_stats(q, lse, delta, features)
        self.padded_shape = None if padded is None else padded[0].shape
        self.semaphores_shape = _row_stats_shape(lse, padded) if deterministic else None
        semaphores = self._semaphores(q.device)
        # __call__'s tensors, then the workspaces, then varlen's
        order = (*_CALL_TENSORS, "dq_accum", "semaphores", *PADDED_STATS, *VARLEN_TENSORS)
        tensors = (q, k, v, out, lse, grad_out, delta, dq, dk, dv, dq_accum, semaphores, *(padded or (None, None)),
                   *varlen_tensors(features, k.shape[2]))
        self.launches = []
        for name, (kernel, grid, bound, options, heads) in _one_pass_launches(
                q, k, v, out, lse, grad_out, delta, dq, dk, dv, dq_accum, features, softmax_scale,
                num_stages, semaphores=semaphores, padded=padded).items():
            live = None
            if name == "dkdv_dq" and features.varlen is not None:
                live = (*kernel.arg_names[:len(heads)], "CuSeqlensQ", "CuSeqlensK", "WorkTiles")
                heads = (*heads, *VARLEN_TENSORS)
            positions = tuple(order.index(h) for h in heads)
            # no make_head: the descriptors over q, dO, k, v and dq_accum are the first call's, rebased
            self.launches.append((PreparedLaunch(kernel, grid, bound, options, None,
                                                 tuple(tensors[p] for p in positions), live), positions))

    def _semaphores(self, device):
        if self.semaphores_shape is None:
            return None
        return torch.empty(self.semaphores_shape, dtype=torch.int32, device=device)

    def __call__(self, q, k, v, out, lse, grad_out, delta, dq, dk, dv, *varlen) -> None:
        dq_accum = torch.empty(self.dq_accum_shape, dtype=torch.float32, device=q.device)
        padded = _padded_workspaces(self.padded_shape, q.device) or (None, None)
        tensors = (q, k, v, out, lse, grad_out, delta, dq, dk, dv, dq_accum, self._semaphores(q.device), *padded,
                   *varlen)
        for launch, positions in self.launches:
            launch(*[tensors[p] for p in positions])


_CALL_TENSORS = ("q", "k", "v", "out", "lse", "grad_out", "delta", "dq", "dk", "dv")
# A packed call's per-call tensors of the one-pass kernel, in the order PreparedBackward takes them.
VARLEN_TENSORS = ("cu_seqlens_q", "cu_seqlens_k", "work_tiles")


def varlen_tensors(features, key_rows: int) -> tuple:
    """`VARLEN_TENSORS` of a packed call whose keys are packed in `key_rows` rows (its cu_seqlens and the key-block
    work list), () for a dense one."""
    varlen = features.varlen
    if varlen is None:
        return ()
    return varlen.cu_seqlens_q, varlen.cu_seqlens_k, ranked_work_list(varlen.cu_seqlens_k, BLOCK_N, key_rows)


def compile_offline(head_dim: int, features=False, num_stages: int = NUM_STAGES,
                    dtype: torch.dtype = torch.bfloat16, bias_grad: str | None = None, deterministic: bool = False,
                    mask_mod=None, score_mod=None):
    """The kernel built for sm_90 without a GPU (meta tensors; ptxas ships with triton), specialised as a launch
    would specialise it; returns the CompiledKernel (registers, shared memory, SASS:
    benchmarks/tools/sass_attention_backward.py). features: the causal bool or a CallFeatures (its tensors may live
    on the meta device: `offline_features`; an attn_bias broadcastable to (2, 4, 256, 256)). bias_grad: "store"
    or "atomic", the bias's gradient written as a bias of its shape without / with broadcast dims has it.
    deterministic: the ordered dQ reduce-adds (head dims up to 128). mask_mod: a `@triton.jit` function or a
    mods.MaskMod (its captured tensors may be meta), walked through a block mask of meta lists; score_mod: a
    mods.ScoreMod with its derivative, on every visited score."""

    block_d = padded_head_dim(head_dim)
    if block_d == 256:
        return bwd_sm90_hdim256.compile_offline(head_dim, features, num_stages, dtype)
    q = torch.empty(2, 4, 256, head_dim, dtype=dtype, device="meta")
    lse = torch.empty(2, 4, 256, device="meta")
    dq_accum = torch.empty(2, 4, 256, block_d, device="meta")
    features = as_features(features)
    dbias = None
    if bias_grad is not None:
        dbias = torch.empty(features.attn_bias.shape, device="meta")
    padded = padded_stats(q, lse, lse, features)
    blocks = None
    if mask_mod is not None or score_mod is not None:
        features, blocks = _offline_mods(mask_mod, score_mod, features, q, head_dim)
    semaphores = None
    if deterministic:
        semaphores = torch.empty(_row_stats_shape(lse, padded), dtype=torch.int32, device="meta")
    kernel, _, bound, _, _ = _one_pass_launches(q, q[:, :2], q[:, :2], q, lse, q, lse, q, q[:, :2], q[:, :2],
                                                dq_accum, features, 0.07, num_stages, dbias,
                                                bias_grad == "atomic", semaphores, padded, blocks)["dkdv_dq"]
    return offline_build(kernel, bound)


def _offline_mods(mask_mod, score_mod, features, q, head_dim: int):
    """compile_offline's features with the mods added, and a mask_mod's block mask over q's sequences (meta lists;
    None without one)."""
    if mask_mod is not None and not isinstance(mask_mod, MaskMod):
        mask_mod = MaskMod(mask_mod)
    features = replace(features, mods=Mods(mask_mod, score_mod))
    if mask_mod is None:
        return features, None
    rows, keys = one_pass_tiles(head_dim, features)
    batch, length = (features.varlen.num_seqs, features.varlen.max_seqlen_q) if features.varlen else (2, 256)
    n_q, n_k = -(-length // rows), -(-length // keys)
    lists = TileLists(*(torch.empty(shape, dtype=torch.int32, device="meta")
                        for shape in ((batch, q.shape[1], n_k), (batch, q.shape[1], n_k, n_q)) * 2))
    states = torch.empty(batch, q.shape[1], n_q, n_k, dtype=torch.int8, device="meta")
    return features, BlockMask(rows, keys, states, None, lists)
