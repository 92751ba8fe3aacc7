"""Attention forward for Hopper (sm_90) in Gluon: TMA loads, asynchronous wgmma, softmax overlapped with P·V.

The algorithm is the one in `triton/fwd.py` (online softmax in base 2, bottom-right causal mask, GQA by index);
what changes is who waits for whom. Triton's compiler waits for each tensor-core product before the next
instruction that could touch its registers, so the warps and the tensor cores take turns. Here the waits are
explicit, and one iteration over key tile j reads:

    wait for K_j in shared memory (TMA, `NUM_STAGES` tiles in flight)
    issue   S_j  = Q K_jᵀ                   (async wgmma, operands in shared memory)
    rescale O   *= alpha_{j-1}              (registers; no product in flight touches O)
    issue   O   += P_{j-1} V_{j-1}          (async wgmma, P from registers)
    wait until only the last product is in flight  -> S_j is ready
    softmax of S_j -> P_j, alpha_j          (exp2 on the SFU *while the tensor cores run P_{j-1} V_{j-1}*)
    wait for the P·V product, then refill the stage it used with tile j-1+NUM_STAGES

The first tile is peeled (there is no P_{-1}) and the last P·V runs after the loop. Once the running maxima
settle most tiles leave alpha at 1: at head dims padding to 256 a warp whose rows all have alpha == 1 branches past
O's rescale (`_rescale`, `tiles.sm90_forward_skip_rescale`).

A work item is NUM_CONSUMERS · 64 query rows of one (batch, head) (`tiles.block_m`: 128 on two consumer
warpgroups, 192 on three at head dims to 64: hopper/tiles.py), 64 rows per consumer warpgroup, each in its own
warp-specialised partition. They share the K/V tiles, and the warp schedulers interleave one warpgroup's softmax
with the others' tensor-core products (FA3's ping-pong). At head dims to 64 the order is explicit: the consumers
issue each key tile's two products in a fixed rotation and rescale O after its P·V (`_take_turn`,
`tiles.sm90_forward_pingpong`); elsewhere it is left to the hardware.
A further partition, one producer warp with 24 registers (the consumers get 240 with two of them, 160 with three:
gluon/sm90.consumer_registers), streams K and V through a ring of NUM_STAGES shared-memory stages. Each stage has a
"ready" barrier (the TMA copy landed) and an "empty" barrier that every consumer arrives on (K after its Q·Kᵀ
product, V after its P·V product), so copies run ahead as far as the ring allows and never sit in a consumer's
instruction stream.

Persistent: with `num_ctas` = the SM count, each CTA loops over work items (`work_items.work_tile`: rounds of consecutive
items, snaking). The producer also loads each item's Q (into one of Q_BUFFERS buffers per consumer, once the
consumer has released that buffer's previous item) and keeps the K/V ring position running across items, so the
next item's first tiles land while the consumers finish the current one's last P·V and epilogue. With
`num_ctas=None` each CTA runs one item.

The epilogue stages each consumer's output rows in its Q buffer (free after the item's last Q·Kᵀ) and writes them
with one TMA store; the buffer returns to the producer once the store has read it.
"""

from __future__ import annotations

import functools

import torch

from flashmoe_science.attention.hopper.common import descriptor, release_unused
from flashmoe_science.attention.hopper.tiles import (sm90_cross_item_safe, sm90_forward_pingpong,
                                                      sm90_forward_skip_rescale)
from flashmoe_science.attention.hopper.work_items import VarlenArgs, cta_key_tiles, cta_num_items, item_rows
from flashmoe_science.attention.features import bias_strides
from flashmoe_science.attention.layout import bias_tma_view, tma_compatible
from flashmoe_science.attention.mask import (LN_2, LOG2_E, MaskSpec, key_tile_bounds, key_tile_range, score_to_log2,
                                             visible)
from flashmoe_science.attention.mods import BlockMask, MaskMod, ScoreMod, TileLists, clamp_index
from flashmoe_science.attention.seqlen import PACKED_TOTALS, PER_BATCH_ARGS, VarlenBatch, ranked_work_list_entries
from flashmoe_science.attention.tiles import padded_head_dim
from flashmoe_science.gluon.compat import (fence_async_shared, gl, gluon, mbarrier, tma, warpgroup_mma,
                                           warpgroup_mma_wait)
from flashmoe_science.gluon.sm90 import (PRODUCER_REGISTERS, column_halves, consumer_registers, launch_options,
                                         wgmma_layout)
from flashmoe_science.prepared_launch import PreparedLaunch

FP8_DTYPE = torch.float8_e4m3fn
CONSUMER_ROWS = 64  # rows per consumer warpgroup (4 warps x 16 rows of wgmma)
CONSUMER_COUNTS = (2, 3)  # consumer warpgroups a CTA may run (tiles.block_m = 64 per consumer)


def num_consumers(tiles) -> int:
    """The consumer warpgroups of a launch with these tiles: block_m / 64 rows, 4 warps each (CONSUMER_COUNTS)."""
    consumers = tiles.block_m // CONSUMER_ROWS
    if (consumers not in CONSUMER_COUNTS or tiles.block_m != consumers * CONSUMER_ROWS
            or tiles.num_warps != 4 * consumers):
        raise ValueError(f"the sm_90 kernel runs {' or '.join(str(c * CONSUMER_ROWS) for c in CONSUMER_COUNTS)}-row "
                         f"tiles on 4 warps per 64 rows, got {tiles}")
    return consumers


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smems, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              num_work, num_m_tiles, num_q_heads, group_size, seqlen_q, seqlen_k, window_left, window_right,
              varlen_args, bias_desc, bias_upper, bias_lower, bias_step_b, bias_step_h,
              NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
              Q_BUFFERS: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, VARLEN: gl.constexpr,
              BIAS_TMA: gl.constexpr, NUM_CONSUMERS: gl.constexpr, block_lists, MASK_MOD: gl.constexpr):
    """The producer warp: for each of the CTA's work items, each consumer's rows of the Q tile (once that consumer
    is done with the buffer's previous item), then K and V tiles into the ring as soon as their stage is released.
    The ring position runs on across work items, so the next item's first tiles land during the current epilogue;
    with two Q buffers per consumer the next item's Q does not wait for the current item's epilogue either.
    Varlen boxes may run into the next sequence's rows: extra Q rows are never stored, extra keys are masked.
    BIAS_TMA (two consumers): each K tile's stage also takes the bias tiles of both consumers' rows (`bias_upper`,
    `bias_lower`: one ring per consumer), on K's "ready" barrier; the TMA box zero-fills rows and keys past the bias
    (masked). MASK_MOD: the key tiles of the block mask's lists (`_item_tile_lists`), in the consumers' order."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    num_ctas = gl.num_programs(0)
    ring = 0  # K/V tiles issued so far by this CTA
    for item in range(cta_num_items(num_work)):
        batch, desc_batch, q_head, kv_head, start_m, q_row0, k_row0, item_seqlen_q, item_seqlen_k = item_rows(
            item, num_ctas, num_m_tiles, num_q_heads, group_size, seqlen_q, seqlen_k, varlen_args,
            NUM_CONSUMERS * ROWS, CAUSAL, VARLEN)
        for c in gl.static_range(NUM_CONSUMERS):
            buf = c * Q_BUFFERS + item % Q_BUFFERS
            # barriers start "phase 1 complete": the first use of each buffer passes
            mbarrier.wait(q_empty.index(buf), ((item // Q_BUFFERS) & 1) ^ 1)
            mbarrier.expect(q_ready.index(buf), q_desc.block_type.nbytes)
            tma.async_load(q_desc, [desc_batch, q_head, q_row0 + start_m + c * ROWS, 0],
                                            q_ready.index(buf), q_smems.index(buf))
        if MASK_MOD:
            item_lists = _item_tile_lists(block_lists, batch, q_head, start_m, NUM_CONSUMERS * ROWS)
            key_start, num_tiles = 0, item_lists[2]
        else:
            key_start, num_tiles = cta_key_tiles(start_m, item_seqlen_q, item_seqlen_k, window_left, window_right,
                                                  NUM_CONSUMERS * ROWS, BLOCK_N, CAUSAL, MASK_LEFT, MASK_RIGHT)
        for tile in range(num_tiles):
            stage = ring % NUM_STAGES
            free_phase = ((ring // NUM_STAGES) & 1) ^ 1
            key_row = k_row0 + key_start + tile * BLOCK_N
            if MASK_MOD:
                key_row = k_row0 + _listed_tile(item_lists, tile, BLOCK_N)[0]
            mbarrier.wait(k_empty.index(stage), free_phase)
            if BIAS_TMA:
                mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes + 2 * bias_desc.block_type.nbytes)
                tma.async_load(k_desc, [desc_batch, kv_head, key_row, 0], k_ready.index(stage), k_smem.index(stage))
                bias_batch = batch * bias_step_b
                bias_head = q_head * bias_step_h
                bias_col = key_start + tile * BLOCK_N
                tma.async_load(bias_desc, [bias_batch, bias_head, start_m, bias_col], k_ready.index(stage),
                               bias_upper.index(stage))
                tma.async_load(bias_desc, [bias_batch, bias_head, start_m + ROWS, bias_col], k_ready.index(stage),
                               bias_lower.index(stage))
            else:
                mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
                tma.async_load(k_desc, [desc_batch, kv_head, key_row, 0], k_ready.index(stage),
                                                k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), free_phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            if v_desc.dtype == gl.float8e4nv:  # e4m3 V arrives K-major: boxes of (head dim, keys) over Vᵀ
                tma.async_load(v_desc, [desc_batch, kv_head, 0, key_row], v_ready.index(stage), v_smem.index(stage))
            else:
                tma.async_load(v_desc, [desc_batch, kv_head, key_row, 0], v_ready.index(stage),
                                                v_smem.index(stage))
            ring += 1


@gluon.jit
def _item_tile_lists(block_lists, batch, q_head, start_m, CTA_ROWS: gl.constexpr):
    """A work item's row of the block mask (mods.block_mask at the CTA's BLOCK_M x BLOCK_N tiles; block_lists: full
    counts, partial counts, the key tiles in walk order, query tiles per (b, h), list length, query heads): (its
    key tiles, full ones first then partial ones, how many are full, how many to stream: at least one)."""
    full_counts, partial_counts, walk_tiles, n_q_tiles, list_len, num_q_heads = block_lists
    row = (batch * num_q_heads + q_head).to(gl.int64) * n_q_tiles + start_m // CTA_ROWS
    n_full = gl.load(full_counts + row)
    n_tiles = gl.maximum(n_full + gl.load(partial_counts + row), 1)
    return walk_tiles + row * list_len, n_full, n_tiles


@gluon.jit
def _listed_tile(item_lists, j, BLOCK_N: gl.constexpr):
    """Key tile j of a work item (`_item_tile_lists`): (its first key, whether it is partial: the elementwise mask
    applies). A query tile that sees no key streams the first of its empty tiles, masked whole."""
    return gl.load(item_lists[0] + j) * BLOCK_N, j >= item_lists[1]


@gluon.jit
def _bias_tile(bias_ring, stage, bias_plane, bias_args, offs_m, start_n, seqlen_q, seqlen_k, BLOCK_N: gl.constexpr,
               BIAS_TMA: gl.constexpr, s_layout: gl.constexpr):
    """This consumer's bias tile for the key tile at `start_n`, float32 in the score layout, times `bias_log2`
    (bias_args; see _softmax_tile). BIAS_TMA: from the stage's shared-memory buffer (the producer's TMA copy,
    landed with K); else masked loads at `bias_plane` (the (batch, head) plane's address) with the query and key
    strides, which may be 0 where the bias broadcasts."""
    stride_m, stride_n, bias_log2 = bias_args
    if BIAS_TMA:
        ROWS: gl.constexpr = bias_ring.shape[3]
        bias = bias_ring.index(stage).reshape([ROWS, BLOCK_N]).load(s_layout)
    else:
        key_pos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        row_ptrs = gl.expand_dims(bias_plane + offs_m.to(gl.int64) * stride_m, 1)  # 64-bit: Lq·Lk may pass 2**31
        inside = gl.expand_dims(offs_m < seqlen_q, 1) & gl.expand_dims(key_pos < seqlen_k, 0)
        bias = gl.load(row_ptrs + gl.expand_dims(key_pos * stride_n, 0), mask=inside, other=0.0)
    return bias.to(gl.float32) * bias_log2


@gluon.constexpr_function
def _bias_in_start(BIAS_TMA, SOFTCAP, BLOCK_D):
    """Whether S_j starts from the bias tile (`_bias_start`) instead of the softmax adding it: a bias read by TMA,
    no softcap (whose tanh comes between the product and the bias), head dims to 128 (at D=256 the start's
    registers, live before the product is issued, cost 7 more spill instructions offline)."""
    return bool(BIAS_TMA) and not SOFTCAP and BLOCK_D <= 128


@gluon.jit
def _bias_start(s_init, bias_ring, stage, bias_args, BLOCK_N: gl.constexpr, ALIBI_LINEAR: gl.constexpr,
                BIAS_START: gl.constexpr, s_layout: gl.constexpr):
    """BIAS_START (`_bias_in_start`): S_j's start with the bias tile in it (raw score units: bias·log2 e/qk_scale,
    plus ALiBi's key term where s_init has it), so the product accumulates Q·K_jᵀ onto it and the softmax after
    the product's wait is the plain one. Call after K_j's "ready" wait (the tile lands with K). The shared-memory
    read and its conversion run before the product is issued, while the other consumer's products keep the
    tensor cores busy, instead of between the product's wait and the exp2s; they write the accumulator's own
    registers, so nothing more is live across the products (reading the tile into registers under the product
    and adding it after the wait instead spilled 36 loads and 36 stores per key tile offline). Else s_init."""
    if BIAS_START:
        bias = _bias_tile(bias_ring, stage, 0, bias_args, None, 0, 0, 0, BLOCK_N, True, s_layout)
        if ALIBI_LINEAR:
            s_init = s_init + bias
        else:
            s_init = bias
    return s_init


@gluon.jit
def _score_start(s_zero, start_n, tile_mask, BLOCK_N: gl.constexpr, ALIBI_LINEAR: gl.constexpr,
                 s_layout: gl.constexpr):
    """The accumulator S_j = Q·K_jᵀ starts from: zeros, or with ALIBI_LINEAR ALiBi's key term (see _softmax_tile).

    ALiBi's bias -m·|i + diagonal - j| is linear in i and j for every visible pair on or left of the diagonal
    (j <= i + diagonal): with r = start_m + diagonal (the consumer's first row on the diagonal) it is
    -m·(i - start_m) + m·(j - r), a row term plus a key term. The row term is the same for every key tile of a
    row, so the online softmax never needs it (it cancels in p / l): `_store_output` adds it back to the
    log-sum-exp only. The key term rides in the product's start, in raw score units (times log2 e / qk_scale), so
    the softmax after the product is the plain one. Relative to r the terms stay small (|key term| <= m·63
    over the diagonal tile's visible keys); far left of the diagonal the key term grows with the distance, as the
    bias itself does, and its float32 rounding (2^-24 of it) matters only where the bias has already driven p to 0.
    """
    if ALIBI_LINEAR:
        alibi_raw, alibi_ref = tile_mask[8], tile_mask[9]
        # A thread's key columns in the wgmma accumulator are 2·(lane mod 4) (bits 1-2) OR a per-register
        # constant (the other bits). Split that way, the constant part folds to immediates and the lane part is
        # one scalar per thread: one FFMA per column per tile. The whole arange instead is rebuilt from the
        # thread id per column every tile (ptxas rematerialises it rather than hold 32 registers in the loop).
        # The split is exact for any layout (c = (c & ~6) + (c & 6)); only its cost depends on the layout.
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        lane_start = ((cols & 6) + (start_n - alibi_ref)).to(gl.float32) * alibi_raw
        key_term = gl.fma((cols & ~6).to(gl.float32), alibi_raw, lane_start)
        start = gl.expand_dims(key_term, 0).broadcast_to(s_zero.shape)  # s_zero + x is an FADD per score
    else:
        start = s_zero
    return start


@gluon.jit
def _softmax_tile(s, m_i, l_i, j, offs_m, tile_mask, mask_args, qk_scale, k_free, bias_ring, stage, bias_args, mask_mod,
                  score_mod, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr,
                  MASK_RIGHT: gl.constexpr,
                  SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, HAS_BIAS: gl.constexpr, BIAS_TMA: gl.constexpr,
                  s_layout: gl.constexpr, P_DTYPE: gl.constexpr, p_layout: gl.constexpr,
                  MOD_WIDTH: gl.constexpr):
    """Release K's ring stage (`k_free`), then score modifiers (softcap, ALiBi: mask.score_to_log2; the bias), the
    mask (boundary tiles only: mask.visible), then fold the raw scores s of the item's j-th key tile into the
    running max m and sum l.

    ALiBi without a softcap (`_score_start`'s linear form): s arrives with the key term already in it and the
    running max m omits the row term, so the softmax below is the plain one. Pairs right of the diagonal
    (j > i + diagonal, visible without a right bound or with window_right > 0) have the opposite sign:
    tiles that reach past the diagonal subtract 2·m·(j - i - diagonal) there (causal calls never). ALiBi with a
    softcap (not linear) subtracts the whole distance term after the tanh, in log2 units.

    The bias is added in the units s is in at that point, so the max and exp2 below stay as without it: log2
    units after softcap + ALiBi (bias_log2 = log2 e), else the raw (or tanh'd) product that the exp2's FMA
    multiplies by qk_scale (bias_log2 = log2 e / qk_scale). Read before the stage is released: the TMA copy
    shares K's stage. HAS_BIAS: add it here (not where s starts from it: `_bias_start`).

    Returns p = exp2(score − m_new) (unnormalised probabilities; float32, or with P_DTYPE already the P·V product's
    operand: `_p_operand`), m_new, l_new, alpha = exp2(m_old − m_new).

    A mask_mod (mask_args then carries its captured tensors and the block mask's lists, tile_mask the item's lists,
    batch and head: `_consumer_item`): tile j is the j-th of the item's lists, and its partial tiles AND the mod
    into the mask, at positions clamped into the sequence (mods.clamp_index), in column slices MOD_WIDTH wide
    (`_mod_width`); full tiles mask nothing.

    A score_mod (mods refuse softcap, ALiBi and the bias beside it) replaces every visited score, before the mask,
    by score_mod(s·scale) in log2 units (`_scored`), in the same column slices.
    """
    # tuples are unpacked whole, not sliced or measured: triton 3.6 cannot take len() of a tuple holding None
    MASK_MOD: gl.constexpr = mask_mod is not None
    SCORE_MOD: gl.constexpr = score_mod is not None
    if MASK_MOD or SCORE_MOD:
        key_start, full_start, full_end, seqlen_k, diagonal, alibi_slope_log2, bias_plane, seqlen_q, alibi_raw, \
            alibi_ref, mod_item = tile_mask
    else:
        key_start, full_start, full_end, seqlen_k, diagonal, alibi_slope_log2, bias_plane, seqlen_q, alibi_raw, \
            alibi_ref = tile_mask
    window_left, window_right, softcap_scale, mod_tensors, block_lists, score_tensors = mask_args
    ALIBI_LINEAR: gl.constexpr = ALIBI and not SOFTCAP
    LOG2_SCORES: gl.constexpr = (ALIBI and SOFTCAP) or SCORE_MOD  # s in log2 units after the modifiers
    if MASK_MOD:
        start_n, partial = _listed_tile(mod_item[0], j, BLOCK_N)
    else:
        start_n = key_start + j * BLOCK_N
    if HAS_BIAS:
        bias = _bias_tile(bias_ring, stage, bias_plane, bias_args, offs_m, start_n, seqlen_q, seqlen_k, BLOCK_N,
                          BIAS_TMA, s_layout)
    mbarrier.arrive(k_free, count=1)
    if SCORE_MOD:
        s = _scored(s, offs_m, start_n, seqlen_q, seqlen_k, mod_item[1], mod_item[2], score_mod, score_tensors,
                    qk_scale, MOD_WIDTH)
    if SOFTCAP:  # s becomes t = tanh(s·scale/c); its multiplier c·log2e is folded into the FMAs below
        _, s = score_to_log2(s, 0, 0, 0, qk_scale, softcap_scale, 0.0, SOFTCAP, False, True)
    if ALIBI and SOFTCAP:  # scores in log2 units: t·multiplier minus the distance term
        # float positions: the distance costs a subtraction per score, no integer conversion
        key_pos_f = (start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))).to(gl.float32)
        s, _ = score_to_log2(s, gl.expand_dims(offs_m.to(gl.float32), 1), gl.expand_dims(key_pos_f, 0),
                             diagonal.to(gl.float32), qk_scale, 1.0, alibi_slope_log2, False, ALIBI)
    if ALIBI_LINEAR and not CAUSAL:
        if start_n + BLOCK_N - 1 > alibi_ref:  # some pair right of the diagonal (alibi_ref: first row + diagonal)
            key_pos_f = (start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))).to(gl.float32)
            right = gl.expand_dims(key_pos_f, 0) - gl.expand_dims((offs_m + diagonal).to(gl.float32), 1)
            s = s - (2.0 * alibi_raw) * gl.maximum(right, 0.0)
    if HAS_BIAS:
        s = s + bias
    if MASK_MOD:
        masked = partial
    else:
        masked = start_n + BLOCK_N > full_end  # only tiles at the window's edges and the ragged end pay for the mask
        if MASK_LEFT:
            masked = masked | (start_n < full_start)
    if masked:
        if MASK_MOD:
            s = _masked(s, offs_m, start_n, seqlen_q, seqlen_k, diagonal, window_left, window_right, mod_item[1],
                        mod_item[2], mask_mod, mod_tensors, CAUSAL, MASK_LEFT, MASK_RIGHT, MOD_WIDTH)
        else:
            s = _masked(s, offs_m, start_n, seqlen_q, seqlen_k, diagonal, window_left, window_right, 0, 0, None,
                        None, CAUSAL, MASK_LEFT, MASK_RIGHT, BLOCK_N)
    if LOG2_SCORES:  # s is in log2 units already
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_shift, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        # A row that has seen no key keeps m = -inf: shift it by 0 so exp2 gives 0, not NaN.
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_shift, 1))
    alpha = gl.exp2(m_i - m_shift)
    l_new = l_i * alpha + gl.sum(p, 1)
    if P_DTYPE is not None:
        p = _p_pack(p, P_DTYPE)
    return p, m_new, l_new, alpha


@gluon.constexpr_function
def _mod_width(varlen):
    """The widest column slice `_masked` evaluates a mask_mod on at once: 16 keys, 64 in a packed batch (the widths
    whose offline builds spill least in the key loop on triton 3.6 and 3.9: docs/perf-notes.md)."""
    return 64 if varlen else 16


@gluon.jit
def _masked(s, offs_m, start_n, seqlen_q, seqlen_k, diagonal, window_left, window_right, b, h, mask_mod, mod_tensors,
            CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, COLUMNS: gl.constexpr):
    """s (a wgmma accumulator tile, its first key start_n) set to -inf where a query does not see a key: `visible`
    (bounds, and the window, or the plain mask's causal diagonal: the window (-1, 0)), and the user's mask_mod (None:
    none) at positions clamped into the sequence (rows past it are never stored).

    Evaluated on column slices at most COLUMNS wide (`column_halves`: register selections, no data moves), so only
    one slice's positions, mod loads and compares are live beside S, O and the pending P·V operand."""
    layout: gl.constexpr = s.type.layout
    N: gl.constexpr = s.shape[1]
    if N > COLUMNS:
        half: gl.constexpr = wgmma_layout(N // 2)  # the layout column_halves produced, named (no data moves)
        left, right = column_halves(s)
        left = _masked(gl.convert_layout(left, half), offs_m, start_n, seqlen_q, seqlen_k, diagonal, window_left, window_right, b, h,
                       mask_mod, mod_tensors, CAUSAL, MASK_LEFT, MASK_RIGHT, COLUMNS)
        right = _masked(gl.convert_layout(right, half), offs_m, start_n + N // 2, seqlen_q, seqlen_k, diagonal, window_left, window_right, b,
                        h, mask_mod, mod_tensors, CAUSAL, MASK_LEFT, MASK_RIGHT, COLUMNS)
        return gl.convert_layout(gl.join(left, right).permute((0, 2, 1)).reshape([s.shape[0], N]), layout)
    rows = gl.convert_layout(offs_m, gl.SliceLayout(1, layout))
    key_pos = start_n + gl.arange(0, N, layout=gl.SliceLayout(0, layout))
    if MASK_LEFT or MASK_RIGHT:
        seen = visible(gl.expand_dims(rows, 1), gl.expand_dims(key_pos, 0), seqlen_k, diagonal, window_left,
                       window_right, MASK_LEFT, MASK_RIGHT)
    else:
        seen = visible(gl.expand_dims(rows, 1), gl.expand_dims(key_pos, 0), seqlen_k, diagonal, 0, 0, False, CAUSAL)
    if mask_mod is not None:
        seen = seen & mask_mod(b, h, gl.expand_dims(clamp_index(rows, seqlen_q), 1),
                               gl.expand_dims(clamp_index(key_pos, seqlen_k), 0), *mod_tensors)
    return gl.where(seen, s, float("-inf"))


@gluon.jit
def _scored(s, offs_m, start_n, seqlen_q, seqlen_k, b, h, score_mod, score_tensors, qk_scale, COLUMNS: gl.constexpr):
    """s (raw q·k of a wgmma accumulator tile, its first key start_n) as score_mod(s·scale, b, h, q_idx, kv_idx)
    in log2 units (qk_scale = scale·log2 e), at positions clamped into the sequence; on column slices at most
    COLUMNS wide, as `_masked` (one recursion over a leaf function would carry the leaves' arguments in a tuple,
    and their unused ones are None, which triton 3.6 cannot put in a tuple)."""
    layout: gl.constexpr = s.type.layout
    N: gl.constexpr = s.shape[1]
    if N > COLUMNS:
        half: gl.constexpr = wgmma_layout(N // 2)
        left, right = column_halves(s)
        left = _scored(gl.convert_layout(left, half), offs_m, start_n, seqlen_q, seqlen_k, b, h, score_mod,
                       score_tensors, qk_scale, COLUMNS)
        right = _scored(gl.convert_layout(right, half), offs_m, start_n + N // 2, seqlen_q, seqlen_k, b, h,
                        score_mod, score_tensors, qk_scale, COLUMNS)
        return gl.convert_layout(gl.join(left, right).permute((0, 2, 1)).reshape([s.shape[0], N]), layout)
    rows = gl.convert_layout(offs_m, gl.SliceLayout(1, layout))
    key_pos = start_n + gl.arange(0, N, layout=gl.SliceLayout(0, layout))
    x = score_mod(s * (qk_scale * LN_2), b, h, gl.expand_dims(clamp_index(rows, seqlen_q), 1),
                  gl.expand_dims(clamp_index(key_pos, seqlen_k), 0), *score_tensors)
    return x * LOG2_E


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr):
    """P as the register A operand of the P·V product: the float32 P rounded to the operands' dtype, or a P packed
    by `_p_pack` unpacked, in `p_layout`.

    Where it is rounded is a register choice. Two consumers (240 registers) keep the float32 P of tile j until the
    P·V of tile j is issued, after S_{j+1} = Q·K_{j+1}ᵀ. Three (160 registers) round it at the end of the softmax
    (P_DTYPE): a float32 P (64 registers at 128 keys) beside S_{j+1}'s accumulator (64) and O (32) is the whole
    budget, and the key loop spilled 69-125 LDL/STL per tile offline (triton 3.6, D=64). Packed, because 16-bit
    values carried across the loop's back edge take a register each and are repacked (64 PRMT per tile) before
    the product; the int32 pairs go to the wgmma as they are (docs/perf-notes.md has the counts)."""
    if p.dtype == gl.int32:  # packed by _p_pack
        halves = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [p], dtype=(gl.int16, gl.int16),
                                           is_pure=True, pack=1)
        p = gl.join(halves[0], halves[1]).reshape([p.shape[0], 2 * p.shape[1]])
        return gl.convert_layout(p.to(dtype, bitcast=True), p_layout)
    return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _p_pack(p, dtype: gl.constexpr):
    """The float32 P rounded to the 16-bit `dtype`, two adjacent keys per int32 (a thread holds key pairs in the
    wgmma accumulator layout, so the pairing moves no data): what `_p_operand` unpacks into the P·V operand."""
    low, high = p.to(dtype).reshape([p.shape[0], p.shape[1] // 2, 2]).split()
    return gl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [low, high], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _consumer_item(item, num_ctas, num_m_tiles, num_q_heads, group_size, seqlen_q, seqlen_k, mask_args, alibi_args,
                   varlen_args, bias_ptr_args, qk_scale, CONSUMER: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                   CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, ALIBI: gl.constexpr,
                   VARLEN: gl.constexpr, BIAS_LOADS: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                   MASK_MOD: gl.constexpr, SCORE_MOD: gl.constexpr = False):
    """This consumer's share of the CTA's item-th work item: (its rows: TMA batch coordinate, query head, first row,
    the sequence's first Q row, Lq), the key tiles the CTA streams, the key tiles this consumer multiplies, and
    what its masks need: (first key of the CTA's tiles, start and end of the keys it sees unmasked, Lk, Lk - Lq,
    ALiBi slope · log2 e, the address of the item's bias plane where the consumer loads the bias (BIAS_LOADS;
    bias_ptr_args: base, batch and head strides) else None, Lq, ALiBi slope in raw score units (slope · log2 e /
    qk_scale) and the reference position of `_score_start`'s linear form (first row + Lk - Lq)); with a mask_mod
    (MASK_MOD: mask_args ends with its tensors and the block mask's lists) also (the item's block-mask lists, batch,
    query head): every consumer walks them whole; with a score_mod alone (SCORE_MOD), (0, batch, query head)."""
    batch, desc_batch, q_head, _, cta_start_m, q_row0, _, item_seqlen_q, item_seqlen_k = item_rows(
        item, num_ctas, num_m_tiles, num_q_heads, group_size, seqlen_q, seqlen_k, varlen_args, NUM_CONSUMERS * ROWS,
        CAUSAL, VARLEN)
    window_left, window_right, _, _, block_lists, _ = mask_args
    if MASK_MOD:
        item_lists = _item_tile_lists(block_lists, batch, q_head, cta_start_m, NUM_CONSUMERS * ROWS)
        key_start, cta_tiles = 0, item_lists[2]
    else:
        item_lists = 0  # unused (triton 3.6 cannot add a tuple holding None)
        key_start, cta_tiles = cta_key_tiles(cta_start_m, item_seqlen_q, item_seqlen_k, window_left, window_right,
                                              NUM_CONSUMERS * ROWS, BLOCK_N, CAUSAL, MASK_LEFT, MASK_RIGHT)
    start_m = cta_start_m + CONSUMER * ROWS
    if MASK_MOD:
        full_start, full_end, num_tiles = 0, 0, cta_tiles
    elif MASK_LEFT or MASK_RIGHT:
        # Every consumer walks the CTA's tiles from its first: with a left bound a lower one may find its first
        # tile fully masked (skipping it would let the cross-item prefetch wait on a stage it holds itself).
        _, full_start, full_end, key_end = key_tile_range(start_m, item_seqlen_q, item_seqlen_k, window_left,
                                                          window_right, ROWS, BLOCK_N, MASK_LEFT, MASK_RIGHT)
        num_tiles = gl.maximum(gl.cdiv(key_end - key_start, BLOCK_N), 1)
    else:
        full_end, key_end = key_tile_bounds(start_m, item_seqlen_k, item_seqlen_k - item_seqlen_q, ROWS, BLOCK_N,
                                            CAUSAL)
        full_start = 0
        num_tiles = gl.maximum(gl.cdiv(key_end, BLOCK_N), 1)
    # A right bound (causal or window): a consumer above the last sees fewer key tiles than the CTA streams (at most
    # cdiv((NUM_CONSUMERS - 1)·ROWS, BLOCK_N) fewer: tiles.sm90_cross_item_safe), and at least one (see
    # work_items.cta_key_tiles).
    num_tiles = gl.minimum(num_tiles, cta_tiles)
    if ALIBI:
        ALIBI_SLOPES, alibi_stride_b, alibi_stride_h = alibi_args
        alibi_slope_log2 = gl.load(ALIBI_SLOPES + batch * alibi_stride_b + q_head * alibi_stride_h) * LOG2_E
        alibi_raw = alibi_slope_log2 / qk_scale
    else:
        alibi_slope_log2 = 0.0
        alibi_raw = 0.0
    if BIAS_LOADS:
        bias_base, bias_stride_b, bias_stride_h = bias_ptr_args
        bias_plane = bias_base + batch.to(gl.int64) * bias_stride_b + q_head.to(gl.int64) * bias_stride_h
    else:
        bias_plane = 0  # unused
    rows = (desc_batch, q_head, start_m, q_row0, item_seqlen_q)
    tile_mask = (key_start, full_start, full_end, item_seqlen_k, item_seqlen_k - item_seqlen_q, alibi_slope_log2,
                 bias_plane, item_seqlen_q, alibi_raw, start_m + item_seqlen_k - item_seqlen_q)
    if MASK_MOD or SCORE_MOD:
        tile_mask = tile_mask + ((item_lists, batch, q_head),)
    return rows, cta_tiles, num_tiles, tile_mask


@gluon.jit
def _issue_first_scores(q_tile, q_ready, q_phase, k_smem, k_ready, ring, s_zero, tile_mask, bias_ring, bias_args,
                        BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr,
                        ALIBI_LINEAR: gl.constexpr, BIAS_START: gl.constexpr, s_layout: gl.constexpr):
    """S_0 = Q·K_0ᵀ of a work item (from `_score_start`, and `_bias_start`), issued asynchronously once its Q and
    first K tile have landed."""
    s_init = _score_start(s_zero, tile_mask[0], tile_mask, BLOCK_N, ALIBI_LINEAR, s_layout)
    mbarrier.wait(q_ready, q_phase)
    stage = ring % NUM_STAGES
    mbarrier.wait(k_ready.index(stage), (ring // NUM_STAGES) & 1)
    s_init = _bias_start(s_init, bias_ring, stage, bias_args, BLOCK_N, ALIBI_LINEAR, BIAS_START, s_layout)
    return warpgroup_mma(q_tile, k_smem.index(stage).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_init,
                         use_acc=ALIBI_LINEAR or BIAS_START, is_async=True)


@gluon.jit
def _v_operand(v_smem, stage, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr):
    """Ring stage `stage` of V as the P·V product's B operand, (BLOCK_N, BLOCK_D). e4m3 wgmma takes its B operand
    K-major only: e4m3 V arrives as Vᵀ tiles (the quantiser writes V K-major) and is read through a transposed
    view; 16-bit tiles are row-major."""
    if v_smem.dtype == gl.float8e4nv:
        return v_smem.index(stage).reshape([BLOCK_D, BLOCK_N]).permute((1, 0))
    else:
        return v_smem.index(stage).reshape([BLOCK_N, BLOCK_D])


@gluon.jit
def _wait_pv(o_acc, p_op):
    """Wait for the pending P·V product (and everything before it); returns the accumulator.

    16-bit P: the wait also takes P's registers, so nothing reuses them while the product reads them. e4m3 P
    cannot go there (triton 3.6 lowers the wait's operands to inline-asm constraints of 16, 32 or 64 bits only:
    "Unexpected bitwidth in WGMMAWaitGroupOp: 8"); its registers stay untouched because ptxas keeps a wgmma's
    register operands allocated until the wait that retires it (checked in the SASS: see docs/perf-notes.md, FP8)."""
    if p_op.dtype.primitive_bitwidth == 8:
        o_acc = warpgroup_mma_wait(0, deps=(o_acc,))
    else:
        o_acc, _ = warpgroup_mma_wait(0, deps=(o_acc, p_op))
    return o_acc


@gluon.constexpr_function
def _rescale_asm(pack):
    """PTX of `_rescale` for `pack` accumulator values per thread (operands: the values, tied in and out; their rows'
    alpha; the warp's flag): a warp-uniform branch over the multiplies."""
    muls = "".join(f"mul.f32 ${i}, ${i}, ${2 * pack + i}; " for i in range(pack))
    return ("{ .reg .pred %skip; setp.ne.b32 %skip, $" + str(3 * pack) + ", 0; @%skip bra.uni SKIP${:uid}; " + muls
            + "SKIP${:uid}: }")


@gluon.constexpr_function
def _rescale_constraints(pack):
    """The constraints of `_rescale_asm`."""
    return ",".join(["=f"] * pack + [str(i) for i in range(pack)] + ["f"] * pack + ["r"] * pack)


@gluon.jit
def _rescale(o_acc, alpha, o_rows: gl.constexpr, SKIP: gl.constexpr):
    """O *= alpha row by row. SKIP: every warp whose 16 rows all have alpha == 1 (none of their running maxima moved
    in the tile) branches past its BLOCK_D / 2 multiplies per thread (at D=256, 128 of the ~465 instructions a key
    tile costs each warp); bit-identical, x · 1 = x. The branch is warp-uniform: its flag is a vote over the lanes
    (each thread holds two rows, r and r + 8)."""
    alpha = gl.convert_layout(alpha, o_rows)
    if not SKIP:
        return o_acc * gl.expand_dims(alpha, 1)
    flag = gl.inline_asm_elementwise(
        "{ .reg .pred %a, %b; setp.eq.f32 %a, $2, 0f3F800000; setp.eq.f32 %b, $3, 0f3F800000; and.pred %a, %a, %b; "
        "vote.sync.all.pred %a, %a, 0xffffffff; selp.u32 $0, 1, 0, %a; mov.b32 $1, $0; }",
        "=r,=r,f,f", [alpha], dtype=gl.int32, is_pure=True, pack=2)
    PACK: gl.constexpr = o_acc.shape[1] // 2
    return gl.inline_asm_elementwise(_rescale_asm(PACK), _rescale_constraints(PACK),
                                     [o_acc, gl.expand_dims(alpha, 1), gl.expand_dims(flag, 1)],
                                     dtype=gl.float32, is_pure=True, pack=PACK)


@gluon.jit
def _item_scales(descales, batch, q_head, num_q_heads, group_size, qk_scale, FP8: gl.constexpr):
    """(softmax multiplier, output multiplier) of a work item. e4m3 inputs carry one descale per (batch, kv-head)
    (attention/fp8.py): q's and k's fold into the softmax multiplier (scores come out of the product unscaled),
    v's into the epilogue's normalisation. 16-bit inputs: (qk_scale, 1)."""
    if FP8:
        QD, KD, VD = descales
        slab = batch * (num_q_heads // group_size) + q_head // group_size
        return qk_scale * gl.load(QD + slab) * gl.load(KD + slab), gl.load(VD + slab)
    else:
        return qk_scale, 1.0


@gluon.jit
def _key_tiles(q_tile, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, ring, num_tiles, p, m_i, l_i, alpha,
               o_acc, s_zero, offs_m, tile_mask, mask_args, qk_scale, bias_ring, bias_args, mask_mod, score_mod,
               BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
               MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
               HAS_BIAS: gl.constexpr, BIAS_TMA: gl.constexpr,
               s_layout: gl.constexpr, o_rows: gl.constexpr, p_layout: gl.constexpr, P_DTYPE: gl.constexpr,
               turns, turn, CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr,
               SKIP_RESCALE: gl.constexpr, MOD_WIDTH: gl.constexpr):
    """Key tiles 1..num_tiles-1 of a work item whose tile 0 is in (p, m_i, l_i, alpha); see the module docstring.
    Returns the state after the last tile's softmax (its P·V is left to the caller) and the turn count.
    PINGPONG: each tile's two products are issued in this consumer's turn (`_take_turn`), and O is rescaled by
    alpha_j once P_{j-1}·V_{j-1} is done instead of before that product is issued, so that the turn holds the two
    issues only; the returned O is then already rescaled for the last tile."""
    ALIBI_LINEAR: gl.constexpr = ALIBI and not SOFTCAP
    BIAS_START: gl.constexpr = _bias_in_start(BIAS_TMA, SOFTCAP, BLOCK_D)
    ADD_BIAS: gl.constexpr = HAS_BIAS and not BIAS_START  # the softmax adds it
    for j in range(1, num_tiles):
        prev = (ring + j - 1) % NUM_STAGES
        stage = (ring + j) % NUM_STAGES
        s_init = _score_start(s_zero, tile_mask[0] + j * BLOCK_N, tile_mask, BLOCK_N, ALIBI_LINEAR, s_layout)
        mbarrier.wait(k_ready.index(stage), ((ring + j) // NUM_STAGES) & 1)
        s_init = _bias_start(s_init, bias_ring, stage, bias_args, BLOCK_N, ALIBI_LINEAR, BIAS_START, s_layout)
        _take_turn(turns, turn, CONSUMER, PINGPONG)
        s = warpgroup_mma(q_tile, k_smem.index(stage).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_init,
                          use_acc=ALIBI_LINEAR or BIAS_START, is_async=True)
        if not PINGPONG:
            o_acc = _rescale(o_acc, alpha, o_rows, SKIP_RESCALE)
        mbarrier.wait(v_ready.index(prev), ((ring + j - 1) // NUM_STAGES) & 1)
        p_op = _p_operand(p, q_tile.dtype, p_layout)
        o_acc = warpgroup_mma(p_op, _v_operand(v_smem, prev, BLOCK_N, BLOCK_D), o_acc, is_async=True)
        turn = _pass_turn(turns, turn, CONSUMER, NUM_CONSUMERS, PINGPONG)
        s = warpgroup_mma_wait(1, deps=(s,))  # S_j done; P_{j-1} V_{j-1} may still run
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, offs_m, tile_mask, mask_args, qk_scale,
                                           k_empty.index(stage), bias_ring, stage, bias_args, mask_mod, score_mod,
                                           BLOCK_N,
                                           CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, ADD_BIAS, BIAS_TMA,
                                           s_layout, P_DTYPE, p_layout, MOD_WIDTH)
        o_acc = _wait_pv(o_acc, p_op)
        mbarrier.arrive(v_empty.index(prev), count=1)
        if PINGPONG:  # outside the turn: O's rescale runs under the other consumers' products
            o_acc = _rescale(o_acc, alpha, o_rows, SKIP_RESCALE)
    return p, m_i, l_i, alpha, o_acc, turn


@gluon.jit
def _take_turn(turns, turn, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: wait until this consumer's `turn`-th turn to issue a key tile's two products. The consumers issue
    in a fixed rotation 0, 1, .., NUM_CONSUMERS-1, 0, ..: `turns` holds one barrier per consumer, on which its
    predecessor arrives once it has issued (`_pass_turn`), so while one warpgroup's products run on the tensor
    cores the others do their softmax, in order, rather than in whatever order the warp schedulers pick. Consumer
    0 takes its first turn at once (a fresh barrier's preceding phase counts as complete)."""
    if PINGPONG:
        mbarrier.wait(turns.index(CONSUMER), (turn & 1) ^ (1 if CONSUMER == 0 else 0))


@gluon.jit
def _pass_turn(turns, turn, CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: hand the turn to the next consumer in the rotation (see _take_turn); returns the turn count."""
    if PINGPONG:
        mbarrier.arrive(turns.index((CONSUMER + 1) % NUM_CONSUMERS), count=1)
    return turn + 1


@gluon.jit
def _skip_tiles(k_ready, v_ready, k_empty, v_empty, first, end, turns, turn, NUM_STAGES: gl.constexpr,
                CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    """Ring positions [first, end): the key tiles of the CTA's item this consumer does not multiply (a right-bounded
    mask). Releases their stages (`release_unused`), then, with PINGPONG, takes and passes their turns without
    issuing, so that every consumer takes the same number of turns per item and the rotation stays aligned (the
    turns wait on the consumers below, whose remaining tiles need those stages). Returns the turn count."""
    release_unused(k_ready, v_ready, k_empty, v_empty, first, end, NUM_STAGES)
    if PINGPONG:
        for _ in range(first, end):
            _take_turn(turns, turn, CONSUMER, PINGPONG)
            turn = _pass_turn(turns, turn, CONSUMER, NUM_CONSUMERS, PINGPONG)
    return turn


@gluon.jit
def _issue_last_pv(p, alpha, o_acc, v_smem, v_ready, last,
                   BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr,
                   o_rows: gl.constexpr, p_layout: gl.constexpr, PINGPONG: gl.constexpr,
                   SKIP_RESCALE: gl.constexpr):
    """The item's last O += P·V, issued asynchronously (returns the pending accumulator and its P operand). O is
    rescaled first, unless `_key_tiles` did (PINGPONG)."""
    if not PINGPONG:
        o_acc = _rescale(o_acc, alpha, o_rows, SKIP_RESCALE)
    mbarrier.wait(v_ready.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
    p_op = _p_operand(p, v_smem.dtype, p_layout)
    o_acc = warpgroup_mma(p_op, _v_operand(v_smem, last % NUM_STAGES, BLOCK_N, BLOCK_D), o_acc, is_async=True)
    return o_acc, p_op


@gluon.jit
def _store_output(o_acc, m_i, l_i, o_scale, o_desc, o_smem, o_smem_free, LSE, rows, num_q_heads, lse_rows,
                  varlen_args, tile_mask, ROWS: gl.constexpr, BLOCK_D: gl.constexpr, VARLEN: gl.constexpr,
                  ALIBI_LINEAR: gl.constexpr, FP8: gl.constexpr, s_rows: gl.constexpr, o_layout: gl.constexpr):
    """Normalise this consumer's rows of O and store them, and their log-sum-exp (natural log; -inf where no key).
    LSE is (batch, head, lse_rows) (varlen: (head, total_q) packed; lse_rows = total_q). ALIBI_LINEAR: m lacks
    ALiBi's row term -slope·(i - start_m) (`_score_start`), added back here.

    O goes out through shared memory and one TMA store: `o_smem` is the consumer's Q buffer of this item, free
    since its last Q·Kᵀ, and released to the producer (`o_smem_free`) once the copy has read it. Storing from
    registers instead is one 4-byte store per thread per 2 columns, each warp instruction touching 8 rows: the SM
    clock timeline measured it at 3.5k cycles per item at D=128 (9.4k at D=256), more than a whole key tile.
    The TMA box clips rows past the tensor's end and the padded columns past the head dim. A varlen sequence's
    last rows are the exception: the box would write into the next sequence, so a tile that runs past the
    sequence's end stores from registers with a row mask (one such tile per sequence and head)."""
    desc_batch, q_head, start_m, q_row0, seqlen_q = rows
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_m = start_m + gl.arange(0, ROWS, layout=s_rows)
    no_key = l_i == 0.0
    l_safe = gl.where(no_key, 1.0, l_i)
    if ALIBI_LINEAR:
        m_i = m_i - tile_mask[5] * (offs_m - start_m).to(gl.float32)
    lse = gl.where(no_key, float("-inf"), (m_i + gl.log2(l_safe)) * LN_2)
    lse_row0 = (desc_batch * num_q_heads + q_head).to(gl.int64) * lse_rows + q_row0
    gl.store(LSE + lse_row0 + offs_m, lse, mask=offs_m < seqlen_q)

    if FP8:  # o_scale: v's descale (_item_scales)
        out = o_acc * gl.expand_dims(gl.convert_layout(o_scale / l_safe, o_rows), 1)
    else:
        out = o_acc / gl.expand_dims(gl.convert_layout(l_safe, o_rows), 1)
    if VARLEN:
        if start_m + ROWS > seqlen_q:
            out_rows = start_m + gl.arange(0, ROWS, layout=o_rows)
            cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
            row_offsets = ((q_row0 + out_rows).to(gl.int64) * varlen_args.stride_om
                           + q_head.to(gl.int64) * varlen_args.stride_oh)
            ptrs = varlen_args.out + gl.expand_dims(row_offsets, 1) + gl.expand_dims(cols, 0)
            inside = gl.expand_dims(out_rows < seqlen_q, 1) & gl.expand_dims(cols < varlen_args.head_dim, 0)
            gl.store(ptrs, out.to(varlen_args.out.dtype.element_ty), mask=inside)
            mbarrier.arrive(o_smem_free, count=1)
        else:
            _tma_store_rows(out, o_desc, o_smem, o_smem_free, [0, q_head, q_row0 + start_m, 0], ROWS, BLOCK_D)
    else:
        _tma_store_rows(out, o_desc, o_smem, o_smem_free, [desc_batch, q_head, start_m, 0], ROWS, BLOCK_D)


@gluon.jit
def _tma_store_rows(out, o_desc, o_smem, o_smem_free, coords, ROWS: gl.constexpr, BLOCK_D: gl.constexpr):
    """Stage the normalised rows in the consumer's Q buffer, store them with one TMA copy, release the buffer."""
    o_smem.reshape([ROWS, BLOCK_D]).store(out.to(o_desc.dtype))
    fence_async_shared()  # the generic-proxy writes above before the TMA engine's read
    tma.async_store(o_desc, coords, o_smem)
    tma.store_wait(0)  # the copy has read the buffer (its global writes may still be in flight)
    mbarrier.arrive(o_smem_free, count=1)


@gluon.jit
def _output_staging(q_smems, o_smems, q_buf, CONSUMER: gl.constexpr, FP8: gl.constexpr):
    """Where a consumer stages its output rows for the TMA store: its Q buffer of the item (free after the item's
    last Q·Kᵀ), or with e4m3 inputs its bf16 buffer in `o_smems`."""
    if FP8:
        return o_smems.index(CONSUMER)
    else:
        return q_smems.index(q_buf)


@gluon.jit
def _attention_consumer(q_smems, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, LSE,
                        num_work, num_m_tiles, num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale,
                        mask_args, alibi_args, varlen_args, bias_ring, bias_ptr_args, bias_args, descales, o_smems,
                        mask_mod, score_mod, CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, ROWS: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr,
                        CAUSAL: gl.constexpr, Q_BUFFERS: gl.constexpr, CROSS_ITEM: gl.constexpr,
                        MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                        ALIBI: gl.constexpr, VARLEN: gl.constexpr, HAS_BIAS: gl.constexpr, BIAS_TMA: gl.constexpr,
                        turns, PINGPONG: gl.constexpr, SKIP_RESCALE: gl.constexpr):
    """One consumer warpgroup (number CONSUMER of NUM_CONSUMERS): its `ROWS` rows of every work item the CTA owns,
    in the producer's order.

    With CROSS_ITEM the items overlap: the next item's S_0 = Q·K_0ᵀ is issued before the current item's last P·V,
    and its softmax runs while that product does, so an item boundary costs no more tensor-core idle time than
    any other key tile; the current item's epilogue follows. This needs the next item's K_0 to be loadable before
    this consumer's last P·V completes: K_0 reuses the ring stage of tile `last + 1 + unused - NUM_STAGES`, which
    is released already unless NUM_STAGES <= 1 + unused (unused: tiles only the consumers below need, only with a
    right bound: causal or a window; at most one with 128-key tiles), hence tiles.sm90_cross_item_safe.

    HAS_BIAS (two consumers): `bias_ring` is this consumer's ring of bias tiles (BIAS_TMA) or None, `bias_ptr_args`
    what it loads the bias through otherwise, `bias_args` what both need (see _consumer_item, _bias_tile).

    e4m3 Q, K, V (FP8): the same loop on e4m3 products (wgmma K = 32), P rounded to e4m3 in registers, the
    descales (`descales`: QD, KD, VD) folded into each item's multipliers (_item_scales), and the bf16 output
    staged in `o_smems` (the consumer's e4m3 Q buffer holds half its bytes).

    PINGPONG: the consumers issue each key tile's two products in rotation (`_take_turn`, barriers `turns`); an
    item's first Q·Kᵀ and last P·V are issued outside it. SKIP_RESCALE: see `_rescale`. mask_mod, score_mod: the
    user's (see _softmax_tile), or None."""
    num_warps: gl.constexpr = 4
    MOD_WIDTH: gl.constexpr = _mod_width(VARLEN)  # a mask_mod's column slices (_masked)
    FP8: gl.constexpr = q_smems.dtype == gl.float8e4nv
    INSTR_K: gl.constexpr = 32 if FP8 else 16  # wgmma's K: 32 bytes of the operands' elements
    BIAS_LOADS: gl.constexpr = HAS_BIAS and not BIAS_TMA
    ALIBI_LINEAR: gl.constexpr = ALIBI and not SOFTCAP  # see _score_start
    BIAS_START: gl.constexpr = _bias_in_start(BIAS_TMA, SOFTCAP, BLOCK_D)
    ADD_BIAS: gl.constexpr = HAS_BIAS and not BIAS_START  # the softmax adds it
    # wgmma layouts: warps stacked along the rows (16 rows each); instruction N = the full tile width.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, INSTR_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_D, INSTR_K])
    # P as the register A operand: 4 bytes of adjacent keys per register
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    P_DTYPE: gl.constexpr = q_smems.dtype if NUM_CONSUMERS > 2 else None  # see _p_operand
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    num_ctas = gl.num_programs(0)
    num_items = cta_num_items(num_work)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    o_zero = gl.zeros([ROWS, BLOCK_D], gl.float32, layout=o_layout)
    m_init = gl.full([ROWS], float("-inf"), gl.float32, layout=s_rows)
    l_init = gl.zeros([ROWS], gl.float32, layout=s_rows)

    # The first item's tile 0: nothing to overlap with yet.
    ring = 0  # ring position of the current item's first K/V tile
    rows, cta_tiles, num_tiles, tile_mask = _consumer_item(
        0, num_ctas, num_m_tiles, num_q_heads, group_size, seqlen_q, seqlen_k, mask_args, alibi_args, varlen_args,
        bias_ptr_args, qk_scale, CONSUMER, ROWS, BLOCK_N, CAUSAL, MASK_LEFT, MASK_RIGHT, ALIBI, VARLEN,
        BIAS_LOADS, NUM_CONSUMERS, mask_mod is not None, score_mod is not None)
    scale, o_scale = _item_scales(descales, rows[0], rows[1], num_q_heads, group_size, qk_scale, FP8)
    q_buf = CONSUMER * Q_BUFFERS
    s = _issue_first_scores(q_smems.index(q_buf).reshape([ROWS, BLOCK_D]), q_ready.index(q_buf), 0, k_smem,
                            k_ready, ring, s_zero, tile_mask, bias_ring, bias_args, BLOCK_N, BLOCK_D, NUM_STAGES,
                            ALIBI_LINEAR, BIAS_START, s_layout)
    s = warpgroup_mma_wait(0, deps=(s,))
    offs_m = rows[2] + gl.arange(0, ROWS, layout=s_rows)
    p, m_i, l_i, alpha = _softmax_tile(s, m_init, l_init, 0, offs_m, tile_mask, mask_args, scale,
                                       k_empty.index(ring % NUM_STAGES), bias_ring, ring % NUM_STAGES, bias_args,
                                       mask_mod, score_mod, BLOCK_N, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI,
                                       ADD_BIAS,
                                       BIAS_TMA,
                                       s_layout, P_DTYPE, p_layout, MOD_WIDTH)
    o_acc = o_zero
    turn = 0  # key-tile turns taken (PINGPONG: _take_turn)

    for item in range(num_items - 1):
        q_buf = CONSUMER * Q_BUFFERS + item % Q_BUFFERS
        p, m_i, l_i, alpha, o_acc, turn = _key_tiles(
            q_smems.index(q_buf).reshape([ROWS, BLOCK_D]), k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, ring,
            num_tiles, p, m_i, l_i, alpha, o_acc, s_zero, offs_m, tile_mask, mask_args, scale, bias_ring, bias_args,
            mask_mod, score_mod, BLOCK_N, BLOCK_D, NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_BIAS,
            BIAS_TMA, s_layout,
            o_rows, p_layout, P_DTYPE, turns, turn, CONSUMER, NUM_CONSUMERS, PINGPONG, SKIP_RESCALE, MOD_WIDTH)
        last = ring + num_tiles - 1
        next_ring = ring + cta_tiles
        next_buf = CONSUMER * Q_BUFFERS + (item + 1) % Q_BUFFERS
        next_q = q_smems.index(next_buf).reshape([ROWS, BLOCK_D])
        n_rows, n_cta_tiles, n_num_tiles, n_tile_mask = _consumer_item(
            item + 1, num_ctas, num_m_tiles, num_q_heads, group_size, seqlen_q, seqlen_k, mask_args, alibi_args,
            varlen_args, bias_ptr_args, qk_scale, CONSUMER, ROWS, BLOCK_N, CAUSAL, MASK_LEFT, MASK_RIGHT, ALIBI,
            VARLEN, BIAS_LOADS, NUM_CONSUMERS, mask_mod is not None, score_mod is not None)
        n_offs_m = n_rows[2] + gl.arange(0, ROWS, layout=s_rows)
        n_scale, n_o_scale = _item_scales(descales, n_rows[0], n_rows[1], num_q_heads, group_size, qk_scale, FP8)
        if CROSS_ITEM:
            s = _issue_first_scores(next_q, q_ready.index(next_buf), ((item + 1) // Q_BUFFERS) & 1, k_smem, k_ready,
                                    next_ring, s_zero, n_tile_mask, bias_ring, bias_args, BLOCK_N, BLOCK_D,
                                    NUM_STAGES, ALIBI_LINEAR, BIAS_START, s_layout)
            o_acc, p_op = _issue_last_pv(p, alpha, o_acc, v_smem, v_ready, last, BLOCK_N, BLOCK_D, NUM_STAGES, o_rows,
                                         p_layout, PINGPONG, SKIP_RESCALE)
            s = warpgroup_mma_wait(1, deps=(s,))  # the next item's S_0 is done; this item's last P·V may still run
            p, m_next, l_next, alpha = _softmax_tile(
                s, m_init, l_init, 0, n_offs_m, n_tile_mask, mask_args, n_scale, k_empty.index(next_ring % NUM_STAGES),
                bias_ring, next_ring % NUM_STAGES, bias_args, mask_mod, score_mod, BLOCK_N, CAUSAL, MASK_LEFT,
                MASK_RIGHT, SOFTCAP, ALIBI,
                ADD_BIAS, BIAS_TMA, s_layout, P_DTYPE, p_layout, MOD_WIDTH)
            o_acc = _wait_pv(o_acc, p_op)
            mbarrier.arrive(v_empty.index(last % NUM_STAGES), count=1)
            turn = _skip_tiles(k_ready, v_ready, k_empty, v_empty, ring + num_tiles, next_ring, turns, turn,
                               NUM_STAGES, CONSUMER, NUM_CONSUMERS, PINGPONG)
            _store_output(o_acc, m_i, l_i, o_scale, o_desc, _output_staging(q_smems, o_smems, q_buf, CONSUMER, FP8),
                          q_empty.index(q_buf), LSE, rows, num_q_heads, seqlen_q, varlen_args, tile_mask, ROWS,
                          BLOCK_D, VARLEN, ALIBI_LINEAR, FP8, s_rows, o_layout)
        else:
            o_acc, p_op = _issue_last_pv(p, alpha, o_acc, v_smem, v_ready, last, BLOCK_N, BLOCK_D, NUM_STAGES, o_rows,
                                         p_layout, PINGPONG, SKIP_RESCALE)
            o_acc = _wait_pv(o_acc, p_op)
            mbarrier.arrive(v_empty.index(last % NUM_STAGES), count=1)
            turn = _skip_tiles(k_ready, v_ready, k_empty, v_empty, ring + num_tiles, next_ring, turns, turn,
                               NUM_STAGES, CONSUMER, NUM_CONSUMERS, PINGPONG)
            _store_output(o_acc, m_i, l_i, o_scale, o_desc, _output_staging(q_smems, o_smems, q_buf, CONSUMER, FP8),
                          q_empty.index(q_buf), LSE, rows, num_q_heads, seqlen_q, varlen_args, tile_mask, ROWS,
                          BLOCK_D, VARLEN, ALIBI_LINEAR, FP8, s_rows, o_layout)
            s = _issue_first_scores(next_q, q_ready.index(next_buf), ((item + 1) // Q_BUFFERS) & 1, k_smem, k_ready,
                                    next_ring, s_zero, n_tile_mask, bias_ring, bias_args, BLOCK_N, BLOCK_D,
                                    NUM_STAGES, ALIBI_LINEAR, BIAS_START, s_layout)
            s = warpgroup_mma_wait(0, deps=(s,))
            p, m_next, l_next, alpha = _softmax_tile(
                s, m_init, l_init, 0, n_offs_m, n_tile_mask, mask_args, n_scale, k_empty.index(next_ring % NUM_STAGES),
                bias_ring, next_ring % NUM_STAGES, bias_args, mask_mod, score_mod, BLOCK_N, CAUSAL, MASK_LEFT,
                MASK_RIGHT, SOFTCAP, ALIBI,
                ADD_BIAS, BIAS_TMA, s_layout, P_DTYPE, p_layout, MOD_WIDTH)
        m_i, l_i, o_acc = m_next, l_next, o_zero
        if FP8:  # 16-bit inputs: both stay qk_scale and 1
            scale, o_scale = n_scale, n_o_scale
        rows, cta_tiles, num_tiles, tile_mask = n_rows, n_cta_tiles, n_num_tiles, n_tile_mask
        offs_m = n_offs_m
        ring = next_ring

    # The last item: nothing left to overlap its last P·V with.
    q_buf = CONSUMER * Q_BUFFERS + (num_items - 1) % Q_BUFFERS
    p, m_i, l_i, alpha, o_acc, turn = _key_tiles(
        q_smems.index(q_buf).reshape([ROWS, BLOCK_D]), k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, ring,
        num_tiles, p, m_i, l_i, alpha, o_acc, s_zero, offs_m, tile_mask, mask_args, scale, bias_ring, bias_args,
        mask_mod, score_mod, BLOCK_N, BLOCK_D, NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_BIAS,
        BIAS_TMA,
        s_layout,
        o_rows, p_layout, P_DTYPE, turns, turn, CONSUMER, NUM_CONSUMERS, PINGPONG, SKIP_RESCALE, MOD_WIDTH)
    last = ring + num_tiles - 1
    o_acc, p_op = _issue_last_pv(p, alpha, o_acc, v_smem, v_ready, last, BLOCK_N, BLOCK_D, NUM_STAGES, o_rows,
                                 p_layout, PINGPONG, SKIP_RESCALE)
    o_acc = _wait_pv(o_acc, p_op)
    mbarrier.arrive(v_empty.index(last % NUM_STAGES), count=1)
    _skip_tiles(k_ready, v_ready, k_empty, v_empty, ring + num_tiles, ring + cta_tiles, turns, turn, NUM_STAGES,
                CONSUMER, NUM_CONSUMERS, PINGPONG)
    _store_output(o_acc, m_i, l_i, o_scale, o_desc, _output_staging(q_smems, o_smems, q_buf, CONSUMER, FP8),
                  q_empty.index(q_buf), LSE, rows, num_q_heads, seqlen_q, varlen_args, tile_mask, ROWS, BLOCK_D,
                  VARLEN, ALIBI_LINEAR, FP8, s_rows, o_layout)


@gluon.jit(do_not_specialize=PER_BATCH_ARGS)
def attention_forward_sm90_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE,
    num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale, num_m_tiles, num_work,
    window_left, window_right, softcap_scale, ALIBI_SLOPES, alibi_stride_b, alibi_stride_h,
    CU_SEQLENS_Q, CU_SEQLENS_K, TILE_OFFSETS, num_seqs, O, stride_oh, stride_om, head_dim,
    bias_desc, BIAS, bias_stride_b, bias_stride_h, bias_stride_m, bias_stride_n, bias_log2, QD, KD, VD,
    mask_mod, mask_mod_args, FULL_COUNTS, PARTIAL_COUNTS, WALK_TILES, mod_q_tiles, list_len,
    score_mod, score_mod_args,
    BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, Q_BUFFERS: gl.constexpr, CROSS_ITEM: gl.constexpr,
    MASK_LEFT: gl.constexpr = False, MASK_RIGHT: gl.constexpr = False, SOFTCAP: gl.constexpr = False,
    ALIBI: gl.constexpr = False, VARLEN: gl.constexpr = False, HAS_BIAS: gl.constexpr = False,
    BIAS_TMA: gl.constexpr = False, NUM_CONSUMERS: gl.constexpr = 2, PINGPONG: gl.constexpr = False,
    SKIP_RESCALE: gl.constexpr = False, VARLEN_BAND: gl.constexpr = 1, MASK_MOD: gl.constexpr = False,
    SCORE_MOD: gl.constexpr = False,
):
    """Persistent: the CTAs share the num_work = B·Hq·num_m_tiles work items in rounds (see work_items.work_tile).
    A work item is NUM_CONSUMERS·64 query rows (`num_consumers`); launch with gluon/sm90.launch_options of that
    count.

    Masks (mask.MaskSpec.kernel_args): CAUSAL is the plain causal mask (left unbounded, right 0); any other window
    sets MASK_LEFT/MASK_RIGHT with window_left/window_right. SOFTCAP (softcap_scale, qk_scale = c·log2 e) and ALIBI
    (slopes at ALIBI_SLOPES + b·alibi_stride_b + h·alibi_stride_h) modify the scores. VARLEN: q/k/v/o are (1, H,
    total, D) views of packed tensors, sequences delimited by CU_SEQLENS_Q/K (num_seqs of them); TILE_OFFSETS
    numbers their query tiles (seqlen.VarlenBatch; work_items.varlen_work); num_work is read from it; O (base of o,
    with its head and row strides and head_dim) takes each sequence's ragged last rows; LSE is (H, total_q) and
    seqlen_q = total_q.
    HAS_BIAS: an additive bias, times bias_log2 (see _softmax_tile), read by TMA through bias_desc (BIAS_TMA: boxes
    of 64 query rows x BLOCK_N keys; bias_stride_b/h are the batch and head steps of its coordinate, 0 where it
    broadcasts) or by the consumers' masked loads from BIAS with the four element strides (0 where it broadcasts).
    e4m3 q, k and Vᵀ descriptors (attention_forward_sm90_fp8): QD, KD, VD are their float32 (B, Hkv) descales and
    o_desc a bf16 output's.
    MASK_MOD: the user's `mask_mod` (a `@triton.jit` function) with its captured tensors `mask_mod_args`, and its
    block mask at the CTA's BLOCK_M x BLOCK_N tiles (mods.BlockMask.walk: per (b, h, query tile) of mod_q_tiles, its
    full and partial counts and its key tiles in that order, list_len each): each item streams its full key tiles,
    unmasked, then its partial ones, masked with the mod.
    SCORE_MOD: the user's `score_mod` with its captured tensors `score_mod_args`, applied to every visited score
    (`_scored`), the mask after it.
    Arguments a call does not use are None (constexpr: a plain call compiles to the plain kernel)."""
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = q_desc.block_type.shape[2]  # rows per consumer
    if VARLEN:
        if CAUSAL:  # seqlen.ranked_work_list of bands of VARLEN_BAND query tiles (work_items.varlen_work)
            num_work = num_q_heads * VARLEN_BAND * gl.load(TILE_OFFSETS)
        else:  # seqlen.work_list
            num_work = num_q_heads * gl.load(TILE_OFFSETS + num_seqs)
        # the grid is bounded by the rows (the work list is read here): a CTA past the last item has none, and the
        # consumers' first item is unconditional
        if gl.program_id(0) >= num_work:
            return
    if MASK_MOD:
        block_lists = (FULL_COUNTS, PARTIAL_COUNTS, WALK_TILES, mod_q_tiles, list_len, num_q_heads)
    else:
        block_lists: gl.constexpr = None
    # the mods' tensors and the block mask's lists ride with the mask (_consumer_item, _softmax_tile); None where
    # absent
    mask_args = (window_left, window_right, softcap_scale, mask_mod_args, block_lists, score_mod_args)
    alibi_args = (ALIBI_SLOPES, alibi_stride_b, alibi_stride_h)
    bias_ptr_args = (BIAS, bias_stride_b, bias_stride_h)
    bias_args = (bias_stride_m, bias_stride_n, bias_log2)
    varlen_args = VarlenArgs(CU_SEQLENS_Q, CU_SEQLENS_K, TILE_OFFSETS, num_seqs, O, stride_oh, stride_om, head_dim,
                             VARLEN_BAND)
    descales = (QD, KD, VD)

    # Q: one buffer per consumer, or two (Q_BUFFERS=2) so the next item's Q loads while this item runs
    q_smems = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS * Q_BUFFERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS * Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS * Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_CONSUMERS * Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)  # each consumer owns its rows of the Q tile
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    if PINGPONG:  # the consumers' issue rotation (_take_turn)
        turns = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_CONSUMERS):
            mbarrier.init(turns.index(i), count=1)
    else:
        turns: gl.constexpr = None
    if BIAS_TMA:  # one ring per consumer: the bias tiles of its rows, a stage beside each K stage
        gl.static_assert(NUM_CONSUMERS == 2, "attn_bias runs on two consumers (tiles.sm90_forward_consumers)")
        bias_upper = gl.allocate_shared_memory(bias_desc.dtype, [NUM_STAGES] + bias_desc.block_type.shape,
                                               bias_desc.layout)
        bias_lower = gl.allocate_shared_memory(bias_desc.dtype, [NUM_STAGES] + bias_desc.block_type.shape,
                                               bias_desc.layout)
    else:
        bias_upper: gl.constexpr = None
        bias_lower: gl.constexpr = None
    if dtype == gl.float8e4nv:  # the bf16 output's staging buffers, one per consumer
        o_smems = gl.allocate_shared_memory(o_desc.dtype, [NUM_CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
    else:
        o_smems: gl.constexpr = None

    # consumer 0 is the default partition (the launch's 4 warps); the other consumers and the producer warp (the
    # last partition) are workers. One comprehension: a `+` of partition lists would unwrap their None arguments.
    gl.warp_specialize([
        (_producer, (q_desc, k_desc, v_desc, q_smems, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                     k_empty, v_empty, num_work, num_m_tiles, num_q_heads, group_size, seqlen_q, seqlen_k,
                     window_left, window_right, varlen_args, bias_desc, bias_upper, bias_lower, bias_stride_b,
                     bias_stride_h, NUM_STAGES, BLOCK_N, CAUSAL, Q_BUFFERS, MASK_LEFT, MASK_RIGHT, VARLEN,
                     BIAS_TMA, NUM_CONSUMERS, block_lists, MASK_MOD))
        if partition == NUM_CONSUMERS else
        (_attention_consumer, (q_smems, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc,
                               LSE, num_work, num_m_tiles, num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale,
                               mask_args, alibi_args, varlen_args, bias_upper if partition == 0 else bias_lower,
                               bias_ptr_args, bias_args, descales,
                               o_smems, mask_mod, score_mod, partition, NUM_CONSUMERS, ROWS, BLOCK_N, BLOCK_D,
                               NUM_STAGES, CAUSAL,
                               Q_BUFFERS, CROSS_ITEM, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, VARLEN, HAS_BIAS,
                               BIAS_TMA, turns, PINGPONG, SKIP_RESCALE))
        for partition in (0, 1, 2, 3)[:NUM_CONSUMERS + 1]
    ], [4] * (NUM_CONSUMERS - 1) + [1],
        [consumer_registers(NUM_CONSUMERS)] * (NUM_CONSUMERS - 1) + [PRODUCER_REGISTERS])


def _tensor_args(k_rows, block_d, q, k, v, out, lse):
    """The kernel's per-call arguments: TMA descriptors over q, k, v, out (boxes of one consumer's rows, of one key
    tile; a 16-bit out's box is staged in the consumer's Q buffer, so it shares q's; e4m3 V is K-major and read as
    Vᵀ boxes of (head dim, keys)), then lse."""
    if v.dtype == FP8_DTYPE:
        v_desc = descriptor(v.transpose(-1, -2), block_d, k_rows)
    else:
        v_desc = descriptor(v, k_rows, block_d)
    return (descriptor(q, CONSUMER_ROWS, block_d), descriptor(k, k_rows, block_d), v_desc,
            descriptor(out, CONSUMER_ROWS, block_d), lse)


def _mask_launch_args(mask: MaskSpec, softmax_scale: float) -> tuple[dict, dict]:
    """The mask's kernel scalars and constexprs (mask.MaskSpec.kernel_args). The plain causal mask (left unbounded,
    right 0) runs as CAUSAL, the dense kernel's own path (mask.key_tile_bounds, heaviest query tiles first); other
    windows as MASK_LEFT/MASK_RIGHT. Unused scalars are None, so a plain call compiles to the plain kernel."""
    kernel = mask.kernel_args(softmax_scale)
    plain_causal = mask.plain_causal
    mask_left, mask_right = kernel["MASK_LEFT"], kernel["MASK_RIGHT"] and not plain_causal
    scalars = dict(qk_scale=kernel["qk_scale"],
                   window_left=kernel["window_left"] if mask_left else None,
                   window_right=kernel["window_right"] if mask_right else None,
                   softcap_scale=kernel["softcap_scale"] if kernel["SOFTCAP"] else None)
    constexprs = dict(CAUSAL=plain_causal, MASK_LEFT=mask_left, MASK_RIGHT=mask_right, SOFTCAP=kernel["SOFTCAP"])
    return scalars, constexprs


def _bias_launch_args(bias, q, k, block_n: int, qk_scale: float, log2_scores: bool, bias_tma: bool) -> tuple:
    """The kernel's bias arguments `(bias_desc, BIAS, bias_stride_b, bias_stride_h, bias_stride_m, bias_stride_n,
    bias_log2)`: a TMA descriptor over `layout.bias_tma_view` with its coordinate steps (bias_tma), or the bias's
    strides over the full (B, H, Lq, Lk) problem, 0 where it broadcasts. bias_log2: see _softmax_tile."""
    if bias is None:
        return (None,) * 7
    bias_log2 = LOG2_E.value if log2_scores else LOG2_E.value / qk_scale
    if bias_tma:
        tma_view = bias_tma_view(bias, q.shape[2], k.shape[2])
        if tma_view is None:
            raise ValueError(f"bias_tma needs a bias TMA can read (layout.bias_tma_view), got shape "
                             f"{tuple(bias.shape)}, strides {bias.stride()}")
        view, step_b, step_h = tma_view
        return descriptor(view, CONSUMER_ROWS, block_n), None, step_b, step_h, None, None, bias_log2
    strides = bias_strides(bias, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    return None, bias, *strides, bias_log2


# The same kernel for packed launches, unspecialised on the packed totals too (seqlen.PACKED_TOTALS); dense launches
# keep the build specialised on their lengths.
attention_forward_sm90_varlen_kernel = gluon.jit(do_not_specialize=PER_BATCH_ARGS + PACKED_TOTALS)(
    attention_forward_sm90_kernel.fn)


def _kernel(varlen):
    return attention_forward_sm90_kernel if varlen is None else attention_forward_sm90_varlen_kernel


def _launch_args(q, k, v, out, lse, causal, softmax_scale, tiles, num_ctas, q_buffers, cross_item, mask=None,
                 alibi_slopes=None, varlen=None, attn_bias=None, bias_tma=False, descales=None, mask_mod=None,
                 blocks=None, score_mod=None):
    """(grid, positional args, constexprs) of one launch; see attention_forward_sm90 (and, with `descales`,
    attention_forward_sm90_fp8)."""
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    if mask is None:
        mask = MaskSpec(causal=causal, window_right=0 if causal else -1)
    elif mask.causal != causal:
        raise ValueError(f"mask.causal ({mask.causal}) and causal ({causal}) disagree")
    scalars, mask_constexprs = _mask_launch_args(mask, softmax_scale)
    right_bounded = mask_constexprs["CAUSAL"] or mask_constexprs["MASK_RIGHT"]
    if cross_item and not sm90_cross_item_safe(right_bounded, tiles):
        raise ValueError(f"cross_item needs a mask without a right bound (causal, window) or a ring with a stage "
                         f"more than the tiles a consumer may skip (tiles.sm90_cross_item_safe), got {tiles}")
    if cross_item and q_buffers != 2:
        # the next item's Q·Kᵀ would read the buffer this item's output is staged in
        raise ValueError(f"cross_item needs two Q buffers, got q_buffers={q_buffers}")
    if (q.dtype == FP8_DTYPE) != (descales is not None):
        raise ValueError("e4m3 inputs take their descales (attention_forward_sm90_fp8), 16-bit inputs none")
    if descales is not None and (mask.bounded_left or mask.softcap or alibi_slopes is not None or varlen is not None
                                 or attn_bias is not None):
        raise ValueError("the e4m3 forward takes the causal mask only (no window, softcap, ALiBi, varlen or bias)")
    out_dtype = torch.bfloat16 if descales is not None else q.dtype
    if out.dtype != out_dtype or out.shape != q.shape or not tma_compatible(out):
        raise ValueError(f"out must have q's shape, dtype {out_dtype} and TMA-compatible strides (see "
                         f"layout.tma_compatible)")
    block_d = padded_head_dim(head_dim)
    consumers = num_consumers(tiles)
    block_m = tiles.block_m
    alibi = (None, None, None)
    if alibi_slopes is not None:  # (H,) or (B, H) float32
        alibi = (alibi_slopes, 0 if alibi_slopes.dim() == 1 else alibi_slopes.stride(0), alibi_slopes.stride(-1))
    if varlen is None:
        num_m_tiles = (seqlen_q + block_m - 1) // block_m
        num_work = num_m_tiles * batch * num_q_heads
        varlen_args = (None,) * 8
    else:
        if batch != 1:
            raise ValueError(f"varlen launches take (1, H, total, D) views of the packed tensors, got {tuple(q.shape)}")
        # The kernel reads the number of real tiles (>= cdiv(total_q, block_m)) from tile_offsets: this many
        # CTAs all find work.
        num_m_tiles, num_work = None, None
        num_seqs = varlen.cu_seqlens_q.shape[0] - 1
        entries = (ranked_work_list_entries(num_seqs, seqlen_q, block_m * varlen.band) if mask_constexprs["CAUSAL"]
                   else num_seqs + 1)
        if varlen.tile_offsets.shape != (entries,):
            raise ValueError(f"varlen.tile_offsets must have {entries} entries (seqlen.VarlenBatch: the work list "
                             f"for this mask), got {tuple(varlen.tile_offsets.shape)}")
        varlen_args = (varlen.cu_seqlens_q, varlen.cu_seqlens_k, varlen.tile_offsets, num_seqs, out, out.stride(1),
                       out.stride(2), head_dim)
    if attn_bias is not None and varlen is not None:
        raise ValueError("attn_bias is not taken with a packed (varlen) batch")
    mod_args = _mod_args(mask_mod, score_mod, blocks, tiles, mask, alibi_slopes, attn_bias, descales)
    if (attn_bias is not None or descales is not None) and consumers != 2:
        # three consumers pack a 16-bit P (_p_pack); the bias rings are laid out for two
        raise ValueError(f"attn_bias and e4m3 inputs run on two consumer warpgroups (tiles.sm90_forward_consumers), "
                         f"got {tiles}")
    log2_scores = alibi_slopes is not None and mask_constexprs["SOFTCAP"]  # see _softmax_tile
    bias_args = _bias_launch_args(attn_bias, q, k, tiles.block_n, scalars["qk_scale"], log2_scores, bias_tma)
    # a packed batch's items: at most its tiles, plus the tiles its sequences' bands repeat
    work_bound = (num_q_heads * ((seqlen_q + block_m - 1) // block_m + (varlen.band - 1) * num_seqs)
                  if varlen is not None else num_work)
    grid = (max(1, work_bound if num_ctas is None else min(num_ctas, work_bound)),)
    args = (*_tensor_args(tiles.block_n, block_d, q, k, v, out, lse), num_q_heads, num_q_heads // k.shape[1],
            seqlen_q, k.shape[2], scalars["qk_scale"], num_m_tiles, num_work,
            scalars["window_left"], scalars["window_right"], scalars["softcap_scale"], *alibi, *varlen_args,
            *bias_args, *(descales or (None,) * 3), *mod_args)
    constexprs = dict(BLOCK_N=tiles.block_n, BLOCK_D=block_d, NUM_STAGES=tiles.num_stages,
                      CAUSAL=mask_constexprs["CAUSAL"], Q_BUFFERS=q_buffers, CROSS_ITEM=cross_item)
    constexprs.update(MASK_LEFT=mask_constexprs["MASK_LEFT"], MASK_RIGHT=mask_constexprs["MASK_RIGHT"],
                      SOFTCAP=mask_constexprs["SOFTCAP"], ALIBI=alibi_slopes is not None, VARLEN=varlen is not None,
                      VARLEN_BAND=varlen.band if varlen is not None and mask_constexprs["CAUSAL"] else 1)
    constexprs.update(HAS_BIAS=attn_bias is not None, BIAS_TMA=attn_bias is not None and bias_tma,
                      NUM_CONSUMERS=consumers, PINGPONG=sm90_forward_pingpong(head_dim, descales is not None),
                      SKIP_RESCALE=sm90_forward_skip_rescale(head_dim, descales is not None),
                      MASK_MOD=mask_mod is not None, SCORE_MOD=score_mod is not None)
    return grid, args, constexprs


def _mod_args(mask_mod: MaskMod | None, score_mod: ScoreMod | None, blocks: BlockMask | None, tiles,
              mask: MaskSpec, alibi_slopes, attn_bias, descales) -> tuple:
    """The kernel's mod arguments (mask_mod, mask_mod_args, FULL_COUNTS, PARTIAL_COUNTS, WALK_TILES, mod_q_tiles,
    list_len, score_mod, score_mod_args): the mask_mod's function and captured tensors and its block mask `blocks`,
    built at these tiles (mods.block_mask), then the score_mod's function and tensors; None where absent."""
    if (mask_mod is not None or score_mod is not None) and (mask.softcap or alibi_slopes is not None
                                                            or attn_bias is not None or descales is not None):
        raise ValueError("the sm_90 forward takes mask_mod and score_mod beside causal, a window and a packed batch "
                         "only (no softcap, ALiBi, attn_bias or e4m3 inputs)")
    score = (None, None) if score_mod is None else (score_mod.fn, score_mod.tensors)
    if mask_mod is None:
        return (None,) * 7 + score
    if blocks is None or (blocks.block_m, blocks.block_n) != (tiles.block_m, tiles.block_n):
        raise ValueError(f"a mask_mod needs its block mask at the launch's {tiles.block_m}x{tiles.block_n} tiles "
                         f"(mods.call_block_mask), got {None if blocks is None else (blocks.block_m, blocks.block_n)}")
    lists = blocks.by_query
    return (mask_mod.fn, mask_mod.tensors, lists.full_counts, lists.partial_counts, blocks.walk, blocks.n_q_tiles,
            blocks.n_k_tiles) + score


def attention_forward_sm90(q, k, v, out, lse, causal: bool, softmax_scale: float, tiles, num_ctas: int | None = None,
                           q_buffers: int = 1, cross_item: bool = False, *, mask: MaskSpec | None = None,
                           alibi_slopes: torch.Tensor | None = None, varlen: VarlenBatch | None = None,
                           attn_bias: torch.Tensor | None = None, bias_tma: bool = False,
                           mask_mod: MaskMod | None = None, blocks: BlockMask | None = None,
                           score_mod: ScoreMod | None = None):
    """Launch on checked 4-D bf16/fp16 tensors with TMA-compatible strides (see layout.tma_compatible).

    `num_ctas`: how many CTAs share the work items (one per SM: persistent); None launches one per query tile.
    `q_buffers`: Q buffers per consumer (tiles.sm90_q_buffers); 2 lets a persistent CTA load the next item's Q
    during the current item. `cross_item`: overlap consecutive work items (see _attention_consumer); needs
    `tiles.sm90_cross_item_safe`. `mask`: window and softcap (default: `causal` alone). `alibi_slopes`: float32
    (H,) or (B, H). `varlen`: q/k/v/out are (1, H, total, D) views of packed tensors and lse is (H, total_q).
    `attn_bias`: `features.CallFeatures.attn_bias` (B or 1, H or 1, Lq or 1, Lk or 1), any float dtype and strides;
    `bias_tma`: the producer loads it by TMA (`layout.bias_tma_view` must hold and its ring fit the shared memory:
    tiles.sm90_bias_tiles), else the consumers load it. `mask_mod`: the user's (mods.MaskMod) and `blocks` its
    block mask at these tiles (mods.call_block_mask), `score_mod` (mods.ScoreMod), both beside causal, a window and
    varlen only."""
    grid, args, constexprs = _launch_args(q, k, v, out, lse, causal, softmax_scale, tiles, num_ctas, q_buffers,
                                          cross_item, mask, alibi_slopes, varlen, attn_bias, bias_tma,
                                          mask_mod=mask_mod, blocks=blocks, score_mod=score_mod)
    return _kernel(varlen)[grid](*args, **constexprs, **launch_options(constexprs["NUM_CONSUMERS"]))


def attention_forward_sm90_fp8(q, k, v, out, lse, q_descale, k_descale, v_descale, causal: bool,
                               softmax_scale: float, tiles, num_ctas: int | None = None, q_buffers: int = 1,
                               cross_item: bool = False):
    """The same kernel on e4m3 inputs (attention/fp8.py's convention, checked there): q (B, Hq, Lq, D) and k (B, Hkv,
    Lk, D) with TMA-compatible strides, v (B, Hkv, Lk, D) K-major (its transpose TMA-compatible: `quantize_fp8`
    writes it so), out bf16 (B, Hq, Lq, D), lse float32 (B, Hq, Lq), descales float32 (B, Hkv) contiguous. The
    products run in e4m3 with float32 accumulation; P is rounded to e4m3. Tiles and schedule:
    tiles.sm90_fp8_forward_tiles and the arguments of attention_forward_sm90."""
    grid, args, constexprs = _launch_args(q, k, v, out, lse, causal, softmax_scale, tiles, num_ctas, q_buffers,
                                          cross_item, descales=(q_descale, k_descale, v_descale))
    return attention_forward_sm90_kernel[grid](*args, **constexprs, **launch_options(constexprs["NUM_CONSUMERS"]))


def prepare_forward(q, k, v, out, lse, causal: bool, softmax_scale: float, tiles, num_ctas: int | None = None,
                    q_buffers: int = 1, cross_item: bool = False, *, mask: MaskSpec | None = None,
                    varlen: VarlenBatch | None = None) -> PreparedLaunch:
    """This launch as a PreparedLaunch, called as `prepared(q, k, v, out, lse)` (varlen: `prepared(q, k, v, out,
    lse, cu_seqlens_q, cu_seqlens_k, tile_offsets)`) on new tensors of the same shapes, strides, dtypes, device and
    16-byte alignment (arguments as attention_forward_sm90, which must have run on them: the kernel is taken from
    Triton's cache). Without ALiBi slopes or a window or softcap (scalars a new call may change): the caller keys
    its cache on everything else, the number of packed sequences included."""
    grid, args, constexprs = _launch_args(q, k, v, out, lse, causal, softmax_scale, tiles, num_ctas, q_buffers,
                                          cross_item, mask, varlen=varlen)
    kernel = _kernel(varlen)
    bound = dict(zip(kernel.arg_names, args), **constexprs)
    make_tensors = functools.partial(_tensor_args, tiles.block_n, padded_head_dim(q.shape[-1]))
    options = launch_options(constexprs["NUM_CONSUMERS"])
    if varlen is None:
        return PreparedLaunch(kernel, grid, bound, options, make_tensors, (q, k, v, out, lse))

    def make_args(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, tile_offsets):
        return (*make_tensors(q, k, v, out, lse), cu_seqlens_q, cu_seqlens_k, tile_offsets, out)

    live = ("q_desc", "k_desc", "v_desc", "o_desc", "LSE", "CU_SEQLENS_Q", "CU_SEQLENS_K", "TILE_OFFSETS", "O")
    return PreparedLaunch(kernel, grid, bound, options, make_args,
                          (q, k, v, out, lse, *varlen.tensors()), live)


def compile_offline(head_dim: int, causal: bool, tiles, num_ctas: int | None = None, q_buffers: int = 1,
                    cross_item: bool = False, dtype: torch.dtype = torch.bfloat16, *, mask: MaskSpec | None = None,
                    alibi: bool = False, varlen: bool = False, bias: str | None = None,
                    bias_dtype: torch.dtype | None = None, band: int = 1, mask_mod=None, score_mod=None):
    """The kernel built for sm_90 without a GPU (meta tensors; ptxas ships with triton), specialised as a launch of
    (2, 4, 256, head_dim) tensors with these tiles would specialise it (varlen: a (1, 4, 512, head_dim) packed
    batch, its causal work list in bands of `band` tiles); `mask` (default: `causal` alone), ALiBi slopes and varlen
    as attention_forward_sm90 takes them, the
    arguments a call leaves None as constexprs. `bias`: "tma" (a (1, 4, 256, 256) bias the producer loads) or
    "loads" (a (2, 1, 1, 256) one the consumers load), of `bias_dtype` (default: dtype). dtype e4m3: the FP8
    forward (attention_forward_sm90_fp8: K-major v, bf16 out, descales). `mask_mod`: a `@triton.jit` function or a
    mods.MaskMod (its captured tensors may be meta), walked through a block mask of meta lists; `score_mod` likewise
    (or a mods.ScoreMod). Returns the
    CompiledKernel (registers, shared memory, SASS)."""
    from flashmoe_science.gluon.sm90 import compile_offline as build

    mask = mask or MaskSpec(causal=causal, window_right=0 if causal else -1)
    batch, rows = (1, 512) if varlen else (2, 256)
    q = torch.empty(batch, 4, rows, head_dim, dtype=dtype, device="meta")
    lse = torch.empty(batch, 4, rows, device="meta")
    slopes = torch.empty(4, device="meta") if alibi else None
    cu_seqlens = torch.empty(3, dtype=torch.int32, device="meta")
    work = torch.empty(ranked_work_list_entries(2, rows, tiles.block_m * band), dtype=torch.int32, device="meta")
    batch_info = (VarlenBatch(cu_seqlens, cu_seqlens, work, band) if mask.plain_causal
                  else VarlenBatch(cu_seqlens, cu_seqlens, cu_seqlens)) if varlen else None
    attn_bias = None
    if bias is not None:
        shape = (1, 4, rows, rows) if bias == "tma" else (batch, 1, 1, rows)
        attn_bias = torch.empty(shape, dtype=bias_dtype or dtype, device="meta")
    v, out, descales = q, q, None
    if dtype == FP8_DTYPE:
        v = torch.empty(batch, 4, head_dim, rows, dtype=dtype, device="meta").transpose(-1, -2)
        out = torch.empty(q.shape, dtype=torch.bfloat16, device="meta")
        descales = (torch.empty(batch, 4, device="meta"),) * 3
    blocks = None
    if mask_mod is not None:
        mask_mod = mask_mod if isinstance(mask_mod, MaskMod) else MaskMod(mask_mod)
        n_q, n_k = -(-rows // tiles.block_m), -(-rows // tiles.block_n)
        lists = TileLists(*(torch.empty(shape, dtype=torch.int32, device="meta")
                            for shape in ((batch, 4, n_q), (batch, 4, n_q, n_k)) * 2))
        blocks = BlockMask(tiles.block_m, tiles.block_n, torch.empty(batch, 4, n_q, n_k, dtype=torch.int8,
                                                                     device="meta"), lists, None)
    if score_mod is not None:
        score_mod = score_mod if isinstance(score_mod, ScoreMod) else ScoreMod(score_mod)
    _, args, constexprs = _launch_args(q, q, v, out, lse, mask.causal, 0.1, tiles, num_ctas, q_buffers, cross_item,
                                       mask, slopes, batch_info, attn_bias, bias == "tma", descales, mask_mod, blocks,
                                       score_mod)
    kernel = _kernel(batch_info)
    unused = {name: None for name, value in zip(kernel.arg_names, args) if value is None}
    if mask_mod is not None:  # a function argument is a constexpr: each mod builds its own kernel
        unused["mask_mod"] = mask_mod.fn
    if score_mod is not None:
        unused["score_mod"] = score_mod.fn
    return build(kernel, list(args) + [constexprs[name] for name in kernel.arg_names[len(args):]],
                 {**constexprs, **unused}, constexprs["NUM_CONSUMERS"])
