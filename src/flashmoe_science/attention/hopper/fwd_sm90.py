"""Attention forward for Hopper (sm_90) in Gluon: TMA loads, asynchronous wgmma, softmax overlapped with P·V.

The algorithm is the one in `triton_fwd` (online softmax in base 2, bottom-right causal mask, GQA by index);
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

The first tile is peeled (there is no P_{-1}) and the last P·V runs after the loop.

A CTA owns BLOCK_M = 128 query rows of one (batch, head), split between two consumer warpgroups of 64 rows each,
each in its own warp-specialised partition. They share the K/V tiles but never wait for each other, so the warp
schedulers interleave one warpgroup's softmax with the other's tensor-core products (FA3's ping-pong, left to
the hardware). A third partition, one producer warp with 24 registers (the consumers get 240), streams K and V
through a ring of NUM_STAGES shared-memory stages. Each stage has a "ready" barrier (the TMA copy landed) and an
"empty" barrier that both consumers arrive on (K after its Q·Kᵀ product, V after its P·V product), so copies run
ahead as far as the ring allows and never sit in a consumer's instruction stream.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashmoe_science.attention.tiles import padded_head_dim
from flashmoe_science.attention.triton_fwd import LOG2_E, key_tile_bounds, tma_box

CONSUMER_ROWS = 64  # rows per consumer warpgroup (4 warps x 16 rows of wgmma)
NUM_CONSUMERS = 2
BLOCK_M = CONSUMER_ROWS * NUM_CONSUMERS
PRODUCER_REGISTERS = gl.constexpr(24)  # the fewest a warp may hold: the producer only computes addresses
CONSUMER_REGISTERS = gl.constexpr(240)
# Registers per thread at launch: the three partitions (two consumer warpgroups, the producer's warpgroup) must
# fit the 64K register file; setmaxnreg then moves the producer's share to the consumers (2*240 + 24 = 3*168).
REGISTER_CAP = 65536 // (3 * 128) // 8 * 8


@gluon.jit
def _kv_producer(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, batch, kv_head, num_tiles,
                 NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """The producer warp: copy K and V tiles into the ring as soon as their stage is released."""
    for tile in range(num_tiles):
        stage = tile % NUM_STAGES
        free_phase = ((tile // NUM_STAGES) & 1) ^ 1  # barriers start "phase 1 complete": the first round passes
        mbarrier.wait(k_empty.index(stage), free_phase)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [batch, kv_head, tile * BLOCK_N, 0], k_ready.index(stage),
                                        k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), free_phase)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [batch, kv_head, tile * BLOCK_N, 0], v_ready.index(stage),
                                        v_smem.index(stage))


@gluon.jit
def _softmax_tile(s, m_i, l_i, start_n, offs_m, seqlen_k, diagonal, full_end, qk_scale,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    """Mask (boundary tiles only), then fold the raw scores s into the running max m and sum l.

    Returns p = exp2(s·scale − m_new) (unnormalised probabilities), m_new, l_new, alpha = exp2(m_old − m_new).
    """
    if start_n + BLOCK_N > full_end:  # only the causal diagonal and the ragged end pay for the mask
        key_pos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(key_pos, 0) < seqlen_k
        if CAUSAL:
            visible = visible & (gl.expand_dims(key_pos, 0) <= gl.expand_dims(offs_m, 1) + diagonal)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    # A row that has seen no key keeps m = -inf: shift it by 0 so exp2 gives 0, not NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_shift, 1))
    alpha = gl.exp2(m_i - m_shift)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _attention_consumer(q_smems, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, O, LSE,
                        stride_ob, stride_oh, stride_om, batch, q_head, pid_bh, cta_start_m, seqlen_q, seqlen_k,
                        cta_num_tiles, qk_scale,
                        CONSUMER: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr,
                        CAUSAL: gl.constexpr):
    """One consumer warpgroup: Q·Kᵀ, softmax, P·V and the epilogue for its BLOCK_M rows, waits placed by hand."""
    num_warps: gl.constexpr = 4
    dtype: gl.constexpr = q_smems.dtype
    q_smem = q_smems.index(CONSUMER)
    q_bar = q_bars.index(CONSUMER)
    start_m = cta_start_m + CONSUMER * BLOCK_M
    diagonal = seqlen_k - seqlen_q  # query i sees key j iff j <= i + diagonal
    full_end, key_end = key_tile_bounds(start_m, seqlen_k, diagonal, BLOCK_M, BLOCK_N, CAUSAL)
    # Causal: the upper consumer sees fewer key tiles than the CTA streams (at least one: see the kernel).
    num_tiles = gl.minimum(gl.maximum(gl.cdiv(key_end, BLOCK_N), 1), cta_num_tiles)
    # wgmma layouts: warps stacked along the rows (16 rows each); instruction N = the full tile width.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_tile = q_smem.reshape([BLOCK_M, BLOCK_D])
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=s_rows)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    o_acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)

    # Tile 0: nothing to overlap with yet.
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_tile, k_smem.index(0).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_zero,
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, offs_m, seqlen_k, diagonal, full_end, qk_scale,
                                       BLOCK_N, CAUSAL, s_layout)

    for j in range(1, num_tiles):
        stage = j % NUM_STAGES
        prev = (j - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(stage), (j // NUM_STAGES) & 1)
        s = warpgroup_mma(q_tile, k_smem.index(stage).reshape([BLOCK_N, BLOCK_D]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        o_acc = o_acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, BLOCK_D]), o_acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))  # S_j done; P_{j-1} V_{j-1} may still run
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j * BLOCK_N, offs_m, seqlen_k, diagonal, full_end,
                                           qk_scale, BLOCK_N, CAUSAL, s_layout)
        o_acc, _ = warpgroup_mma_wait(0, deps=(o_acc, p_op))
        mbarrier.arrive(v_empty.index(prev), count=1)

    last = (num_tiles - 1) % NUM_STAGES
    o_acc = o_acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    mbarrier.wait(v_ready.index(last), ((num_tiles - 1) // NUM_STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    o_acc = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, BLOCK_D]), o_acc, is_async=True)
    o_acc, _ = warpgroup_mma_wait(0, deps=(o_acc, p_op))
    mbarrier.arrive(v_empty.index(last), count=1)

    # Tiles the other consumer still needs: release each stage in order, once its copy has landed, so the two
    # arrivals on an "empty" barrier always belong to the same tile.
    for j in range(num_tiles, cta_num_tiles):
        stage = j % NUM_STAGES
        mbarrier.wait(k_ready.index(stage), (j // NUM_STAGES) & 1)
        mbarrier.arrive(k_empty.index(stage), count=1)
        mbarrier.wait(v_ready.index(stage), (j // NUM_STAGES) & 1)
        mbarrier.arrive(v_empty.index(stage), count=1)

    no_key = l_i == 0.0
    l_safe = gl.where(no_key, 1.0, l_i)
    lse = gl.where(no_key, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    gl.store(LSE + pid_bh.to(gl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)

    out = o_acc / gl.expand_dims(gl.convert_layout(l_safe, o_rows), 1)
    rows = start_m + gl.arange(0, BLOCK_M, layout=o_rows)
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (O + batch.to(gl.int64) * stride_ob + q_head.to(gl.int64) * stride_oh
              + gl.expand_dims(rows, 1) * stride_om + gl.expand_dims(cols, 0))
    mask = gl.expand_dims(rows < seqlen_q, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
    gl.store(o_ptrs, out.to(dtype), mask=mask)


@gluon.jit
def attention_forward_sm90_kernel(
    q_desc, k_desc, v_desc, O, LSE,
    stride_ob, stride_oh, stride_om,
    num_q_heads, group_size, seqlen_q, seqlen_k, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
):
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = q_desc.block_type.shape[2]  # rows per consumer
    CTA_ROWS: gl.constexpr = ROWS * 2
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m  # heaviest query tiles first
    batch = pid_bh // num_q_heads
    q_head = pid_bh % num_q_heads
    kv_head = q_head // group_size
    start_m = pid_m * CTA_ROWS

    # The CTA streams the keys its lowest rows see. At least one tile, so no wait is left on a copy that was never
    # issued; a tile no row can see is fully masked and leaves l = 0 (zeros out, lse -inf).
    _, key_end = key_tile_bounds(start_m, seqlen_k, seqlen_k - seqlen_q, CTA_ROWS, BLOCK_N, CAUSAL)
    num_tiles = gl.maximum(gl.cdiv(key_end, BLOCK_N), 1)

    q_smems = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=2)

    for i in gl.static_range(2):
        mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [batch, q_head, start_m + i * ROWS, 0], q_bars.index(i),
                                        q_smems.index(i))

    upper: gl.constexpr = 0
    lower: gl.constexpr = 1
    gl.warp_specialize([
        (_attention_consumer, (q_smems, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, O, LSE,
                               stride_ob, stride_oh, stride_om, batch, q_head, pid_bh, start_m, seqlen_q, seqlen_k,
                               num_tiles, qk_scale, upper, HEAD_DIM, ROWS, BLOCK_N, BLOCK_D, NUM_STAGES, CAUSAL)),
        (_attention_consumer, (q_smems, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, O, LSE,
                               stride_ob, stride_oh, stride_om, batch, q_head, pid_bh, start_m, seqlen_q, seqlen_k,
                               num_tiles, qk_scale, lower, HEAD_DIM, ROWS, BLOCK_N, BLOCK_D, NUM_STAGES, CAUSAL)),
        (_kv_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, batch, kv_head,
                        num_tiles, NUM_STAGES, BLOCK_N)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, block_d: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, block_d], _GL_DTYPES[dtype])


def _descriptor(t: torch.Tensor, rows: int, block_d: int) -> TensorDescriptor:
    """Gluon's rank-4 TMA descriptor: triton_fwd.tma_box plus the shared-memory layout of the box."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(tma_box(t, rows, block_d), layout=_smem_layout(rows, block_d, t.dtype))
    return desc


def attention_forward_sm90(q, k, v, out, lse, causal: bool, softmax_scale: float, tiles):
    """Launch on checked 4-D bf16/fp16 tensors with TMA-compatible strides (see triton_fwd.tma_compatible)."""
    batch, num_q_heads, seqlen_q, head_dim = q.shape
    block_d = padded_head_dim(head_dim)
    if tiles.block_m != BLOCK_M or tiles.num_warps != 4 * NUM_CONSUMERS:
        raise ValueError(f"the sm_90 kernel runs {BLOCK_M}-row tiles on {4 * NUM_CONSUMERS} warps, got {tiles}")
    grid = ((seqlen_q + BLOCK_M - 1) // BLOCK_M, batch * num_q_heads)
    return attention_forward_sm90_kernel[grid](
        _descriptor(q, CONSUMER_ROWS, block_d), _descriptor(k, tiles.block_n, block_d),
        _descriptor(v, tiles.block_n, block_d), out, lse,
        *out.stride()[:3],
        num_q_heads, num_q_heads // k.shape[1], seqlen_q, k.shape[2], softmax_scale * LOG2_E,
        HEAD_DIM=head_dim, BLOCK_N=tiles.block_n, BLOCK_D=block_d, NUM_STAGES=tiles.num_stages, CAUSAL=causal,
        num_warps=4, maxnreg=REGISTER_CAP,
    )

