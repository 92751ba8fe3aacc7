"""Attention backward in Triton: FlashAttention-2 work split, scores recomputed tile by tile from q, k and the LSE.

With P = softmax(S), S = q kᵀ · scale, O = P v and dO the incoming gradient:

    dV = Pᵀ dO        dP = dO vᵀ        dS = P ∘ (dP − Δ),  Δ = rowsum(dO ∘ O)        dQ = dS k · scale        dK = dSᵀ q · scale

Two paths; `attention_backward` takes the fused one when it is given a `dq_accum` workspace:

- fused (single pass; api.py takes it for `deterministic=False` when dQ and dK/dV are both wanted and
  `tiles.backward_tiles` gives fused tiles, which no GPU does yet: the interpreter only; on Hopper api.py runs
  hopper/bwd_sm90.py's one-pass kernel instead, head dims up to 128): the dK/dV kernel with
  FUSE_DQ also forms dS k for every query tile it visits and adds it with float32 atomics into `dq_accum`; a last
  small kernel scales that by the softmax scale into dQ. Five products per (key tile, query tile) pair: S, dP, dV,
  dK, dQ.
- two-pass (`deterministic=True`, and other calls on GPUs): the dK/dV kernel, then a dQ kernel that recomputes S
  and dP for every pair: seven products per pair. The dK/dV kernel alone also serves calls that want no dQ, the dQ kernel
  alone calls that want only dQ, whichever path was asked for.

Read top to bottom:

1. `bwd_prep`'s preprocess computes Δ (float32, one value per query row) once, so no kernel below needs O; on
   the fused path it also zeroes `dq_accum`.
2. `_bwd_dkdv_kernel`: one program owns a tile of BLOCK_N keys of one (batch, key/value head) and keeps dK and dV
   for it in fp32 registers. It loops over the query heads of its GQA group (no repeated K/V, no atomics for dK/dV:
   the group sum happens in registers) and, per head, over the query tiles that see its keys. P is recomputed as
   exp2(s · scale · log2 e − lse · log2 e) from the forward's LSE: no (Lq, Lk) buffer exists anywhere. With
   FUSE_DQ each query tile's dQ share goes to that query head's rows of `dq_accum`.
3. `_bwd_dq_kernel` (two-pass): one program owns a tile of BLOCK_M query rows of one (batch, query head) and loops
   over the key tiles it sees, exactly the forward's loop bounds.
4. `bwd_prep`'s dQ conversion (fused): dQ = dq_accum · scale, in dQ's dtype and strides.

The kernels with tile loops split them into full tiles, which run without any mask arithmetic, and boundary tiles
(the causal diagonal, ragged sequence ends), which mask; tiles that no row can see are never visited. The
visibility rule is the forward's: query i sees key j iff j <= i + diagonal, diagonal = Lk − Lq (bottom-right
aligned). A query row that sees no key (lse = −inf) only ever meets masked tiles, where its P is forced to 0, so
its gradients are 0, not NaN; no key tile visits it at all on the fused path, where its `dq_accum` rows stay 0.

Determinism: dK and dV are always written once per element by one program that sums in a fixed order, and so is
dQ on the two-pass path: there the gradients are bit-identical run to run. On the fused path the float32 atomic
adds into `dq_accum` arrive in whatever order the key-tile programs reach them, so dQ may differ in its last bits
from run to run (the sum is the same up to rounding; dK and dV stay bit-identical).

Tiles, like the forward's, come from `tiles.backward_tiles` (one set per kernel). Loads are masked pointer loads
(`_load_tile` of the forward); head dims that are not a power of two are zero-padded inside, stores are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashmoe_science.attention import bwd_prep
from flashmoe_science.attention.features import as_features
from flashmoe_science.attention.layout import needs_64bit_rows
from flashmoe_science.attention.mask import LOG2_E, key_tile_range, masked_runs, query_tile_range, visible
from flashmoe_science.attention.mods import block_mask_args, call_block_mask, clamp_index
from flashmoe_science.attention.mods import kernel_args as mod_kernel_args
from flashmoe_science.attention.seqlen import launch_sizes, sequence_bounds
from flashmoe_science.attention.tiles import BackwardTiles, padded_head_dim
from flashmoe_science.attention.triton.common import feature_args, feature_tensors, head_extras, load_tile, scores_log2
from flashmoe_science.device import dot_precision

# Sizes are runtime values, not specialised: every sequence length reuses one compiled kernel (masks handle tails).
_SIZES = ["num_q_heads", "num_kv_heads", "group_size", "seqlen_q", "seqlen_k", "lse_rows", "window_left",
          "window_right"]


@triton.jit
def _dkdv_query_tile(dk, dv, k, v, offs_n, start_m,
                     q_base, do_base, lse_base, delta_base, dq_accum_base, stride_qm, stride_dom,
                     seqlen_q, seqlen_k, diagonal, window_left, window_right, qk_scale, sm_scale, softcap_scale,
                     alibi_slope_log2, BIAS, bias_offset, stride_bias_m, stride_bias_n,
                     batch, q_head, mask_mod, mask_args, score_mod, score_grad, score_args,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                     MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                     SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
                     MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
                     FUSE_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the query tile at start_m of one query head into the key tile's (dK, dV) (see `_dkdv_query_tiles`);
    the user's mods (mods.py) on the transposed tile: mask_mod on MASKED tiles, score_mod and its derivative."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = load_tile(q_base, q_base, 0, 0, start_m, seqlen_q, stride_qm,
                  BLOCK_M, BLOCK_D, HEAD_DIM, False, MASKED)
    do = load_tile(do_base, do_base, 0, 0, start_m, seqlen_q, stride_dom,
                   BLOCK_M, BLOCK_D, HEAD_DIM, False, MASKED)
    if MASKED:
        in_bounds = offs_m < seqlen_q
        lse2 = tl.load(lse_base + offs_m, mask=in_bounds, other=0.0) * LOG2_E
        delta = tl.load(delta_base + offs_m, mask=in_bounds, other=0.0)
    else:
        lse2 = tl.load(lse_base + offs_m) * LOG2_E
        delta = tl.load(delta_base + offs_m)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    if MASK_MOD or SCORE_MOD:  # the mods see positions inside the sequence (ragged edges clamped)
        q_idx = clamp_index(offs_m, seqlen_q)[None, :]
        kv_idx = clamp_index(offs_n, seqlen_k)[:, None]
    if SCORE_MOD:
        score_t = s_t * sm_scale
        x_t = score_mod(score_t, batch, q_head, q_idx, kv_idx, *score_args) * LOG2_E
    else:
        x_t, tanh_t = scores_log2(s_t, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, diagonal, qk_scale,
                                  softcap_scale, alibi_slope_log2, BIAS, bias_offset, stride_bias_m, stride_bias_n,
                                  SOFTCAP, ALIBI, HAS_BIAS)
    p_t = tl.math.exp2(x_t - lse2[None, :])
    if MASKED:
        seen = visible(offs_m[None, :], offs_n[:, None], seqlen_k, diagonal, window_left, window_right,
                       MASK_LEFT, MASK_RIGHT) & (offs_m[None, :] < seqlen_q)
        if MASK_MOD:
            seen = seen & mask_mod(batch, q_head, q_idx, kv_idx, *mask_args)
        # where, not a product: a row with lse = -inf has exp2(+inf) here, which must become 0, not NaN.
        p_t = tl.where(seen, p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:  # d(c·tanh(s·scale/c))/ds = scale·(1 - tanh²); the scale is applied once at the end
        ds_t = ds_t * (1.0 - tanh_t * tanh_t)
    if SCORE_MOD:  # d score_mod(s·scale)/ds = scale·grad; the scale is applied once at the end
        ds_t = ds_t * score_grad(score_t, batch, q_head, q_idx, kv_idx, *score_args)
    ds_t = ds_t.to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    if FUSE_DQ:
        if BLOCK_M >= 64:
            dq_part = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION)
        else:
            # Hopper's warpgroup MMA wants >= 64 rows: with fewer query rows, put the head dim on the rows
            # (dQᵀ = kᵀ dSᵀ); otherwise the product falls back to the slower mma.sync.
            dq_part = tl.trans(tl.dot(tl.trans(k), ds_t, input_precision=DOT_PRECISION))
        # The workspace is BLOCK_D wide (padded columns add zeros): only rows need a bound.
        dq_ptrs = dq_accum_base + offs_m[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        # relaxed: nothing reads dq_accum before the kernel ends, so no ordering (fences) is needed
        if MASKED:
            tl.atomic_add(dq_ptrs, dq_part, mask=offs_m[:, None] < seqlen_q, sem="relaxed")
        else:
            tl.atomic_add(dq_ptrs, dq_part, sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_query_tiles(dk, dv, k, v, offs_n,
                      q_base, do_base, lse_base, delta_base, dq_accum_base, stride_qm, stride_dom,
                      query_start, query_end, gap_start, gap_end, seqlen_q, seqlen_k, diagonal,
                      window_left, window_right, qk_scale, sm_scale, softcap_scale, alibi_slope_log2,
                      BIAS, bias_offset, stride_bias_m, stride_bias_n,
                      batch, q_head, score_mod, score_grad, score_args,
                      BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                      MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                      SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, SCORE_MOD: tl.constexpr,
                      FUSE_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the query tiles [query_start, gap_start) and [gap_end, query_end) of one query head into the key tile's
    (dK, dV); with FUSE_DQ also add the key tile's share of dQ (dS k, unscaled) into those query rows of the fp32
    workspace `dq_accum_base`.

    Scores are kept transposed, (keys, queries), so dV = Pᵀ dO and dK = dSᵀ q are plain products. MASKED tiles
    apply the query bound and `mask.visible`; unmasked tiles are fully visible and fully in bounds. The gap lets
    one loop visit both runs of masked tiles around the full ones: every loop is another copy of the body
    competing for registers, and a third one cost spills in the sm_90 builds (fused, D=128, 32x128 tiles, causal:
    264 bytes/thread with three loops, 64 with two)."""
    for start_m in range(query_start, query_end - (gap_end - gap_start), BLOCK_M):
        if MASKED and MASK_RIGHT:  # a gap only between two masked runs (see `masked_runs`)
            if start_m >= gap_start:
                start_m += gap_end - gap_start
        start_m = tl.multiple_of(start_m, BLOCK_M)
        dk, dv = _dkdv_query_tile(dk, dv, k, v, offs_n, start_m, q_base, do_base, lse_base, delta_base,
                                  dq_accum_base, stride_qm, stride_dom, seqlen_q, seqlen_k, diagonal, window_left,
                                  window_right, qk_scale, sm_scale, softcap_scale, alibi_slope_log2, BIAS,
                                  bias_offset, stride_bias_m, stride_bias_n, batch, q_head, None, None, score_mod,
                                  score_grad, score_args, BLOCK_M, BLOCK_D, HEAD_DIM, MASKED, MASK_LEFT, MASK_RIGHT,
                                  SOFTCAP, ALIBI, HAS_BIAS, False, SCORE_MOD, FUSE_DQ, DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_listed_tiles(dk, dv, k, v, offs_n, TILES, count,
                       q_base, do_base, lse_base, delta_base, dq_accum_base, stride_qm, stride_dom,
                       seqlen_q, seqlen_k, diagonal, window_left, window_right, qk_scale, sm_scale,
                       batch, q_head, mask_mod, mask_args, score_mod, score_grad, score_args,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                       MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                       SCORE_MOD: tl.constexpr, FUSE_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the first `count` query tiles of the block mask's list TILES (partial ones MASKED, with the mask_mod;
    full ones without any mask) into the key tile's (dK, dV)."""
    for i in range(0, count):
        start_m = tl.multiple_of(tl.load(TILES + i) * BLOCK_M, BLOCK_M)
        dk, dv = _dkdv_query_tile(dk, dv, k, v, offs_n, start_m, q_base, do_base, lse_base, delta_base,
                                  dq_accum_base, stride_qm, stride_dom, seqlen_q, seqlen_k, diagonal, window_left,
                                  window_right, qk_scale, sm_scale, 1.0, 0.0, None, 0, 0, 0, batch, q_head,
                                  mask_mod, mask_args, score_mod, score_grad, score_args, BLOCK_M, BLOCK_D, HEAD_DIM,
                                  MASKED, MASK_LEFT, MASK_RIGHT, False, False, False, MASKED, SCORE_MOD, FUSE_DQ,
                                  DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=_SIZES)
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQ_ACCUM, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, BIAS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_alibi_b, stride_alibi_h,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    num_q_heads, num_kv_heads, group_size, seqlen_q, seqlen_k, lse_rows, qk_scale, sm_scale, softcap_scale,
    window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr,
    FUSE_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr, ROW64: tl.constexpr,
    # the user's mods (mods.py; None and False without them) and the block mask's lists by key tile
    mask_mod, mask_args, score_mod, score_grad, score_args, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    PARTIAL_COUNTS, PARTIAL_TILES, FULL_COUNTS, FULL_TILES, list_len,
):
    if ROW64:  # row offsets (L-1)·stride_row reach 2**31 elements (e.g. a transposed (B, L, H, D) buffer)
        stride_qm, stride_kn, stride_vn = stride_qm.to(tl.int64), stride_kn.to(tl.int64), stride_vn.to(tl.int64)
        stride_dom, stride_dkn = stride_dom.to(tl.int64), stride_dkn.to(tl.int64)
        stride_dvn = stride_dvn.to(tl.int64)
    pid_n = tl.program_id(0)  # with causal masking the first key tiles are the heaviest: they run first
    pid_bh = tl.program_id(1)
    batch = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads
    start_n = pid_n * BLOCK_N
    # varlen: this program's sequence (the grid covers the longest one); the tensors are (1, H, total, D) views
    q_start, seqlen_q = sequence_bounds(CU_SEQLENS_Q, batch, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence_bounds(CU_SEQLENS_K, batch, seqlen_k, VARLEN)
    if VARLEN:
        if start_n >= seqlen_k:
            return
        batch64 = tl.zeros([], tl.int64)
    else:
        batch64 = batch.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)

    k = load_tile(K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh + k_start * stride_kn, K, 0, 0,
                  start_n, seqlen_k, stride_kn, BLOCK_N, BLOCK_D, HEAD_DIM, False, True)
    v = load_tile(V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh + k_start * stride_vn, V, 0, 0,
                  start_n, seqlen_k, stride_vn, BLOCK_N, BLOCK_D, HEAD_DIM, False, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # The query tiles that see this key tile (mask.query_tile_range): masked ones around the full ones. Keys past
    # seqlen_k (the ragged last tile) are zero-filled and their rows of dK/dV are never stored.
    diagonal = seqlen_k - seqlen_q
    query_start, full_start, full_end, query_end = query_tile_range(
        start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    masked_start, gap_start = masked_runs(query_start, full_start, full_end, MASK_RIGHT)

    for g in range(group_size):  # GQA: the group's query heads add into the same registers, in a fixed order
        q_head = kv_head * group_size + g
        q_head64 = q_head.to(tl.int64)
        q_base = Q + batch64 * stride_qb + q_head64 * stride_qh + q_start * stride_qm
        do_base = DO + batch64 * stride_dob + q_head64 * stride_doh + q_start * stride_dom
        row0 = (batch64 * num_q_heads + q_head64) * lse_rows + q_start  # lse: (B, H, Lq) or packed (1, H, total)
        lse_base = LSE + row0
        delta_base = Delta + row0
        if FUSE_DQ:
            dq_accum_base = DQ_ACCUM + row0 * BLOCK_D  # this query head's rows of the (B, Hq, Lq, BLOCK_D) workspace
        else:
            dq_accum_base = DQ_ACCUM
        alibi_slope_log2, bias_offset = head_extras(ALIBI_SLOPES, batch, batch64, q_head, stride_alibi_b,
                                                    stride_alibi_h, stride_bias_b, stride_bias_h, ALIBI)
        if MASK_MOD:  # the block mask's lists of this key tile for this query head: full, then partial tiles
            # varlen: the sequence's row (batch64 is the packed tensors' 0)
            tile_row = (batch.to(tl.int64) * num_q_heads + q_head64) * tl.num_programs(0) + pid_n
            dk, dv = _dkdv_listed_tiles(dk, dv, k, v, offs_n, FULL_TILES + tile_row * list_len,
                                        tl.load(FULL_COUNTS + tile_row), q_base, do_base, lse_base, delta_base,
                                        dq_accum_base, stride_qm, stride_dom, seqlen_q, seqlen_k, diagonal,
                                        window_left, window_right, qk_scale, sm_scale, batch, q_head, mask_mod,
                                        mask_args, score_mod, score_grad, score_args, BLOCK_M, BLOCK_D, HEAD_DIM,
                                        False, MASK_LEFT, MASK_RIGHT, SCORE_MOD, FUSE_DQ, DOT_PRECISION)
            dk, dv = _dkdv_listed_tiles(dk, dv, k, v, offs_n, PARTIAL_TILES + tile_row * list_len,
                                        tl.load(PARTIAL_COUNTS + tile_row), q_base, do_base, lse_base, delta_base,
                                        dq_accum_base, stride_qm, stride_dom, seqlen_q, seqlen_k, diagonal,
                                        window_left, window_right, qk_scale, sm_scale, batch, q_head, mask_mod,
                                        mask_args, score_mod, score_grad, score_args, BLOCK_M, BLOCK_D, HEAD_DIM,
                                        True, MASK_LEFT, MASK_RIGHT, SCORE_MOD, FUSE_DQ, DOT_PRECISION)
        else:
            # the masked tiles on both sides of the full ones, in one loop (the full tiles are its gap)
            dk, dv = _dkdv_query_tiles(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, dq_accum_base,
                                       stride_qm, stride_dom, masked_start, query_end, gap_start, full_end,
                                       seqlen_q, seqlen_k, diagonal, window_left, window_right, qk_scale, sm_scale,
                                       softcap_scale, alibi_slope_log2, BIAS, bias_offset, stride_bias_m,
                                       stride_bias_n, batch, q_head, score_mod, score_grad, score_args,
                                       BLOCK_M, BLOCK_D, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI,
                                       HAS_BIAS, SCORE_MOD, FUSE_DQ, DOT_PRECISION)
            dk, dv = _dkdv_query_tiles(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, dq_accum_base,
                                       stride_qm, stride_dom, full_start, full_end, full_end, full_end,
                                       seqlen_q, seqlen_k, diagonal, window_left, window_right, qk_scale, sm_scale,
                                       softcap_scale, alibi_slope_log2, BIAS, bias_offset, stride_bias_m,
                                       stride_bias_n, batch, q_head, score_mod, score_grad, score_args,
                                       BLOCK_M, BLOCK_D, HEAD_DIM, False, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI,
                                       HAS_BIAS, SCORE_MOD, FUSE_DQ, DOT_PRECISION)

    dk = dk * sm_scale
    cols = tl.arange(0, BLOCK_D)
    mask = offs_n[:, None] < seqlen_k
    if BLOCK_D != HEAD_DIM:
        mask = mask & (cols[None, :] < HEAD_DIM)
    dk_ptrs = (DK + batch64 * stride_dkb + kv_head.to(tl.int64) * stride_dkh + k_start * stride_dkn
               + offs_n[:, None] * stride_dkn + cols[None, :])
    dv_ptrs = (DV + batch64 * stride_dvb + kv_head.to(tl.int64) * stride_dvh + k_start * stride_dvn
               + offs_n[:, None] * stride_dvn + cols[None, :])
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _dq_key_tile(dq, q, do, lse2, delta, offs_m, start_n,
                 k_base, v_base, stride_kn, stride_vn, seqlen_q, seqlen_k, diagonal,
                 window_left, window_right, qk_scale, sm_scale, softcap_scale, alibi_slope_log2,
                 BIAS, bias_offset, stride_bias_m, stride_bias_n, dbias_base, stride_dbias_m, stride_dbias_n,
                 batch, q_head, mask_mod, mask_args, score_mod, score_grad, score_args,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, DBIAS: tl.constexpr,
                 MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the key tile at start_n into the query tile's dQ (see `_dq_key_tiles`); the user's mods (mods.py):
    mask_mod on MASKED tiles, score_mod and its derivative."""
    k = load_tile(k_base, k_base, 0, 0, start_n, seqlen_k, stride_kn,
                  BLOCK_N, BLOCK_D, HEAD_DIM, False, MASKED)
    v = load_tile(v_base, v_base, 0, 0, start_n, seqlen_k, stride_vn,
                  BLOCK_N, BLOCK_D, HEAD_DIM, False, MASKED)
    key_pos = start_n + tl.arange(0, BLOCK_N)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASK_MOD or SCORE_MOD:  # the mods see positions inside the sequence (ragged edges clamped)
        q_idx = clamp_index(offs_m, seqlen_q)[:, None]
        kv_idx = clamp_index(key_pos, seqlen_k)[None, :]
    if SCORE_MOD:
        score = s * sm_scale
        x = score_mod(score, batch, q_head, q_idx, kv_idx, *score_args) * LOG2_E
    else:
        x, tanh_s = scores_log2(s, offs_m[:, None], key_pos[None, :], seqlen_q, seqlen_k, diagonal, qk_scale,
                                softcap_scale, alibi_slope_log2, BIAS, bias_offset, stride_bias_m, stride_bias_n,
                                SOFTCAP, ALIBI, HAS_BIAS)
    p = tl.math.exp2(x - lse2[:, None])
    if MASKED:
        seen = visible(offs_m[:, None], key_pos[None, :], seqlen_k, diagonal, window_left, window_right,
                       MASK_LEFT, MASK_RIGHT)
        if MASK_MOD:
            seen = seen & (offs_m[:, None] < seqlen_q) & mask_mod(batch, q_head, q_idx, kv_idx, *mask_args)
        p = tl.where(seen, p, 0.0)  # where, not a product: see _dkdv_query_tiles
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if DBIAS != 0:  # the bias is added to the scores as is: its gradient is dS (rows past Lq have dS = 0)
        dbias_ptrs = (dbias_base + offs_m[:, None].to(tl.int64) * stride_dbias_m
                      + key_pos[None, :].to(tl.int64) * stride_dbias_n)
        in_bounds = (offs_m[:, None] < seqlen_q) & (key_pos[None, :] < seqlen_k)
        if DBIAS == 1:
            tl.store(dbias_ptrs, ds, mask=in_bounds)
        else:
            tl.atomic_add(dbias_ptrs, ds, mask=in_bounds, sem="relaxed")
    if SOFTCAP:  # d(c·tanh(s·scale/c))/ds = scale·(1 - tanh²); the scale is applied once at the end
        ds = ds * (1.0 - tanh_s * tanh_s)
    if SCORE_MOD:  # d score_mod(s·scale)/ds = scale·grad; the scale is applied once at the end
        ds = ds * score_grad(score, batch, q_head, q_idx, kv_idx, *score_args)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _dq_key_tiles(dq, q, do, lse2, delta, offs_m,
                  k_base, v_base, stride_kn, stride_vn,
                  key_start, key_end, gap_start, gap_end, seqlen_q, seqlen_k, diagonal,
                  window_left, window_right, qk_scale, sm_scale, softcap_scale, alibi_slope_log2,
                  BIAS, bias_offset, stride_bias_m, stride_bias_n, dbias_base, stride_dbias_m, stride_dbias_n,
                  batch, q_head, score_mod, score_grad, score_args,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, DBIAS: tl.constexpr,
                  SCORE_MOD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add key tiles [key_start, gap_start) and [gap_end, key_end) into the query tile's dQ (MASKED tiles apply
    `mask.visible`). DBIAS (1: store, 2: float32 atomic add) also writes dS, the bias's gradient, for each pair."""
    for start_n in range(key_start, key_end - (gap_end - gap_start), BLOCK_N):
        if MASKED and MASK_LEFT:  # a gap only between two masked runs (see `masked_runs`)
            if start_n >= gap_start:
                start_n += gap_end - gap_start
        start_n = tl.multiple_of(start_n, BLOCK_N)
        dq = _dq_key_tile(dq, q, do, lse2, delta, offs_m, start_n, k_base, v_base, stride_kn, stride_vn,
                          seqlen_q, seqlen_k, diagonal, window_left, window_right, qk_scale, sm_scale, softcap_scale,
                          alibi_slope_log2, BIAS, bias_offset, stride_bias_m, stride_bias_n, dbias_base,
                          stride_dbias_m, stride_dbias_n, batch, q_head, None, None, score_mod, score_grad,
                          score_args, BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI,
                          HAS_BIAS, DBIAS, False, SCORE_MOD, DOT_PRECISION)
    return dq


@triton.jit
def _dq_listed_tiles(dq, q, do, lse2, delta, offs_m, TILES, count,
                     k_base, v_base, stride_kn, stride_vn, seqlen_q, seqlen_k, diagonal,
                     window_left, window_right, qk_scale, sm_scale,
                     batch, q_head, mask_mod, mask_args, score_mod, score_grad, score_args,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                     MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                     SCORE_MOD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the first `count` key tiles of the block mask's list TILES (partial ones MASKED, with the mask_mod)
    into the query tile's dQ."""
    for i in range(0, count):
        start_n = tl.multiple_of(tl.load(TILES + i) * BLOCK_N, BLOCK_N)
        dq = _dq_key_tile(dq, q, do, lse2, delta, offs_m, start_n, k_base, v_base, stride_kn, stride_vn,
                          seqlen_q, seqlen_k, diagonal, window_left, window_right, qk_scale, sm_scale, 1.0, 0.0,
                          None, 0, 0, 0, None, 0, 0, batch, q_head, mask_mod, mask_args, score_mod, score_grad,
                          score_args, BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, MASK_LEFT, MASK_RIGHT, False, False,
                          False, 0, MASKED, SCORE_MOD, DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=_SIZES)
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, BIAS, DBIAS_OUT,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_alibi_b, stride_alibi_h,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_dbias_b, stride_dbias_h, stride_dbias_m, stride_dbias_n,
    num_q_heads, group_size, seqlen_q, seqlen_k, lse_rows, qk_scale, sm_scale, softcap_scale,
    window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, DBIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROW64: tl.constexpr,
    # the user's mods (mods.py; None and False without them) and the block mask's lists by query tile
    mask_mod, mask_args, score_mod, score_grad, score_args, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    PARTIAL_COUNTS, PARTIAL_TILES, FULL_COUNTS, FULL_TILES, list_len,
):
    if ROW64:  # row offsets (L-1)·stride_row reach 2**31 elements (e.g. a transposed (B, L, H, D) buffer)
        stride_qm, stride_kn, stride_vn = stride_qm.to(tl.int64), stride_kn.to(tl.int64), stride_vn.to(tl.int64)
        stride_dom, stride_dqm = stride_dom.to(tl.int64), stride_dqm.to(tl.int64)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if MASK_RIGHT:
        pid_m = tl.num_programs(0) - 1 - pid_m  # heaviest query tiles first, as in the forward
    batch = pid_bh // num_q_heads
    q_head = pid_bh % num_q_heads
    kv_head = (q_head // group_size).to(tl.int64)
    start_m = pid_m * BLOCK_M
    q_start, seqlen_q = sequence_bounds(CU_SEQLENS_Q, batch, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence_bounds(CU_SEQLENS_K, batch, seqlen_k, VARLEN)
    if VARLEN:
        if start_m >= seqlen_q:
            return
        batch64 = tl.zeros([], tl.int64)
    else:
        batch64 = batch.to(tl.int64)
    q_head64 = q_head.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)

    q = load_tile(Q + batch64 * stride_qb + q_head64 * stride_qh + q_start * stride_qm, Q, 0, 0, start_m,
                  seqlen_q, stride_qm, BLOCK_M, BLOCK_D, HEAD_DIM, False, True)
    do = load_tile(DO + batch64 * stride_dob + q_head64 * stride_doh + q_start * stride_dom, DO, 0, 0, start_m,
                   seqlen_q, stride_dom, BLOCK_M, BLOCK_D, HEAD_DIM, False, True)
    in_bounds = offs_m < seqlen_q
    # Rows past seqlen_q read lse = 0 and Δ = 0 with zero q and dO: their dS is 0 and they are never stored.
    row0 = (batch64 * num_q_heads + q_head64) * lse_rows + q_start
    lse2 = tl.load(LSE + row0 + offs_m, mask=in_bounds, other=0.0) * LOG2_E
    delta = tl.load(Delta + row0 + offs_m, mask=in_bounds, other=0.0)
    k_base = K + batch64 * stride_kb + kv_head * stride_kh + k_start * stride_kn
    v_base = V + batch64 * stride_vb + kv_head * stride_vh + k_start * stride_vn
    alibi_slope_log2, bias_offset = head_extras(ALIBI_SLOPES, batch, batch64, q_head, stride_alibi_b,
                                                stride_alibi_h, stride_bias_b, stride_bias_h, ALIBI)
    dbias_base = DBIAS_OUT
    if DBIAS != 0:
        dbias_base = DBIAS_OUT + batch64 * stride_dbias_b + q_head64 * stride_dbias_h

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diagonal = seqlen_k - seqlen_q
    if MASK_MOD:  # the block mask's lists of this query tile: its full key tiles, then its partial ones
        tile_row = (batch.to(tl.int64) * num_q_heads + q_head64) * tl.num_programs(0) + pid_m  # varlen: the sequence
        dq = _dq_listed_tiles(dq, q, do, lse2, delta, offs_m, FULL_TILES + tile_row * list_len,
                              tl.load(FULL_COUNTS + tile_row), k_base, v_base, stride_kn, stride_vn, seqlen_q,
                              seqlen_k, diagonal, window_left, window_right, qk_scale, sm_scale, batch, q_head,
                              mask_mod, mask_args, score_mod, score_grad, score_args, BLOCK_N, BLOCK_D, HEAD_DIM,
                              False, MASK_LEFT, MASK_RIGHT, SCORE_MOD, DOT_PRECISION)
        dq = _dq_listed_tiles(dq, q, do, lse2, delta, offs_m, PARTIAL_TILES + tile_row * list_len,
                              tl.load(PARTIAL_COUNTS + tile_row), k_base, v_base, stride_kn, stride_vn, seqlen_q,
                              seqlen_k, diagonal, window_left, window_right, qk_scale, sm_scale, batch, q_head,
                              mask_mod, mask_args, score_mod, score_grad, score_args, BLOCK_N, BLOCK_D, HEAD_DIM,
                              True, MASK_LEFT, MASK_RIGHT, SCORE_MOD, DOT_PRECISION)
    else:
        key_start, full_start, full_end, key_end = key_tile_range(start_m, seqlen_q, seqlen_k, window_left,
                                                                  window_right, BLOCK_M, BLOCK_N, MASK_LEFT,
                                                                  MASK_RIGHT)
        masked_start, gap_start = masked_runs(key_start, full_start, full_end, MASK_LEFT)
        dq = _dq_key_tiles(dq, q, do, lse2, delta, offs_m, k_base, v_base, stride_kn, stride_vn,
                           full_start, full_end, full_end, full_end, seqlen_q, seqlen_k, diagonal,
                           window_left, window_right, qk_scale, sm_scale, softcap_scale, alibi_slope_log2,
                           BIAS, bias_offset, stride_bias_m, stride_bias_n, dbias_base, stride_dbias_m,
                           stride_dbias_n, batch, q_head, score_mod, score_grad, score_args,
                           BLOCK_N, BLOCK_D, HEAD_DIM, False, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_BIAS, DBIAS,
                           SCORE_MOD, DOT_PRECISION)
        dq = _dq_key_tiles(dq, q, do, lse2, delta, offs_m, k_base, v_base, stride_kn, stride_vn,
                           masked_start, key_end, gap_start, full_end, seqlen_q, seqlen_k, diagonal,
                           window_left, window_right, qk_scale, sm_scale, softcap_scale, alibi_slope_log2,
                           BIAS, bias_offset, stride_bias_m, stride_bias_n, dbias_base, stride_dbias_m,
                           stride_dbias_n, batch, q_head, score_mod, score_grad, score_args,
                           BLOCK_N, BLOCK_D, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_BIAS, DBIAS,
                           SCORE_MOD, DOT_PRECISION)

    dq = dq * sm_scale
    cols = tl.arange(0, BLOCK_D)
    mask = in_bounds[:, None]
    if BLOCK_D != HEAD_DIM:
        mask = mask & (cols[None, :] < HEAD_DIM)
    dq_ptrs = (DQ + batch64 * stride_dqb + q_head64 * stride_dqh + q_start * stride_dqm
               + offs_m[:, None] * stride_dqm + cols[None, :])
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=mask)


def attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    grad_out: torch.Tensor, delta: torch.Tensor,
    dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None,
    causal, softmax_scale: float, tiles: BackwardTiles, dq_accum: torch.Tensor | None = None,
    dbias: torch.Tensor | None = None, dbias_atomic: bool = False,
) -> dict:
    """Launch the backward on checked 4-D tensors and write the gradients in place.

    q/out/grad_out/dq `(B, Hq, Lq, D)`, k/v/dk/dv `(B, Hkv, Lk, D)`, all with unit stride in the last dim; lse the
    forward's contiguous float32 `(B, Hq, Lq)`; delta a float32 workspace of lse's shape. `dq` None skips dQ;
    `dk` and `dv` are both given or both None (None skips dK/dV). `tiles` is `backward_tiles(...)`. `causal` is a
    bool or a `features.CallFeatures` (window, softcap, ALiBi, bias; varlen: `(1, H, total, D)` views and lse
    `(1, H, total)`, as the forward).

    `dq_accum` picks the path when dQ and dK/dV are both wanted: a contiguous float32 `(B, Hq, Lq,
    padded_head_dim(D))` workspace (any contents: it is zeroed here) runs the fused single pass, whose dQ is summed
    with atomics (its last bits may vary run to run); None runs the deterministic two-pass path (no atomics,
    bit-identical gradients). It is ignored when dQ or dK/dV is not wanted.

    `dbias` (with `dq`, on the two-pass path): a zeroed float32 buffer that receives the bias's gradient dS,
    either the bias's own shape read with its broadcast strides and summed with atomics (`dbias_atomic`), or a
    buffer every element of which one program stores (the full (B, H, Lq, Lk), or a bias without broadcast dims).

    Returns the compiled kernels by name ("preprocess", "dkdv", "dq", "dq_convert": those that ran), for the
    registers, spills and shared memory of the sweep script.
    """
    features = as_features(causal)
    batch, num_q_heads, rows_q, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs, seqlen_q, seqlen_k = launch_sizes(q, k, features.varlen)
    block_d = padded_head_dim(head_dim)
    scalars, feature_strides = feature_args(q, k, features, softmax_scale)
    group_size = num_q_heads // num_kv_heads
    fused = dq is not None and dk is not None and dq_accum is not None and dbias is None
    row64 = needs_64bit_rows(q, k, v, out, grad_out, dq, dk, dv)
    extras = feature_tensors(features)
    mods = mod_kernel_args(features.mods)  # the user's mods; their block masks at each kernel's tiles
    kernels = {}

    kernel, grid, bound, options = bwd_prep.preprocess_launch(out, grad_out, delta, dq_accum if fused else None, row64)
    kernels["preprocess"] = kernel[grid](**bound, **options)
    if dk is not None:
        dkdv_tiles = tiles.fused if fused else tiles.dkdv
        grid = (triton.cdiv(seqlen_k, dkdv_tiles.block_n), num_seqs * num_kv_heads)
        kernels["dkdv"] = _bwd_dkdv_kernel[grid](
            q, k, v, grad_out, lse, delta, dk, dv, dq_accum if fused else None, *extras,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3],
            *dk.stride()[:3], *dv.stride()[:3], *feature_strides,
            num_q_heads, num_kv_heads, group_size, seqlen_q, seqlen_k, rows_q, scalars.pop("qk_scale"),
            softmax_scale, scalars.pop("softcap_scale"), scalars.pop("window_left"), scalars.pop("window_right"),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=dkdv_tiles.block_m, BLOCK_N=dkdv_tiles.block_n,
            **scalars, FUSE_DQ=fused, ROW64=row64, num_warps=dkdv_tiles.num_warps,
            num_stages=dkdv_tiles.num_stages, **dot_precision(q), **mods,
            **block_mask_args(call_block_mask(q, k, features, dkdv_tiles.block_m, dkdv_tiles.block_n), by_key=True),
        )
        scalars, _ = feature_args(q, k, features, softmax_scale)
    if fused:
        kernel, grid, bound, options = bwd_prep.dq_convert_launch(dq_accum, dq, softmax_scale, row64)
        kernels["dq_convert"] = kernel[grid](**bound, **options)
    elif dq is not None:
        dq_tiles = tiles.dq
        grid = (triton.cdiv(seqlen_q, dq_tiles.block_m), num_seqs * num_q_heads)
        dbias_strides = (0, 0, 0, 0)
        if dbias is not None:
            full = (batch, num_q_heads, rows_q, k.shape[2])
            dbias_strides = dbias.expand(full).stride()
        kernels["dq"] = _bwd_dq_kernel[grid](
            q, k, v, grad_out, lse, delta, dq, *extras, dbias,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3], *dq.stride()[:3],
            *feature_strides, *dbias_strides,
            num_q_heads, group_size, seqlen_q, seqlen_k, rows_q, scalars.pop("qk_scale"), softmax_scale,
            scalars.pop("softcap_scale"), scalars.pop("window_left"), scalars.pop("window_right"),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=dq_tiles.block_m, BLOCK_N=dq_tiles.block_n,
            **scalars, DBIAS=0 if dbias is None else (2 if dbias_atomic else 1),
            ROW64=row64, num_warps=dq_tiles.num_warps, num_stages=dq_tiles.num_stages, **dot_precision(q), **mods,
            **block_mask_args(call_block_mask(q, k, features, dq_tiles.block_m, dq_tiles.block_n)),
        )
    return kernels
