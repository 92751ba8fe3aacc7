"""dQ of the attention backward for Hopper (sm_90) in Gluon, query-stationary: no atomics, no dq_accum.

At head dim 256 a one-pass backward must add each CTA's dQ partial (64 queries x 256 fp32 per tile of 64 keys)
into a float32 accumulator in L2; measured on the H200 that reduction traffic alone held the one-pass kernel at
~265 TFLOP/s whether done by atomics or TMA reduce-adds (docs/perf-notes.md), against ~430 with it removed.
So at D=256 the backward runs two kernels: bwd_sm90_hdim256 (dK, dV; keys stationary) and this one, which
recomputes the scores once more (7 products per tile pair instead of 5) but owns its rows' dQ outright:

A CTA owns 2 x 64 query rows of one (batch, query head); grid (cdiv(Lq, 128) · B·Hq). The producer warp loads each
consumer's Q and dO rows once, then streams K and V tiles of BLOCK_N = 32 keys through a ring (separate K and V
barriers: dP needs V early, dQ needs K late). Consumer c (4 warps, rows [64c, 64c + 64)) per key tile j:

    issue  S = Q Kⱼᵀ,  dP = dO Vⱼᵀ            (accumulators start from -lse/scale and -Δ: bwd_sm90's scheme)
    P = exp2(S·scale·log2e),  dS = P ∘ dP      (the previous tile's dQ product still runs meanwhile)
    issue  dQ += dS Kⱼ                          (A from registers; 64 x 256 fp32 accumulator, 128 registers)

Tile j's dQ product is issued in iteration j+1 after that tile's S and dP, so it runs while their P and dS are
computed (the forward's P·V overlap); K stage j is released once it completes, V stage j once dP_j has. dQ · scale
is stored once at the end. With causal masking consumer 0 (the lower rows) stops a tile or two before consumer 1
and releases the remaining stages unread (hopper.common.release_unused).
"""

from __future__ import annotations

import torch
from flashmoe_science.gluon.compat import gl, gluon, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from flashmoe_science.attention.seqlen import PER_BATCH_ARGS, ranked_tile_of_work, sequence_coords
from flashmoe_science.attention.hopper.bwd_common import (
    _mask_score_start,
    _past_work,
    _probabilities,
    _score_start,
    _softcap_grad,
    _tile_needs_mask,
    feature_args,
    offline_build,
)
from flashmoe_science.attention.hopper.common import descriptor, release_unused
from flashmoe_science.attention.mask import LOG2_E, key_tile_bounds, key_tile_range
from flashmoe_science.gluon.sm90 import CONSUMER_REGISTERS, LAUNCH_OPTIONS, PRODUCER_REGISTERS, wgmma_layout

BLOCK_M = 64  # query rows per consumer
BLOCK_N = 32  # keys per streamed tile: Q and dO of 128 rows take 128 KB of the shared memory at D=256
NUM_STAGES = 3


@gluon.jit
def _visited_key_tiles(start_m, seqlen_q, seqlen_k, window_left, window_right, ROWS: gl.constexpr,
                       KEYS: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """For the rows [start_m, start_m + ROWS): (key_start, full_start, full_end, key_end) in keys, as
    mask.key_tile_range (windows: tiles outside are never streamed); dense and causal-only calls take
    mask.key_tile_bounds (key_start = full_start = 0; key_tile_range with a constant causal window measured 24 more
    instructions in the D=256 causal build, 4040 -> 4064)."""
    if MASK_LEFT or MASK_RIGHT:
        key_start, full_start, full_end, key_end = key_tile_range(
            start_m, seqlen_q, seqlen_k, window_left, window_right, ROWS, KEYS, MASK_LEFT, MASK_RIGHT)
    else:
        full_end, key_end = key_tile_bounds(start_m, seqlen_k, seqlen_k - seqlen_q, ROWS, KEYS, CAUSAL)
        key_start = 0
        full_start = 0
    return key_start, full_start, full_end, key_end


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_ready, k_ready, v_ready,
              k_empty, v_empty, batch, q_head, kv_head, start_m, seqlen_q, seqlen_k, q_first, k_first, window_left,
              window_right, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr,
              MASK_RIGHT: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    mbarrier.expect(qdo_ready, 4 * q_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma.async_load(q_desc, [batch, q_head, q_first + start_m + c * ROWS, 0], qdo_ready,
                                        q_smem.index(c))
        tma.async_load(do_desc, [batch, q_head, q_first + start_m + c * ROWS, 0], qdo_ready,
                                        do_smem.index(c))
    cta_start, _, _, cta_end = _visited_key_tiles(start_m, seqlen_q, seqlen_k, window_left, window_right, 2 * ROWS,
                                                  KEYS, CAUSAL, MASK_LEFT, MASK_RIGHT)
    for j in range(gl.cdiv(cta_end - cta_start, KEYS)):  # ring position j: keys from cta_start + j·KEYS
        stage = j % NUM_STAGES
        empty_phase = ((j // NUM_STAGES) & 1) ^ 1  # barriers start "phase 1 complete": the first pass is free
        key_row = k_first + cta_start + j * KEYS
        mbarrier.wait(k_empty.index(stage), empty_phase)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_load(k_desc, [batch, kv_head, key_row, 0], k_ready.index(stage),
                                        k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), empty_phase)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_load(v_desc, [batch, kv_head, key_row, 0], v_ready.index(stage),
                                        v_smem.index(stage))


@gluon.jit
def _tile_keys(j, cta_start, full_start, full_end, layout: gl.constexpr, KEYS: gl.constexpr,
               MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """Ring position j's key indices (expanded along the keys of `layout`) and whether the tile needs the mask:
    diagonal tiles, the ragged last tile, every tile of rows that see no key, and window edges."""
    start_n = cta_start + j * KEYS
    keys = gl.expand_dims(start_n + gl.arange(0, KEYS, layout=gl.SliceLayout(0, layout)), 0)
    return keys, _tile_needs_mask(start_n, full_start, full_end, MASK_LEFT or MASK_RIGHT, True)


@gluon.jit
def _issue_scores(q_tile, do_tile, k_smem, v_smem, k_ready, v_ready, j, s_start, dp_init, queries, keys, needs_mask,
                  seqlen_k, diagonal, window_left, window_right, KEYS: gl.constexpr, BLOCK_D: gl.constexpr,
                  NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                  SOFTCAP: gl.constexpr):
    """S = Q Kⱼᵀ and dP = dO Vⱼᵀ for ring position j, issued asynchronously once its K and V have landed. The
    accumulators start from -lse/scale (-inf at hidden keys) and -Δ (bwd_sm90's scheme; bwd_common._score_start)."""
    s_init = _mask_score_start(s_start, queries, keys, needs_mask, seqlen_k, diagonal, window_left, window_right,
                               CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP)
    stage = j % NUM_STAGES
    phase = (j // NUM_STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    s = warpgroup_mma(q_tile, k_smem.index(stage).reshape([KEYS, BLOCK_D]).permute((1, 0)), s_init, is_async=True)
    mbarrier.wait(v_ready.index(stage), phase)
    dp = warpgroup_mma(do_tile, v_smem.index(stage).reshape([KEYS, BLOCK_D]).permute((1, 0)), dp_init,
                       is_async=True)
    return s, dp


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, qdo_ready, k_ready, v_ready, k_empty, v_empty,
              LSE, Delta, DQ, stride_dqb, stride_dqh, stride_dqm, batch, q_head, start_m, seqlen_q, seqlen_k,
              qk_scale, sm_scale, num_q_heads, seq, q_first, lse_rows, window_left, window_right, softcap_scale,
              Slopes, stride_slopes,
              CONSUMER: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, ROWS: gl.constexpr,
              KEYS: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr,
              MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = wgmma_layout(KEYS)
    dq_layout: gl.constexpr = wgmma_layout(BLOCK_D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_slice: gl.constexpr = gl.SliceLayout(1, s_layout)

    my_start_m = start_m + CONSUMER * ROWS
    diagonal = seqlen_k - seqlen_q
    # ring positions: the CTA's key tiles from cta_start; this consumer's are [first, end) of them
    cta_start, cta_full_start, cta_full_end, cta_end = _visited_key_tiles(
        start_m, seqlen_q, seqlen_k, window_left, window_right, 2 * ROWS, KEYS, CAUSAL, MASK_LEFT, MASK_RIGHT)
    cta_tiles = gl.cdiv(cta_end - cta_start, KEYS)
    key_start, full_start, full_end, key_end = _visited_key_tiles(
        my_start_m, seqlen_q, seqlen_k, window_left, window_right, ROWS, KEYS, CAUSAL, MASK_LEFT, MASK_RIGHT)
    if MASK_LEFT or MASK_RIGHT:
        first = gl.minimum((key_start - cta_start) // KEYS, cta_tiles)
        end = gl.minimum(gl.maximum(gl.cdiv(key_end - cta_start, KEYS), first), cta_tiles)
        release_unused(k_ready, v_ready, k_empty, v_empty, 0, first, NUM_STAGES)  # the other consumer's
    else:
        first = 0
        end = gl.cdiv(key_end, KEYS)  # <= cta_tiles

    offs_q = my_start_m + gl.arange(0, ROWS, layout=row_slice)
    queries = gl.expand_dims(offs_q, 1)
    in_rows = offs_q < seqlen_q
    if VARLEN:  # lse/Δ are (1, Hq, total rows): the sequence's rows of this head
        row0 = q_head * lse_rows + q_first
    else:
        row0 = (batch * num_q_heads + q_head) * seqlen_q
    if ALIBI:
        slope_log2 = gl.load(Slopes + seq * stride_slopes + q_head) * LOG2_E
    else:
        slope_log2 = 0.0
    # queries past Lq: lse = +inf, so P = 0 (their zero-filled Q/dO rows give finite scores)
    lse = gl.load(LSE + row0 + offs_q, mask=in_rows, other=float("inf"))
    delta = gl.load(Delta + row0 + offs_q, mask=in_rows, other=0.0)
    s_start = _score_start(gl.zeros([ROWS, KEYS], gl.float32, layout=s_layout), lse, 1.0 / sm_scale, queries,
                           queries, False, seqlen_k, diagonal, window_left, window_right, 1, CAUSAL, MASK_LEFT,
                           MASK_RIGHT, SOFTCAP)  # masked per tile by _issue_scores
    dp_init = gl.zeros([ROWS, KEYS], gl.float32, layout=s_layout) - gl.expand_dims(delta, 1)
    dq = gl.zeros([ROWS, BLOCK_D], gl.float32, layout=dq_layout)
    ds = gl.zeros([ROWS, KEYS], dtype, layout=a_layout)
    q_tile = q_smem.index(CONSUMER).reshape([ROWS, BLOCK_D])
    do_tile = do_smem.index(CONSUMER).reshape([ROWS, BLOCK_D])
    mbarrier.wait(qdo_ready, 0)

    if end > first:  # the first tile: nothing to overlap yet
        keys, needs_mask = _tile_keys(first, cta_start, full_start, full_end, s_layout, KEYS, MASK_LEFT, MASK_RIGHT)
        s, dp = _issue_scores(q_tile, do_tile, k_smem, v_smem, k_ready, v_ready, first, s_start, dp_init, queries,
                              keys, needs_mask, seqlen_k, diagonal, window_left, window_right, KEYS, BLOCK_D,
                              NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        mbarrier.arrive(v_empty.index(first % NUM_STAGES), count=1)
        p, t = _probabilities(s, lse, queries, keys, needs_mask, seqlen_k, diagonal, window_left, window_right,
                              qk_scale, softcap_scale, slope_log2, 1, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI)
        ds = gl.convert_layout(_softcap_grad(p * dp, t, SOFTCAP).to(dtype), a_layout)
    for j in range(first + 1, end):
        keys, needs_mask = _tile_keys(j, cta_start, full_start, full_end, s_layout, KEYS, MASK_LEFT, MASK_RIGHT)
        s, dp = _issue_scores(q_tile, do_tile, k_smem, v_smem, k_ready, v_ready, j, s_start, dp_init, queries,
                              keys, needs_mask, seqlen_k, diagonal, window_left, window_right, KEYS, BLOCK_D,
                              NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP)
        prev = (j - 1) % NUM_STAGES
        dq = warpgroup_mma(ds, k_smem.index(prev).reshape([KEYS, BLOCK_D]), dq, is_async=True)
        s, dp = warpgroup_mma_wait(1, deps=(s, dp))  # S and dP done; the dQ product may still run
        mbarrier.arrive(v_empty.index(j % NUM_STAGES), count=1)
        p, t = _probabilities(s, lse, queries, keys, needs_mask, seqlen_k, diagonal, window_left, window_right,
                              qk_scale, softcap_scale, slope_log2, 1, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI)
        ds_next = gl.convert_layout(_softcap_grad(p * dp, t, SOFTCAP).to(dtype), a_layout)
        dq, _ = warpgroup_mma_wait(0, deps=(dq, ds))
        mbarrier.arrive(k_empty.index(prev), count=1)
        ds = ds_next
    if end > first:
        last = (end - 1) % NUM_STAGES
        dq = warpgroup_mma(ds, k_smem.index(last).reshape([KEYS, BLOCK_D]), dq, is_async=True)
        dq, _ = warpgroup_mma_wait(0, deps=(dq, ds))
        mbarrier.arrive(k_empty.index(last), count=1)
    release_unused(k_ready, v_ready, k_empty, v_empty, end, cta_tiles, NUM_STAGES)

    rows = my_start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, dq_layout))
    mask = gl.expand_dims(rows < seqlen_q, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
    rows = q_first + rows  # a packed sequence's rows
    ptrs = (DQ + batch.to(gl.int64) * stride_dqb + q_head.to(gl.int64) * stride_dqh
            + gl.expand_dims(rows.to(gl.int64) * stride_dqm, 1) + gl.expand_dims(cols, 0))
    gl.store(ptrs, (dq * sm_scale).to(dtype), mask=mask)


@gluon.jit(do_not_specialize=PER_BATCH_ARGS)
def attention_backward_dq_sm90_kernel(
    q_desc, do_desc, k_desc, v_desc, LSE, Delta, DQ, stride_dqb, stride_dqh, stride_dqm,
    num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
    Slopes, CuSeqlensQ, CuSeqlensK, WorkTiles, num_seqs, stride_slopes, lse_rows, window_left, window_right,
    softcap_scale,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
    VARLEN: gl.constexpr,
):
    """Grid (cdiv(Lq, 128) · B·Hq,): a head's query tiles consecutive (the CTAs running at once share its K/V in
    L2), longest first with causal masking. Features as bwd_sm90's kernel (bwd_common.feature_args); VARLEN: one
    program per real query tile of every (sequence, query head) (WorkTiles, the work list of cu_seqlens_q)."""
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    if _past_work(WorkTiles, num_q_heads, VARLEN):
        return
    if VARLEN:
        seq, q_head, pid_m, num_m_tiles = ranked_tile_of_work(WorkTiles, num_q_heads, gl.program_id(0))
    else:
        num_m_tiles = gl.cdiv(seqlen_q, 2 * ROWS)
        pid_m = gl.program_id(0) % num_m_tiles
        pid_bh = gl.program_id(0) // num_m_tiles
        seq = pid_bh // num_q_heads
        q_head = pid_bh % num_q_heads
    if CAUSAL:
        pid_m = num_m_tiles - 1 - pid_m
    kv_head = q_head // group_size
    start_m = pid_m * 2 * ROWS
    batch, q_first, seqlen_q, k_first, seqlen_k = sequence_coords(CuSeqlensQ, CuSeqlensK, seq, seqlen_q, seqlen_k,
                                                                  VARLEN)

    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    qdo_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qdo_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=2)

    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_smem, v_smem, qdo_ready, k_ready, v_ready, k_empty, v_empty,
                     LSE, Delta, DQ, stride_dqb, stride_dqh, stride_dqm, batch, q_head, start_m, seqlen_q, seqlen_k,
                     qk_scale, sm_scale, num_q_heads, seq, q_first, lse_rows, window_left, window_right,
                     softcap_scale, Slopes, stride_slopes, 0, HEAD_DIM, BLOCK_D, ROWS, KEYS, NUM_STAGES, CAUSAL,
                     MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, VARLEN)),
        (_consumer, (q_smem, do_smem, k_smem, v_smem, qdo_ready, k_ready, v_ready, k_empty, v_empty,
                     LSE, Delta, DQ, stride_dqb, stride_dqh, stride_dqm, batch, q_head, start_m, seqlen_q, seqlen_k,
                     qk_scale, sm_scale, num_q_heads, seq, q_first, lse_rows, window_left, window_right,
                     softcap_scale, Slopes, stride_slopes, 1, HEAD_DIM, BLOCK_D, ROWS, KEYS, NUM_STAGES, CAUSAL,
                     MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, VARLEN)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_ready, k_ready, v_ready,
                     k_empty, v_empty, batch, q_head, kv_head, start_m, seqlen_q, seqlen_k, q_first, k_first,
                     window_left, window_right, NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


def _tensor_args(q, k, v, grad_out, block_d):
    return (descriptor(q, BLOCK_M, block_d), descriptor(grad_out, BLOCK_M, block_d),
            descriptor(k, BLOCK_N, block_d), descriptor(v, BLOCK_N, block_d))


def launch(q, k, v, lse, grad_out, delta, dq, features, softmax_scale: float, num_stages: int = NUM_STAGES):
    """dq (B, Hq, Lq, D), unit last stride, written in place, from q/grad_out (B, Hq, Lq, D), k/v (B, Hkv, Lk, D)
    (TMA-compatible strides, bf16/fp16), the forward's lse and the preprocess's delta (contiguous float32
    (B, Hq, Lq)); features a CallFeatures or the causal bool (varlen: (1, H, total rows, D)). Returns the
    compiled kernel."""
    kernel, grid, bound = _launch(q, k, v, lse, grad_out, delta, dq, features, softmax_scale, num_stages)
    return kernel[grid](**bound, **LAUNCH_OPTIONS)


def _launch(q, k, v, lse, grad_out, delta, dq, features, softmax_scale: float, num_stages: int):
    """(kernel, grid, every parameter by name)."""
    from flashmoe_science.attention.tiles import padded_head_dim

    num_q_heads, head_dim = q.shape[1], q.shape[3]
    block_d = padded_head_dim(head_dim)
    tail, flags, (programs, seqlen_q, seqlen_k, qk_scale) = feature_args(features, softmax_scale, q, k, 2 * BLOCK_M,
                                                                          over_queries=True)
    kernel = attention_backward_dq_sm90_kernel
    grid = (max(1, programs * num_q_heads),)
    args = (*_tensor_args(q, k, v, grad_out, block_d), lse, delta, dq, *dq.stride()[:3],
            num_q_heads, num_q_heads // k.shape[1], seqlen_q, seqlen_k, qk_scale, softmax_scale, *tail)
    return kernel, grid, dict(zip(kernel.arg_names, args), HEAD_DIM=head_dim, BLOCK_D=block_d,
                              NUM_STAGES=num_stages, **flags)


def compile_offline(head_dim: int, features=False, num_stages: int = NUM_STAGES,
                    dtype: torch.dtype = torch.bfloat16):
    """The kernel built for sm_90 without a GPU (see bwd_sm90.compile_offline)."""
    q = torch.empty(2, 4, 256, head_dim, dtype=dtype, device="meta")
    kv = torch.empty(2, 2, 256, head_dim, dtype=dtype, device="meta")
    lse = torch.empty(2, 4, 256, device="meta")
    kernel, _, bound = _launch(q, kv, kv, lse, q, lse, q, features, 0.07, num_stages)
    return offline_build(kernel, bound)
