"""dK and dV of the attention backward for Hopper (sm_90) at head dims padding to 256, in Gluon; dQ is bwd_dq_sm90's.

bwd_sm90's split (each consumer warpgroup keeps 64 keys' dK and dV over the full head dim) needs 2 x 64 x 256 fp32
accumulators per consumer at D=256: 256 registers a thread, more than a warpgroup has. Here the two consumers split
the head dim for the gradient products instead (as FA3's hdim-256 configuration does), and the scores by keys. dQ
is not computed here: at 64 keys per CTA its partials would be 64 x 256 fp32 per tile to add in L2, and that
reduction alone capped a one-pass kernel at ~265 TFLOP/s on the H200 (atomics or TMA reduce-adds alike; 430 with it
removed, docs/perf-notes.md), so bwd_dq_sm90 computes dQ query-stationary in a second kernel.

A CTA owns BLOCK_N = 64 keys of one (batch, kv head); grid (cdiv(Lk, 64) · B·Hkv). The producer warp is
bwd_common's (K and V once, Q and dO tiles of 64 query rows through a ring). Consumer c (4 warps) per query tile:

    issue  S_c = Q K_cᵀ,  dP_c = dO V_cᵀ            (64 queries x 32 keys: keys [32c, 32c + 32) of the CTA)
    P_c = exp2(S_c·scale·log2e − lse·log2e),  dS_c = P_c ∘ (dP_c − Δ)
    store  P_c, dS_c (bf16/fp16) into slot c of the shared P and dS tiles; both consumers meet (`pds_ready`)
    issue  dVᵀ_j[half c] += dOᵀ[half c] P_j,  dKᵀ_j[half c] += Qᵀ[half c] dS_j     for j = 0, 1
    release the Q/dO stage once they complete

so each consumer holds dKᵀ and dVᵀ for all 64 keys and half the head dim (transposed: the head dim is the wgmma M),
2 x 128 x 64 fp32 = 128 registers. P and dS are double-buffered by tile parity (bwd_sm90's argument: a consumer
cannot write tile t+2's slot before the other has arrived for tile t+1, which it does after its last read of tile
t). Masks, the statistics in the accumulators' initial values and the query-tile bounds are bwd_common's. dK and dV
are deterministic (summed in registers in a fixed order).
"""

from __future__ import annotations

import torch

from flashmoe_science.attention.mask import LOG2_E
from flashmoe_science.attention.seqlen import PER_BATCH_ARGS, sequence_coords
from flashmoe_science.attention.hopper.bwd_common import (
    TWO_KERNEL_BLOCK_D,
    _cta_key_block,
    _past_work,
    _alibi_score_start,
    _probabilities,
    _producer,
    _producer_barriers,
    _score_start,
    _softcap_grad,
    _tile_needs_mask,
    _visited_query_tiles,
    feature_args,
    offline_build,
)
from flashmoe_science.attention.hopper.common import descriptor
from flashmoe_science.gluon.sm90 import CONSUMER_REGISTERS, LAUNCH_OPTIONS, PRODUCER_REGISTERS, wgmma_layout
from flashmoe_science.gluon.compat import (barrier, fence_async_shared, gl, gluon, mbarrier, warpgroup_mma,
                                                  warpgroup_mma_wait)

NUM_CONSUMERS = 2
BLOCK_N = 64  # keys per CTA: dKᵀ and dVᵀ of 64 keys x half the head dim fit a consumer's registers
KEYS_PER_CONSUMER = BLOCK_N // NUM_CONSUMERS  # the score columns each consumer computes
BLOCK_M = 64  # query rows per streamed tile
NUM_STAGES = 2
BLOCK_D = TWO_KERNEL_BLOCK_D


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_ready, q_ready, do_ready, empty, pds_ready,
              LSE, Delta, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              start_n, batch, kv_head, num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
              seq, q_first, k_first, lse_rows, window_left, window_right, softcap_scale, Slopes, stride_slopes,
              CONSUMER: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, ROWS: gl.constexpr,
              KEYS: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr,
              MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, VARLEN: gl.constexpr):
    """Consumer CONSUMER: score columns [CONSUMER·KEYS, +KEYS) of the CTA's keys, head-dim half CONSUMER of dK, dV."""
    dtype: gl.constexpr = q_smem.dtype
    CTA_KEYS: gl.constexpr = 2 * KEYS
    D_HALF: gl.constexpr = BLOCK_D // 2
    # S, dP: (queries, KEYS); dKᵀ_j, dVᵀ_j: (D_HALF, KEYS). Warps stacked on the rows.
    s_layout: gl.constexpr = wgmma_layout(KEYS)
    kv_layout: gl.constexpr = wgmma_layout(KEYS)
    row_slice: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_slice: gl.constexpr = gl.SliceLayout(0, s_layout)

    diagonal = seqlen_k - seqlen_q
    query_start, num_tiles, full_start, full_end = _visited_query_tiles(
        start_n, seqlen_q, seqlen_k, window_left, window_right, ROWS, CTA_KEYS, CAUSAL, MASK_LEFT, MASK_RIGHT)
    dk0 = gl.zeros([D_HALF, KEYS], gl.float32, layout=kv_layout)  # dKᵀ of the CTA's keys [0, KEYS), this half
    dk1 = gl.zeros([D_HALF, KEYS], gl.float32, layout=kv_layout)  # ... keys [KEYS, 2·KEYS)
    dv0 = gl.zeros([D_HALF, KEYS], gl.float32, layout=kv_layout)
    dv1 = gl.zeros([D_HALF, KEYS], gl.float32, layout=kv_layout)
    inv_scale = 1.0 / sm_scale
    offs_key = start_n + CONSUMER * KEYS + gl.arange(0, KEYS, layout=key_slice)
    mbarrier.wait(kv_ready, 0)

    for ring in range(group_size * num_tiles):
        g = ring // num_tiles
        start_m = query_start + (ring - g * num_tiles) * ROWS
        q_head = batch * num_q_heads + kv_head * group_size + g  # flat (batch, query head)
        if VARLEN:  # lse/Δ are (1, Hq, total rows): the sequence's rows of this head
            q_row0 = q_head * lse_rows + q_first
        else:
            q_row0 = q_head * seqlen_q
        if ALIBI:
            slope_log2 = gl.load(Slopes + seq * stride_slopes + kv_head * group_size + g) * LOG2_E
        else:
            slope_log2 = 0.0
        # K and V (and a one-stage ring) addressed through an index the compiler cannot prove constant: hoisted
        # out of the loop, their wgmma descriptors (one per k-step) were ~70 registers held across it, and spilled
        # (300 B of stack, 14% slower)
        opaque_zero = ring // 0x40000000
        stage = ring % NUM_STAGES + opaque_zero
        phase = (ring // NUM_STAGES) & 1
        k_tile = k_smem.index(opaque_zero).reshape([CTA_KEYS, BLOCK_D])
        v_tile = v_smem.index(opaque_zero).reshape([CTA_KEYS, BLOCK_D])
        my_keys = k_tile.slice(CONSUMER * KEYS, KEYS)  # (KEYS, BLOCK_D): B of S_c, read transposed
        my_values = v_tile.slice(CONSUMER * KEYS, KEYS)
        q_tile = q_smem.index(stage).reshape([ROWS, BLOCK_D])
        do_tile = do_smem.index(stage).reshape([ROWS, BLOCK_D])
        slot0 = (ring % 2) * 2  # this tile's P_j and dS_j are at slot0 + j

        # statistics and mask in the accumulators' initial values (bwd_sm90's scheme, per row here)
        offs_q = start_m + gl.arange(0, ROWS, layout=row_slice)
        in_rows = offs_q < seqlen_q
        lse = gl.load(LSE + q_row0 + offs_q, mask=in_rows, other=float("inf"))
        delta = gl.load(Delta + q_row0 + offs_q, mask=in_rows, other=0.0)
        needs_mask = _tile_needs_mask(start_m, full_start, full_end, True, MASK_LEFT or MASK_RIGHT)
        queries = gl.expand_dims(offs_q, 1)
        keys = gl.expand_dims(offs_key, 0)
        s_init = _score_start(gl.zeros([ROWS, KEYS], gl.float32, layout=s_layout), lse, inv_scale, queries, keys,
                              needs_mask, seqlen_k, diagonal, window_left, window_right, 1, CAUSAL, MASK_LEFT,
                              MASK_RIGHT, SOFTCAP)
        s_init = _alibi_score_start(s_init, queries, keys, diagonal, slope_log2 / qk_scale, ALIBI and not SOFTCAP)
        dp_init = gl.zeros([ROWS, KEYS], gl.float32, layout=s_layout) - gl.expand_dims(delta, 1)
        mbarrier.wait(q_ready.index(stage), phase)
        s = warpgroup_mma(q_tile, my_keys.permute((1, 0)), s_init, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp = warpgroup_mma(do_tile, my_values.permute((1, 0)), dp_init, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        p, t = _probabilities(s, lse, queries, keys, needs_mask, seqlen_k, diagonal, window_left, window_right,
                              qk_scale, softcap_scale, slope_log2, 1, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                              ALIBI and SOFTCAP)  # without a softcap ALiBi rode in s_init
        dp = warpgroup_mma_wait(0, deps=(dp,))
        p_smem.index(slot0 + CONSUMER).store(p.to(dtype))
        ds_smem.index(slot0 + CONSUMER).store(_softcap_grad(p * dp, t, SOFTCAP).to(dtype))
        fence_async_shared()  # generic-proxy stores before the wgmmas (async proxy) read them
        barrier()
        mbarrier.arrive(pds_ready.index(ring % 2), count=1)
        mbarrier.wait(pds_ready.index(ring % 2), (ring // 2) & 1)  # the other consumer's slot too

        q_half_t = q_tile.slice(CONSUMER * D_HALF, D_HALF, dim=1).permute((1, 0))  # (D_HALF, ROWS)
        do_half_t = do_tile.slice(CONSUMER * D_HALF, D_HALF, dim=1).permute((1, 0))
        dv0 = warpgroup_mma(do_half_t, p_smem.index(slot0 + 0), dv0, is_async=True)
        dv1 = warpgroup_mma(do_half_t, p_smem.index(slot0 + 1), dv1, is_async=True)
        dk0 = warpgroup_mma(q_half_t, ds_smem.index(slot0 + 0), dk0, is_async=True)
        dk1 = warpgroup_mma(q_half_t, ds_smem.index(slot0 + 1), dk1, is_async=True)
        dv0, dv1, dk0, dk1 = warpgroup_mma_wait(0, deps=(dv0, dv1, dk0, dk1))
        mbarrier.arrive(empty.index(stage), count=1)  # Q and dO are no longer read

    # dKᵀ_j · scale and dVᵀ_j -> dK, dV rows start_n + j·KEYS + key, columns CONSUMER·D_HALF + d
    d_idx = CONSUMER * D_HALF + gl.arange(0, D_HALF, layout=gl.SliceLayout(1, kv_layout))
    key_idx = gl.arange(0, KEYS, layout=gl.SliceLayout(0, kv_layout))
    d_ok = gl.expand_dims(d_idx < HEAD_DIM, 1)
    dk_base = DK + batch.to(gl.int64) * stride_dkb + kv_head.to(gl.int64) * stride_dkh
    dv_base = DV + batch.to(gl.int64) * stride_dvb + kv_head.to(gl.int64) * stride_dvh
    for j in gl.static_range(2):
        keys = start_n + j * KEYS + key_idx
        mask = d_ok & gl.expand_dims(keys < seqlen_k, 0)
        key_rows = gl.expand_dims((k_first + keys).to(gl.int64), 0)  # a packed sequence's rows
        if j == 0:
            dk_j = dk0
            dv_j = dv0
        else:
            dk_j = dk1
            dv_j = dv1
        gl.store(dk_base + key_rows * stride_dkn + gl.expand_dims(d_idx, 1), (dk_j * sm_scale).to(dtype), mask=mask)
        gl.store(dv_base + key_rows * stride_dvn + gl.expand_dims(d_idx, 1), dv_j.to(dtype), mask=mask)


@gluon.jit(do_not_specialize=PER_BATCH_ARGS)
def attention_backward_sm90_hdim256_kernel(
    q_desc, do_desc, k_desc, v_desc, LSE, Delta, DK, DV,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    num_q_heads, num_kv_heads, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
    Slopes, CuSeqlensQ, CuSeqlensK, WorkTiles, num_seqs, stride_slopes, lse_rows, window_left, window_right,
    softcap_scale,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
    VARLEN: gl.constexpr,
):
    """Grid (cdiv(Lk, 64) · B·Hkv,), key tiles of a (batch, kv head) consecutive (bwd_sm90's order; varlen: its
    real key tiles only). Features as bwd_sm90's kernel (bwd_common.feature_args)."""
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    CTA_KEYS: gl.constexpr = k_desc.block_type.shape[2]
    KEYS: gl.constexpr = CTA_KEYS // 2
    if _past_work(WorkTiles, num_kv_heads, VARLEN):
        return
    start_n, seq, kv_head = _cta_key_block(seqlen_k, num_kv_heads, WorkTiles, CTA_KEYS, VARLEN)
    batch, q_first, seqlen_q, k_first, seqlen_k = sequence_coords(CuSeqlensQ, CuSeqlensK, seq, seqlen_q, seqlen_k,
                                                                  VARLEN)

    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    # one-entry arrays: the consumers index them (see opaque_zero), the producer fills entry 0
    k_boxes = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_boxes = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, KEYS], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [4, ROWS, KEYS], pds_layout)  # [2 · tile parity + slot j]
    ds_smem = gl.allocate_shared_memory(dtype, [4, ROWS, KEYS], pds_layout)
    kv_ready, q_ready, do_ready, empty = _producer_barriers(NUM_STAGES)
    pds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(pds_ready.index(i), count=2)

    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_boxes, v_boxes, p_smem, ds_smem, kv_ready, q_ready, do_ready,
                     empty, pds_ready, LSE, Delta, DK, DV, stride_dkb, stride_dkh, stride_dkn,
                     stride_dvb, stride_dvh, stride_dvn, start_n, batch, kv_head, num_q_heads, group_size,
                     seqlen_q, seqlen_k, qk_scale, sm_scale, seq, q_first, k_first, lse_rows, window_left,
                     window_right, softcap_scale, Slopes, stride_slopes,
                     0, HEAD_DIM, BLOCK_D, ROWS, KEYS, NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI,
                     VARLEN)),
        (_consumer, (q_smem, do_smem, k_boxes, v_boxes, p_smem, ds_smem, kv_ready, q_ready, do_ready,
                     empty, pds_ready, LSE, Delta, DK, DV, stride_dkb, stride_dkh, stride_dkn,
                     stride_dvb, stride_dvh, stride_dvn, start_n, batch, kv_head, num_q_heads, group_size,
                     seqlen_q, seqlen_k, qk_scale, sm_scale, seq, q_first, k_first, lse_rows, window_left,
                     window_right, softcap_scale, Slopes, stride_slopes,
                     1, HEAD_DIM, BLOCK_D, ROWS, KEYS, NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI,
                     VARLEN)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_boxes.index(0), v_boxes.index(0),
                     kv_ready, q_ready, do_ready, empty, start_n, batch, kv_head, group_size, seqlen_q, seqlen_k,
                     q_first, k_first, window_left, window_right, NUM_STAGES, CAUSAL, MASK_LEFT, MASK_RIGHT)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


def launch(q, k, v, lse, grad_out, delta, dk, dv, features, softmax_scale: float, num_stages: int = NUM_STAGES):
    """dk, dv in place, with bwd_sm90.attention_backward_sm90's conventions (delta from its preprocess; features a
    CallFeatures or the causal bool). Returns the compiled kernel."""
    kernel, grid, bound = _launch(q, k, v, lse, grad_out, delta, dk, dv, features, softmax_scale, num_stages)
    return kernel[grid](**bound, **LAUNCH_OPTIONS)


def _launch(q, k, v, lse, grad_out, delta, dk, dv, features, softmax_scale: float, num_stages: int):
    """(kernel, grid, every parameter by name)."""
    num_q_heads, head_dim, num_kv_heads = q.shape[1], q.shape[3], k.shape[1]
    tail, flags, (programs, seqlen_q, seqlen_k, qk_scale) = feature_args(features, softmax_scale, q, k, BLOCK_N)
    kernel = attention_backward_sm90_hdim256_kernel
    grid = (max(1, programs * num_kv_heads),)
    args = (*_tensor_args(q, k, v, grad_out), lse, delta, dk, dv, *dk.stride()[:3], *dv.stride()[:3],
            num_q_heads, num_kv_heads, num_q_heads // num_kv_heads, seqlen_q, seqlen_k, qk_scale, softmax_scale,
            *tail)
    return kernel, grid, dict(zip(kernel.arg_names, args), HEAD_DIM=head_dim, BLOCK_D=BLOCK_D,
                              NUM_STAGES=num_stages, **flags)


def _tensor_args(q, k, v, grad_out):
    """TMA descriptors: Q and dO in tiles of BLOCK_M rows, K and V in the CTA's BLOCK_N rows, all BLOCK_D wide."""
    return (descriptor(q, BLOCK_M, BLOCK_D), descriptor(grad_out, BLOCK_M, BLOCK_D),
            descriptor(k, BLOCK_N, BLOCK_D), descriptor(v, BLOCK_N, BLOCK_D))


def compile_offline(head_dim: int, features=False, num_stages: int = NUM_STAGES,
                    dtype: torch.dtype = torch.bfloat16):
    """bwd_sm90.compile_offline's counterpart for this kernel (head dims 129..256)."""
    q = torch.empty(2, 4, 256, head_dim, dtype=dtype, device="meta")
    kv = torch.empty(2, 2, 256, head_dim, dtype=dtype, device="meta")
    lse = torch.empty(2, 4, 256, device="meta")
    kernel, _, bound = _launch(q, kv, kv, lse, q, lse, kv, kv, features, 0.07, num_stages)
    return offline_build(kernel, bound)
