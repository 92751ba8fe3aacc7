"""The MoE backward's sorted-rows GEMMs for Hopper (sm_90) in Gluon, one kernel with three epilogues (EPILOGUE):

- dx (``SCATTER_ADD``, ``dx_sm90``): ``dx32[token] += d(gate, up)[row] @ w1[e]``, ``triton_gemm.dx_launch``'s
  product (``_down_combine_kernel`` with K = 2F, N = d, no row scale): every valid row's float32 result is added
  atomically into ``dx32[token]`` (the top_k rows of a token meet there).
- dh (``ROW_STORE``, ``dh_sm90``): ``dh[row] = dout[token(row)] @ w2[e]``, ``triton_gemm.dh_launch``'s product
  (K = d, N = F), stored to the row's own row of the float32 dh (no atomics). TMA loads dense boxes, so A is dout
  already gathered to the sorted rows (``gemms.sorted_rows``: one (rows, d) copy, which Triton's kernel does
  in its loads instead). Alone it did not pay in the layer (perf notes v18: 1.46 ms vs Triton's 1.54 at Mixtral
  T=4096, 1.63 with the gather); it stays for the A/B, as the fused mode's baseline.
- dh with the SwiGLU backward (``SWIGLU_BWD``, ``dh_swiglu_sm90``, what moe_backward runs on Hopper): the dh
  product as above, and in the epilogue what ``triton_gemm._swiglu_backward_kernel`` computes from it, so that dh
  never reaches memory (see below).
- the rows combine's dx and down (``dx_sm90(..., store_rows=True)``: ``ROW_STORE``; ``down_sm90(...,
  store_rows=True)``: ``DOWN_ROWS``): the same products, each valid sorted row (down: scaled by its routing weight)
  stored to its own row of a (sort rows, d) buffer in the operands' dtype instead of added into its token's row;
  ``triton_gemm.combine_rows_launch`` then sums each token's rows (``tiles.COMBINES``: no atomics, deterministic).

All are A (sorted rows x K, dense) times the expert's block of B = the weight viewed (E*K, N), over the
expert-sorted rows of ``dispatch.ExpertSort``: row tile t (BLOCK_M = 128 sorted rows, one expert) times
``B[e*K + k0 : +BLOCK_K, n0 : +BLOCK_N]``; padding rows are dropped in the epilogue. What changes against Triton
is the schedule: Triton's kernel loads both operands with cp.async and waits for each wgmma before the next
instruction that could touch its registers, so its warps alternate between issuing loads and tensor-core work.
Here the roles are split into warp-specialised partitions that only meet at mbarriers (described for dx; dh
differs only in its operands and its epilogue's store):

- **Producer** (one warp, 24 registers after setmaxnreg): walks the CTA's work items in the consumers' order and,
  for each K step, waits until ring stage ``s`` is released ("empty"), then issues two TMA copies into it: the A
  tile ``dgu[tile*128 : +128, k0 : +BLOCK_K]`` (dense in sorted order, no gather needed) and the B tile
  ``w1.view(E*2F, d)[e*2F + k0 : +BLOCK_K, n0 : +BLOCK_N]``, both completing on the stage's "ready" barrier
  (expect-tx of both boxes' bytes). It only computes coordinates, so it runs ahead of the consumers by the whole
  ring (NUM_STAGES stages), across work items too: the next item's first tiles land during the current epilogue.
  A K box never straddles two experts because the wrapper requires K % BLOCK_K == 0 (2F; dh: d).
- **Two consumer warpgroups** (240 registers each) in one of two modes:
  * cooperative (default): both take every work item, consumer c the rows [64c, 64c+64) of the 128-row tile, so
    a 128x256 tile is two 64x256 fp32 accumulators of 128 registers per thread (the largest wgmma, m64n256k16, and
    the least shared-memory traffic per FLOP). Each K step: wait "ready", issue the async wgmma on its row slice
    of A and all of B, wait until only that wgmma is in flight, then arrive on the previous stage's "empty"
    (count 2: the stage is refilled once both consumers are done with it).
  * ping-pong (``pingpong=True``, BLOCK_N = 128 only): consumers alternate work items, each computing the whole
    128-row tile (128x128 fp32 = 128 registers). A consumer starts an item's wgmmas once the other has issued all of
    its previous item's (a "turn" barrier), so one consumer's epilogue (the atomics) runs while the other's
    wgmmas keep the tensor cores busy. "empty" has count 1. The turn barrier also keeps the ring safe: a
    consumer never waits on a stage's "ready" more than one phase ahead of it (mbarrier parity waits cannot tell
    phase p from p+2).
  The epilogue (after waiting for the last wgmma) drops padding rows (pair id = num_pairs; the ids are loaded
  before the K loop) and columns past N, and adds the accumulator straight from registers with relaxed float32
  atomics (``REDG.E.ADD.F32x2``: each thread holds adjacent column pairs; dh: ``STG.E.64`` stores, each quad of
  threads a full 32-byte sector of a row). No shared-memory staging (Triton's
  kernel converts to 4-wide vectors through the idle ring): here the ring is busy with the next item's loads, and
  a 128x256 fp32 tile (128 KiB) would not fit beside it. In cooperative mode the tensor cores idle during the
  epilogue (negligible at Mixtral's K = 28672, a few percent at Qwen3's K = 1536: what ping-pong is for).

**The SwiGLU backward epilogue** (``SWIGLU_BWD``, ping-pong 128x128 only). Why: the Triton path writes dh (rows x F
float32) and reads it back in a separate memory-bound pass (``_swiglu_backward_kernel``, 0.42 ms at Mixtral T=4096
beside dh's 1.6 ms), and Triton could not fuse it (its layouts spilled: that kernel's docstring). Here the
consumer's accumulator ``acc = dh[rows, cols]`` stays in registers and the epilogue's operands come through shared
memory: after an item's K steps the producer TMA-loads its ``gate = gate_up[rows, cols]``, ``up = gate_up[rows, F +
cols]`` and ``h[rows, cols]`` into one set of epilogue buffers (BLOCK_N / swiglu_cols chunks of 128 x swiglu_cols
each, 96 KiB in all, completing on ``epi_ready``), once the previous item's epilogue has released them
(``epi_empty``). The consumer, chunk by chunk (``column_halves`` halves the accumulator: register selections, no
shuffles), reads them in the accumulator's layout (``LDSM``), computes the Triton pass's expressions
(``dscale[pair] += sum_cols dh * h``; ``dhs = scale * dh``; ``d gate = dhs * up * sig * (1 + gate * (1 - sig))``,
``d up = dhs * silu(gate)``), writes d(gate, up) over the chunk's gate and up buffers (``STSM``) and TMA-stores
them at once, so that the stores overlap the next chunk; it waits for the stores to have read the buffers before
releasing them. The routing-weight gradient is added with one float32 ``REDG`` per row and column block (dscale must
start at zero; the order of the additions is not fixed). Padding rows of the tile get zeros (dw1's Gluon kernel
reads them unmasked), rows of unused tiles are never written. The sigmoid uses the approximate ex2 and reciprocal
(``swiglu_epilogue._fast_sigmoid``): with the IEEE expression the epilogue outlasted the other consumer's main loop.

Measured on the H200 (interleaved do_bench medians): Mixtral T=4096 1.73 ms against 2.13 for Triton's dh + SwiGLU
pass (plain dh with this tile 1.57); Qwen3 0.28 ms against 0.32 (plain 0.23). Loading the operands by global loads
in the accumulator layout instead took 2.0-2.3 ms at Mixtral: ~400 exposed 4-byte loads per thread and item.
Registers: 128 accumulator floats per thread plus a chunk's gate, up and h; 32-column chunks build without spills
(16 too; 64 spill).

The A operand stays pre-gathered (``gemms.sorted_rows(dout)``, ~0.03 ms at Mixtral T=4096, ~2% of the
GEMM; a third of it at Qwen3's F = 768): Hopper's TMA has no row gather, and a gathering producer (cp.async rows
by a producer warpgroup, which then needs registers the consumers have) is a larger change. dw2's gathered operand
cannot serve: it is dout scaled by the routing weight, and dscale would then need a division by it (undefined at
weight 0).

Offline sm_90 builds (triton 3.6): no spills in any config; the
consumers use at most 175 registers (cooperative 128x256), 96 (cooperative 128x128), 183 (ping-pong 128x128) of
their 240 for dx, 151 / 159 (cooperative 128x256 / ping-pong 128x128) for dh; shared memory 147680 / 196840 bytes
at 128x256 with 3 / 4 stages, 98528 + 32768 per stage at 128x128. dx's SASS is as before dh's epilogue was added.
dh_swiglu (``--gemm dh_swiglu``): no spills at 16- and 32-column chunks; shared memory 229728 bytes with 4
stages (the ring's 131072 + 98304 for the epilogue buffers; 5 stages do not fit), 196960 with 3.

Persistent: ``num_ctas`` = the SM count (at most the number of work items); CTA c takes work items c, c + num_ctas,
... Work items are (row tile, column block) pairs numbered in ``triton_gemm._row_tile_and_col_block``'s GROUP_M
order (mirrored in ``common.grouped_block``; Gluon cannot call a @triton.jit helper), so the ~132 items
in flight at any moment cover a few row tiles (mostly one expert) across the column blocks, and the expert's
weight blocks are read from L2 by all but the first of them. The number of row tiles is the number *used* (read
on the device from the sort's last expert: its first row plus its count, rounded up to tiles), not the sort's
worst case ``tile_expert.numel()``, so no CTA draws an empty item while another has two left; this changes the
order of the last, partial group only. Tiles with tile_expert < 0 are skipped all the same (by every partition
alike, so the ring positions stay in step). With ``split_tail`` (dx only) the work is counted in units
(``_work_units``): whole items, then the last partial wave's items each split along K into as many parts as that
wave has CTAs per item, so that a wave of few long items (Mixtral's K = 28672: 1088 items of 128x256 are 8.24
waves of ~350 us on 132 SMs) ends after a fraction of an item instead of a whole one; the parts add into dx32 by
the same atomics. The launch then takes every SM even when there are fewer items than SMs.

The producer step, the consumers' main loop, the barriers' set-up, descriptors and offline builds live in
``common`` (shared with wgrad_sm90); the SASS is as before that move (the 128x128 configs' bit for bit).

Numerics: bf16 (or fp16) operands, float32 accumulation in the wgmma, float32 atomics into dx32 (dh: stored as
accumulated): the same as the Triton kernels up to the order of the K-sum inside the tensor core and, for dx, the
order of the top_k atomic additions (not fixed: results may differ in the last bits from run to run, as with the
Triton kernel; dh is deterministic). dh_swiglu: d(gate, up) from the float32 accumulator with the Triton pass's
expressions (the sigmoid to ~2 float32 ulp), rounded once (as the Triton pair, which stores dh in float32): it
differs from the Triton path only where dh's or the sigmoid's last float32 bits flip a rounding (about 1e-4 of the
elements, by one ulp of the output dtype); the routing-weight gradient sums per column block, added atomically
(not deterministic in its last bits, unlike the Triton pass's whole-row sums).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from flashmoe_science.gluon import sm90
from flashmoe_science.gluon.sm90 import (CONSUMER_REGISTERS, GL_DTYPES, LAUNCH_OPTIONS, PRODUCER_REGISTERS,
                                            wgmma_layout)
from flashmoe_science.gluon.compat import gl, gluon, mbarrier, tma, warpgroup_mma_wait
from flashmoe_science.moe.dispatch import ExpertSort
from flashmoe_science.moe.hopper.common import (HOPPER_SMEM_PER_BLOCK, NUM_CONSUMERS,  # noqa: F401 (the limit)
                                                grouped_block, init_barriers, load_stage, mma_steps)
# the configs are this kernel's: the tests and the offline builds read them here
from flashmoe_science.moe.hopper.dx_configs import (BLOCK_M, DH_CONFIG, DH_SWIGLU_CONFIG, LONG_K,  # noqa: F401
                                                    LONG_K_CONFIG, SHORT_K_CONFIG, DxConfig, check_config,
                                                    down_config, dx_config, smem_bytes)
from flashmoe_science.moe.hopper.swiglu_epilogue import (SwigluOperands, load_swiglu_operands,
                                                         swiglu_backward_columns, swiglu_reason)
from flashmoe_science.moe.tiles import sm_count
from flashmoe_science.prepared_launch import PreparedLaunch




# the epilogues (constexpr EPILOGUE): dx's atomic scatter-add into token rows, dh's row store, dh's SwiGLU backward
SCATTER_ADD = gl.constexpr(0)
ROW_STORE = gl.constexpr(1)
SWIGLU_BWD = gl.constexpr(2)
# the forward's down GEMM: SCATTER_ADD of the rows scaled by their routing weights; its B (w2, stored (E, d, F)) is
# K-major: B boxes are (BLOCK_N, BLOCK_K) tiles of w2 viewed (E*d, F), read transposed by the wgmma
DOWN = gl.constexpr(3)
# the down GEMM for the rows combine (tiles.COMBINES): DOWN's product and scaling, stored as ROW_STORE stores
DOWN_ROWS = gl.constexpr(4)


@gluon.constexpr_function
def b_k_major(epilogue):
    """Whether the product's B is stored (N, K) (the forward's w2) rather than (K, N) (dx's w1, dh's w2)."""
    return getattr(epilogue, "value", epilogue) in (DOWN.value, DOWN_ROWS.value)


# ------------------------------------------------------------------------------------------------------ the kernel
@gluon.jit
def _num_work(expert_counts_ptr, expert_row_start_ptr, num_experts, num_tiles_max, N,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(row tiles used, work items): the experts' rows are laid out in expert order, each padded to BLOCK_M, so the
    used rows end where the last expert's do."""
    last = num_experts - 1
    used_rows = gl.load(expert_row_start_ptr + last) + gl.load(expert_counts_ptr + last)
    num_row_tiles = gl.minimum((used_rows + BLOCK_M - 1) // BLOCK_M, num_tiles_max)
    return num_row_tiles, num_row_tiles * gl.cdiv(N, BLOCK_N)


@gluon.jit
def _work_units(num_work, k_steps, SPLIT_TAIL: gl.constexpr):
    """(whole items, parts per tail item, work units) of this launch. Without SPLIT_TAIL every item is
    one unit. With it, the items of the last, partial wave (num_work % CTAs of them) are each split along K into
    as many parts as that wave has CTAs per item (at most one K step each), so that the wave's CTAs share their
    work instead of most of them idling: at Mixtral T=4096, dx's 1088 128x256 items are 8.24 waves of ~350 us
    each on 132 SMs. The parts add into dx32 like whole items (the epilogue's atomics), so nothing else changes."""
    num_ctas = gl.num_programs(0)
    if SPLIT_TAIL:
        tail = num_work % num_ctas
        parts = gl.minimum(gl.maximum(num_ctas // gl.maximum(tail, 1), 1), k_steps)
    else:
        tail = num_work * 0
        parts = tail + 1
    whole = num_work - tail
    return whole, parts, whole + tail * parts


@gluon.jit
def _unit_item(unit, whole, parts, k_steps):
    """Work unit -> (work item, first K step, K steps): units below ``whole`` are whole items; the rest are the
    tail items' parts, ``parts`` consecutive units per item, each an even share of its K steps."""
    t = gl.maximum(unit - whole, 0)
    part = t % parts
    is_whole = unit < whole
    work = gl.where(is_whole, unit, whole + t // parts)
    k_first = gl.where(is_whole, 0, part * k_steps // parts)
    k_end = gl.where(is_whole, k_steps, (part + 1) * k_steps // parts)
    return work, k_first, k_end - k_first


@gluon.jit
def _producer(a_desc, b_desc, gate_up_desc, h_desc, a_smem, b_smem, epi_smem, ready, empty, epi_ready, epi_empty,
              tile_expert_ptr, expert_counts_ptr, expert_row_start_ptr, num_experts, num_tiles_max, K, N,
              GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, EPILOGUE: gl.constexpr, SPLIT_TAIL: gl.constexpr):
    """One warp: every K step of every work unit of this CTA, A and B tiles by TMA into the next ring stage once
    the consumers have released it; for SWIGLU_BWD, after an item's K steps, the item's gate, up and h boxes into
    the epilogue buffers once the previous item's epilogue has released them."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    B_K_MAJOR: gl.constexpr = b_k_major(EPILOGUE)
    BN: gl.constexpr = b_desc.block_type.shape[0] if B_K_MAJOR else b_desc.block_type.shape[1]
    num_row_tiles, num_work = _num_work(expert_counts_ptr, expert_row_start_ptr, num_experts, num_tiles_max, N,
                                        BM, BN)
    num_col_blocks = gl.cdiv(N, BN)
    k_steps = K // BK
    whole, parts, num_units = _work_units(num_work, k_steps, SPLIT_TAIL)
    ring = 0  # K steps issued so far by this CTA (ring position)
    epi_items = 0  # items whose epilogue operands were loaded so far (SWIGLU_BWD)
    for unit in range(gl.program_id(0), num_units, gl.num_programs(0)):
        work, k_first, unit_steps = _unit_item(unit, whole, parts, k_steps)
        tile, col_block = grouped_block(work, num_row_tiles, num_col_blocks, GROUP_M)
        expert = gl.load(tile_expert_ptr + tile)
        if expert >= 0:
            b_row = expert * K
            for ks in range(k_first, k_first + unit_steps):
                if B_K_MAJOR:  # B viewed (E*N, K)
                    load_stage(a_desc, tile * BM, ks * BK, b_desc, expert * N + col_block * BN, ks * BK, a_smem,
                               b_smem, ready, empty, ring, NUM_STAGES)
                else:  # B viewed (E*K, N)
                    load_stage(a_desc, tile * BM, ks * BK, b_desc, b_row + ks * BK, col_block * BN, a_smem, b_smem,
                               ready, empty, ring, NUM_STAGES)
                ring += 1
            if EPILOGUE == SWIGLU_BWD:
                load_swiglu_operands(gate_up_desc, h_desc, epi_smem, epi_ready, epi_empty, epi_items, tile * BM,
                                      col_block * BN, N)
                epi_items += 1


@gluon.jit
def _consumer(a_smem, b_smem, epi_smem, ready, empty, turn, epi_ready, epi_empty, out_ptr, dgu_desc,
              sorted_pair_ids_ptr, tile_expert_ptr, expert_counts_ptr, expert_row_start_ptr, row_scale_ptr,
              dscale_ptr, num_experts, num_tiles_max, num_pairs, top_k, K, N, stride_out,
              CONSUMER: gl.constexpr, PINGPONG: gl.constexpr, ROWS: gl.constexpr, GROUP_M: gl.constexpr,
              NUM_STAGES: gl.constexpr, EPILOGUE: gl.constexpr, SPLIT_TAIL: gl.constexpr):
    """One consumer warpgroup: its rows of every work item (cooperative), or every other work item (ping-pong); the
    epilogue adds them into their tokens' rows of out (SCATTER_ADD, dx; DOWN scaled by the rows' routing weights),
    stores them to their own rows (ROW_STORE, dh) or stores the SwiGLU backward of them to their own rows of d(gate,
    up) by TMA (SWIGLU_BWD, ping-pong)."""
    BM: gl.constexpr = a_smem.type.shape[1]
    BK: gl.constexpr = a_smem.type.shape[2]
    B_K_MAJOR: gl.constexpr = b_k_major(EPILOGUE)
    BN: gl.constexpr = b_smem.type.shape[1] if B_K_MAJOR else b_smem.type.shape[2]
    ROW0: gl.constexpr = 0 if PINGPONG else CONSUMER * ROWS
    acc_layout: gl.constexpr = wgmma_layout(BN)
    # the epilogue's row vectors in the layout of the tile slices it works on (SWIGLU_BWD: chunks of COLS columns)
    EPILOGUE_N: gl.constexpr = dgu_desc.block_type.shape[1] if EPILOGUE == SWIGLU_BWD else BN
    row_layout: gl.constexpr = gl.SliceLayout(1, wgmma_layout(EPILOGUE_N))
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)

    num_row_tiles, num_work = _num_work(expert_counts_ptr, expert_row_start_ptr, num_experts, num_tiles_max, N,
                                        BM, BN)
    num_col_blocks = gl.cdiv(N, BN)
    k_steps = K // BK
    whole, parts, num_units = _work_units(num_work, k_steps, SPLIT_TAIL)
    ring = 0  # ring position of the current item's first K step
    item = 0  # the CTA's work units so far
    epi_items = 0  # the CTA's items with an epilogue so far (both consumers count every one: the buffers' phase)
    for unit in range(gl.program_id(0), num_units, gl.num_programs(0)):
        work, _, unit_steps = _unit_item(unit, whole, parts, k_steps)
        tile, col_block = grouped_block(work, num_row_tiles, num_col_blocks, GROUP_M)
        expert = gl.load(tile_expert_ptr + tile)
        item_steps = gl.where(expert >= 0, unit_steps, 0)
        if PINGPONG:
            mine = item % 2 == CONSUMER
        else:
            mine = True
        if mine:
            # the rows' pair ids (and routing weights), loaded ahead of the K loop so the epilogue does not wait
            rows = tile * BM + ROW0 + gl.arange(0, ROWS, layout=row_layout)
            pairs = gl.load(sorted_pair_ids_ptr + rows)
            if EPILOGUE == SWIGLU_BWD or EPILOGUE == DOWN or EPILOGUE == DOWN_ROWS:
                scale = gl.load(row_scale_ptr + pairs, mask=pairs < num_pairs, other=0.0)
            if PINGPONG:
                # wait until the other consumer has issued its wgmmas of the previous item (its epilogue then
                # overlaps ours), which also means every ring stage this item reads has completed its previous phase
                mbarrier.wait(turn.index(CONSUMER), ((item - 1) // 2) & 1, pred=item > 0)
            acc = gl.zeros([ROWS, BN], gl.float32, layout=acc_layout)
            acc, end = mma_steps(a_smem, b_smem, ready, empty, ring, item_steps, acc, ROW0, ROWS, NUM_STAGES,
                                 False, B_K_MAJOR)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if item_steps > 0:
                mbarrier.arrive(empty.index((end + NUM_STAGES - 1) % NUM_STAGES), count=1)
                valid = pairs < num_pairs  # padding rows hold num_pairs
                if EPILOGUE == SWIGLU_BWD:
                    mbarrier.wait(epi_ready, epi_items & 1)
                    dscale = swiglu_backward_columns(acc, 0, valid, scale, epi_smem, dgu_desc, tile * BM,
                                                      col_block * BN, N)
                    tma.store_wait(0)  # the stores have read the buffers: the producer may refill them
                    mbarrier.arrive(epi_empty, count=1)
                    # one partial sum per row and column block (the quad of threads holding a row adds once)
                    gl.atomic_add(dscale_ptr + pairs, dscale, mask=valid, sem="relaxed")
                else:
                    if EPILOGUE == ROW_STORE or EPILOGUE == DOWN_ROWS:
                        out_rows = rows.to(gl.int64)
                    else:
                        out_rows = gl.where(valid, pairs // top_k, 0).to(gl.int64)  # the rows' tokens
                    if EPILOGUE == DOWN or EPILOGUE == DOWN_ROWS:
                        acc = acc * gl.expand_dims(scale, 1)
                    cols = col_block * BN + gl.arange(0, BN, layout=col_layout)
                    ptrs = out_ptr + gl.expand_dims(out_rows * stride_out, 1) + gl.expand_dims(cols, 0)
                    mask = gl.expand_dims(valid, 1) & gl.expand_dims(cols < N, 0)
                    if EPILOGUE == ROW_STORE or EPILOGUE == DOWN_ROWS:
                        # float32 (dh) or the operands' dtype (the rows combine's buffers)
                        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
                    else:
                        gl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
        ring += item_steps
        epi_items += (expert >= 0).to(gl.int32)
        item += 1


@gluon.jit(do_not_specialize=["num_tiles_max", "num_pairs"])
def sorted_rows_sm90_kernel(a_desc, b_desc, gate_up_desc, h_desc, dgu_desc, out_ptr, sorted_pair_ids_ptr,
                            tile_expert_ptr, expert_counts_ptr, expert_row_start_ptr, row_scale_ptr, dscale_ptr,
                            num_experts, num_tiles_max, num_pairs, top_k, K, N, stride_out,
                            GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                            ROWS: gl.constexpr, EPILOGUE: gl.constexpr, SPLIT_TAIL: gl.constexpr):
    """Persistent: each CTA runs work units program_id, program_id + num_programs, ... (see the module docstring).
    gate_up_desc, h_desc, dgu_desc, row_scale_ptr and dscale_ptr are SWIGLU_BWD's (unused else)."""
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    if EPILOGUE == SWIGLU_BWD:
        # gate, up and h of one item, chunk by chunk (BLOCK_N / COLS chunks of 128 x COLS; d(gate, up) reuses them)
        EPI_BUFFERS: gl.constexpr = 3 * (b_desc.block_type.shape[1] // dgu_desc.block_type.shape[1])
        epi_smem = gl.allocate_shared_memory(dtype, [EPI_BUFFERS] + dgu_desc.block_type.shape, dgu_desc.layout)
    else:
        epi_smem = gl.allocate_shared_memory(dtype, [1, 8, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ready, empty, turn = init_barriers(NUM_STAGES, PINGPONG)
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    epi_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_empty, count=1)

    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, epi_smem, ready, empty, turn, epi_ready, epi_empty, out_ptr, dgu_desc,
                     sorted_pair_ids_ptr, tile_expert_ptr, expert_counts_ptr, expert_row_start_ptr, row_scale_ptr,
                     dscale_ptr, num_experts, num_tiles_max, num_pairs, top_k, K, N, stride_out,
                     0, PINGPONG, ROWS, GROUP_M, NUM_STAGES, EPILOGUE, SPLIT_TAIL)),
        (_consumer, (a_smem, b_smem, epi_smem, ready, empty, turn, epi_ready, epi_empty, out_ptr, dgu_desc,
                     sorted_pair_ids_ptr, tile_expert_ptr, expert_counts_ptr, expert_row_start_ptr, row_scale_ptr,
                     dscale_ptr, num_experts, num_tiles_max, num_pairs, top_k, K, N, stride_out,
                     1, PINGPONG, ROWS, GROUP_M, NUM_STAGES, EPILOGUE, SPLIT_TAIL)),
        (_producer, (a_desc, b_desc, gate_up_desc, h_desc, a_smem, b_smem, epi_smem, ready, empty, epi_ready,
                     epi_empty, tile_expert_ptr, expert_counts_ptr, expert_row_start_ptr, num_experts,
                     num_tiles_max, K, N, GROUP_M, NUM_STAGES, EPILOGUE, SPLIT_TAIL)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


# ---------------------------------------------------------------------------------------------------- the wrappers
class _Gemm(NamedTuple):
    """What differs between the products on the host: the operands' names (for messages), K and N's names,
    the Triton fallback, and the epilogue."""

    a: str
    w: str
    out: str
    k: str
    n: str
    triton: str
    epilogue: int


GEMMS = {"dx": _Gemm("dgu", "w1", "dx32", "2F", "d", "dx_launch", SCATTER_ADD.value),
         "dh": _Gemm("dout_sorted", "w2", "dh", "d", "F", "dh_launch", ROW_STORE.value),
         "dh_swiglu": _Gemm("dout_sorted", "w2", "dgu", "d", "F", "dh_launch + swiglu_backward_launch",
                            SWIGLU_BWD.value),
         "down": _Gemm("h", "w2", "out32", "F", "d", "down_forward_launch", DOWN.value),
         # the rows combine's (tiles.COMBINES): each sorted row stored to its own row, in the operands' dtype
         "dx_rows": _Gemm("dgu", "w1", "dx_rows", "2F", "d", "dx_launch", ROW_STORE.value),
         "down_rows": _Gemm("h", "w2", "out_rows", "F", "d", "down_forward_launch", DOWN_ROWS.value)}

# products whose out is (sort rows, N) in the operands' dtype
_ROWS_IN_OPERAND_DTYPE = ("dx_rows", "down_rows")


def _gemm_dims(w, epilogue: int):
    """(E, K, N) of the product's weight: stored (E, K, N), or (E, N, K) where B is K-major (DOWN)."""
    num_experts, rows, cols = w.shape
    return (num_experts, cols, rows) if b_k_major(epilogue) else (num_experts, rows, cols)


def unsupported_reason(a, w, out, sort: ExpertSort, block_m: int, config: DxConfig, gemm: str = "dx",
                       swiglu: SwigluOperands | None = None, row_scale: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot take these arguments, or None where it can. ``gemm="dx"``: a = dgu (rows, 2F),
    w = w1 (E, 2F, d), out = dx32 (T, d); ``gemm="dh"``: a = dout_sorted (rows, d), w = w2 (E, d, F),
    out = dh (rows, F); ``gemm="dh_swiglu"``: as dh, but out = dgu (rows, 2F) in w2's dtype, and ``swiglu``;
    ``gemm="down"``: a = h (rows, F), w = w2 (E, d, F), out = out32 (T, d), and ``row_scale`` (T, k) float32;
    ``gemm="dx_rows"`` / ``"down_rows"``: as dx / down, but out (sort rows, d) in the operands' dtype, each sorted row
    stored to its own row (the rows combine)."""
    g = GEMMS[gemm]
    name = f"{gemm}_sm90"
    if not isinstance(sort, ExpertSort):
        return f"{name}: sort must be a dispatch.ExpertSort, got {type(sort).__name__}"
    if block_m != BLOCK_M or sort.block_m != BLOCK_M:
        return (f"{name}: the kernel runs {BLOCK_M}-row tiles; got block_m={block_m}, "
                f"sort.block_m={sort.block_m}")
    out_shape = {SCATTER_ADD.value: f"(T, {g.n})", ROW_STORE.value: f"(rows, {g.n})",
                 SWIGLU_BWD.value: f"(rows, 2{g.n})", DOWN.value: f"(T, {g.n})",
                 DOWN_ROWS.value: f"(rows, {g.n})"}[g.epilogue]
    w_shape = f"(E, {g.n}, {g.k})" if b_k_major(g.epilogue) else f"(E, {g.k}, {g.n})"
    if w.dim() != 3 or a.dim() != 2 or out.dim() != 2:
        return (f"{name}: expected {g.w} {w_shape}, {g.a} (rows, {g.k}), {g.out} {out_shape}; got "
                f"{g.w} {tuple(w.shape)}, {g.a} {tuple(a.shape)}, {g.out} {tuple(out.shape)}")
    if w.dtype not in GL_DTYPES or a.dtype != w.dtype:
        return (f"{name}: {g.a} and {g.w} must share a 16-bit float dtype (bfloat16 or float16), got "
                f"{a.dtype} and {w.dtype}")
    if g.epilogue == SWIGLU_BWD.value and out.dtype != w.dtype:
        return f"{name}: {g.out} must be in {g.w}'s dtype {w.dtype} (dw1's operand), got {out.dtype}"
    if gemm in _ROWS_IN_OPERAND_DTYPE and out.dtype != w.dtype:
        return f"{name}: {g.out} must be in {g.w}'s dtype {w.dtype} (the rows combine's buffer), got {out.dtype}"
    if g.epilogue != SWIGLU_BWD.value and gemm not in _ROWS_IN_OPERAND_DTYPE and out.dtype != torch.float32:
        why = "the accumulator, stored as it is" if g.epilogue == ROW_STORE.value else "the atomics add float32"
        return f"{name}: {g.out} must be float32 ({why}), got {out.dtype}"
    num_experts, K, N = _gemm_dims(w, g.epilogue)
    num_rows = sort.tile_expert.numel() * BLOCK_M
    if a.shape != (num_rows, K):
        return f"{name}: {g.a} must be (sort rows, {g.k}) = ({num_rows}, {K}), got {tuple(a.shape)}"
    adds_to_tokens = g.epilogue in (SCATTER_ADD.value, DOWN.value)
    if adds_to_tokens and (out.shape[1] != N or out.shape[0] * sort.top_k != sort.num_pairs):
        return (f"{name}: {g.out} must be (T, {g.n}) = ({sort.num_pairs // max(sort.top_k, 1)}, {N}), "
                f"got {tuple(out.shape)}")
    out_cols = 2 * N if g.epilogue == SWIGLU_BWD.value else N
    if not adds_to_tokens and out.shape != (num_rows, out_cols):
        return (f"{name}: {g.out} must be {out_shape.replace('rows', 'sort rows')} = ({num_rows}, {out_cols}), "
                f"got {tuple(out.shape)}")
    if sort.expert_counts.numel() != num_experts:
        return f"{name}: the sort has {sort.expert_counts.numel()} experts, {g.w} {num_experts}"
    if K % config.block_k:
        # dx/dh view w as (E*K, N): a K box must not straddle two experts (and the K loop takes whole boxes)
        return (f"{name}: {g.k} = {K} must be a multiple of block_k = {config.block_k} (a K tile of "
                f"{g.w} viewed as (E*{g.k}, {g.n}) would cross an expert boundary); use triton_gemm.{g.triton}")
    if not (w.is_contiguous() and a.is_contiguous()):
        return f"{name}: {g.a} and {g.w} must be contiguous (TMA descriptors over their rows)"
    if out.stride(1) != 1:
        return f"{name}: {g.out} needs a unit last stride, got strides {out.stride()}"
    if (N * w.element_size()) % 16 or (K * a.element_size()) % 16:
        return (f"{name}: TMA needs 16-byte aligned rows: {g.n} = {N} and {g.k} = {K} must be "
                f"multiples of 8")
    if a.data_ptr() % 16 or w.data_ptr() % 16:
        return f"{name}: TMA needs 16-byte aligned base addresses of {g.a} and {g.w}"
    try:
        check_config(config, w.element_size(), gemm=gemm)
    except ValueError as error:
        return str(error)
    if g.epilogue == SWIGLU_BWD.value:
        return swiglu_reason(swiglu, w, out, sort, num_rows, config)
    if g.epilogue in (DOWN.value, DOWN_ROWS.value) and (not isinstance(row_scale, torch.Tensor)
                                                          or row_scale.dtype != torch.float32
                                     or not row_scale.is_contiguous() or row_scale.numel() != sort.num_pairs):
        return (f"{name}: row_scale must be the routing weights, float32 and contiguous, one per (token, slot) pair "
                f"({sort.num_pairs}), got {type(row_scale).__name__} "
                f"{getattr(row_scale, 'dtype', '')} {tuple(getattr(row_scale, 'shape', ()))}")
    return None


def launch_args(a, w, out, sort: ExpertSort, block_m: int, config: DxConfig = DxConfig(),
                num_ctas: int | None = None, gemm: str = "dx", swiglu: SwigluOperands | None = None,
                row_scale: torch.Tensor | None = None):
    """(grid, positional args, constexprs) of one launch (``unsupported_reason``'s arguments), after the argument
    checks (ValueError); no device check, so that offline builds can pass meta tensors."""
    reason = unsupported_reason(a, w, out, sort, block_m, config, gemm, swiglu, row_scale)
    if reason is not None:
        raise ValueError(reason)
    epilogue = GEMMS[gemm].epilogue
    num_experts, K, N = _gemm_dims(w, epilogue)
    num_tiles_max = sort.tile_expert.numel()
    max_work = num_tiles_max * triton.cdiv(N, config.block_n)
    if config.split_tail:  # the parts of a last wave smaller than the grid fill the grid
        max_work *= K // config.block_k
    if num_ctas is None:
        num_ctas = sm_count(out.device)
    grid = (max(1, min(num_ctas, max_work)),)
    epilogue_tensors = (tuple(swiglu) if epilogue == SWIGLU_BWD.value
                        else (row_scale,) if epilogue in (DOWN.value, DOWN_ROWS.value) else ())
    head = kernel_head(gemm, config, a, w, out, sort.sorted_pair_ids, sort.tile_expert, sort.expert_counts,
                       sort.expert_row_start, *epilogue_tensors)
    args = (*head, num_experts, num_tiles_max, sort.num_pairs, sort.top_k, K, N, out.stride(0))
    rows = BLOCK_M if config.pingpong else BLOCK_M // NUM_CONSUMERS
    constexprs = dict(GROUP_M=config.group_m, NUM_STAGES=config.num_stages, PINGPONG=config.pingpong, ROWS=rows,
                      EPILOGUE=epilogue, SPLIT_TAIL=config.split_tail)
    return grid, args, constexprs


def kernel_head(gemm: str, config: DxConfig, a, w, out, sorted_pair_ids, tile_expert, expert_counts,
                expert_row_start, *epilogue_tensors):
    """The kernel's leading arguments over these (checked) tensors: the TMA descriptors and the pointers, in the
    kernel's order; ``epilogue_tensors``: SwigluOperands' four (dh_swiglu), the routing weights (down), or none.
    What a PreparedLaunch rebuilds per call (``prepare``)."""
    epilogue = GEMMS[gemm].epilogue
    a_desc = sm90.descriptor(a, [BLOCK_M, config.block_k])
    num_experts, K, N = _gemm_dims(w, epilogue)
    if b_k_major(epilogue):
        b_desc = sm90.descriptor(w.view(num_experts * N, K), [config.block_n, config.block_k])
    else:
        b_desc = sm90.descriptor(w.view(num_experts * K, N), [config.block_k, config.block_n])
    if epilogue == SWIGLU_BWD.value:
        gate_up, h, row_scale, dscale = epilogue_tensors
        box = [BLOCK_M, config.swiglu_cols]
        epilogue_descs = (sm90.descriptor(gate_up, box), sm90.descriptor(h, box), sm90.descriptor(out, box))
        scales = (row_scale, dscale)
    elif epilogue in (DOWN.value, DOWN_ROWS.value):  # unused descriptors; the routing weights, an unused pointer
        epilogue_descs, scales = (a_desc,) * 3, (epilogue_tensors[0], out)
    else:  # unused descriptors and pointers
        epilogue_descs, scales = (a_desc,) * 3, (out, out)
    return (a_desc, b_desc, *epilogue_descs, out, sorted_pair_ids, tile_expert, expert_counts, expert_row_start,
            *scales)


def _launch(gemm, a, w, out, sort: ExpertSort, block_m: int, config: DxConfig, num_ctas: int | None,
            swiglu: SwigluOperands | None = None, row_scale: torch.Tensor | None = None):
    tensors = (a, w, out, sort.sorted_pair_ids, sort.tile_expert, sort.expert_counts, sort.expert_row_start,
               *(swiglu if isinstance(swiglu, SwigluOperands) else ()),
               *((row_scale,) if isinstance(row_scale, torch.Tensor) else ()))
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        raise ValueError(f"{gemm}_sm90: needs CUDA tensors (a Hopper GPU)")
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{gemm}_sm90: all tensors must be on one device")
    grid, args, constexprs = launch_args(a, w, out, sort, block_m, config, num_ctas, gemm, swiglu, row_scale)
    return sorted_rows_sm90_kernel[grid](*args, **constexprs, **LAUNCH_OPTIONS)


def dx_sm90(dgu, w1, dx32, sort: ExpertSort, block_m: int, config: DxConfig = DxConfig(),
            num_ctas: int | None = None, store_rows: bool = False):
    """``dx32[token] += dgu[row] @ w1[expert(row)]`` for every valid sorted row (``triton_gemm.dx_launch``'s product).

    dgu: (sort rows, 2F) bf16/fp16 contiguous, the sorted rows' d(gate, up) (padding rows may hold anything);
    w1: (E, 2F, d) contiguous, same dtype; dx32: (T, d) float32 with unit last stride, accumulated into (zero it
    first); sort: the forward's ExpertSort with block_m = 128. ``num_ctas``: persistent CTAs (default: one per SM).
    ``store_rows`` (the rows combine): dx32 is instead a (sort rows, d) buffer in dgu's dtype, and each valid row's
    product is stored to its own row (padding rows left as they were; config.split_tail must be off). Raises
    ValueError on arguments the kernel cannot take (then use triton_gemm.dx_launch). Returns the compiled kernel
    (registers, spills, SASS for diagnostics)."""
    return _launch("dx_rows" if store_rows else "dx", dgu, w1, dx32, sort, block_m, config, num_ctas)


def dh_sm90(dout_sorted, w2, dh, sort: ExpertSort, block_m: int, config: DxConfig = DH_CONFIG,
            num_ctas: int | None = None):
    """``dh[row] = dout_sorted[row] @ w2[expert(row)]`` for every valid sorted row (``triton_gemm.dh_launch``'s
    product, with dout already gathered to the sorted rows: ``gemms.sorted_rows(dout, None, ...)``).

    dout_sorted: (sort rows, d) bf16/fp16 contiguous (padding rows may hold anything); w2: (E, d, F) contiguous,
    same dtype, d a multiple of config.block_k; dh: (sort rows, F) float32 with unit last stride: the valid rows
    are written, the padding rows left as they were. Otherwise as ``dx_sm90`` (ValueError: use dh_launch)."""
    return _launch("dh", dout_sorted, w2, dh, sort, block_m, config, num_ctas)


def dh_swiglu_sm90(dout_sorted, w2, dgu, swiglu: SwigluOperands, sort: ExpertSort, block_m: int,
                   config: DxConfig = DH_SWIGLU_CONFIG, num_ctas: int | None = None):
    """``dh_sm90``'s product with the SwiGLU backward in its epilogue: what ``triton_gemm.dh_launch`` followed by
    ``swiglu_backward_launch`` compute, without dh in memory. With dh = dout_sorted[row] @ w2[expert(row)]:
    ``dgu[row] = d(gate, up)`` of ``row_scale[pair] * dh`` at the forward's saved ``gate_up[row]``, and
    ``dscale[pair] += dh . h[row]`` (float32 atomics, one per row and F column block: zero dscale first; the order
    of the additions is not fixed, so dscale may differ in its last bits from run to run).

    dgu: (sort rows, 2F) in w2's dtype with unit last stride: every row of each used row tile is written (padding
    rows as zeros: dw1's Gluon kernel reads them), rows of unused tiles are left as they were. Other arguments as
    ``dh_sm90`` and ``SwigluOperands`` (ValueError: use dh_launch and swiglu_backward_launch)."""
    return _launch("dh_swiglu", dout_sorted, w2, dgu, sort, block_m, config, num_ctas, swiglu)


def down_sm90(h, w2, out32, row_scale, sort: ExpertSort, block_m: int, config: DxConfig | None = None,
              num_ctas: int | None = None, store_rows: bool = False):
    """The forward's down GEMM: ``out32[token] += row_scale[pair] * h[row] @ w2[expert(row)].T`` for every valid
    sorted row (``triton_gemm.down_forward_launch``'s product).

    h: (sort rows, F) bf16/fp16 contiguous (padding rows may hold anything); w2: (E, d, F) contiguous, same dtype,
    F a multiple of config.block_k; out32: (T, d) float32 with unit last stride, accumulated into (zero it first);
    row_scale: (T, k) float32 contiguous, the routing weights. ``config``: default ``down_config(F)``.
    ``store_rows``: out32 is a (sort rows, d) buffer in h's dtype, each weighted row stored to its own row (the rows
    combine). Otherwise as ``dx_sm90`` (ValueError: use down_forward_launch)."""
    config = config or down_config(w2.shape[2])
    return _launch("down_rows" if store_rows else "down", h, w2, out32, sort, block_m, config, num_ctas,
                   row_scale=row_scale)


def prepare_down(h, w2, out32, row_scale, sort: ExpertSort, config: DxConfig | None = None,
                 num_ctas: int | None = None, store_rows: bool = False) -> PreparedLaunch:
    """``down_sm90`` for this call signature as a PreparedLaunch (run it once first, so that it is compiled), called
    with a new call's h, w2, out32, row_scale and the sort's DOWN_SORT_TENSORS. The grid and every
    scalar follow from the shapes (T, k, E, d, F) and the sort's sizes: the caller keys its cache on them."""
    config = config or down_config(w2.shape[2])
    gemm = "down_rows" if store_rows else "down"
    grid, args, constexprs = launch_args(h, w2, out32, sort, BLOCK_M, config, num_ctas, gemm, row_scale=row_scale)
    bound = dict(zip(sorted_rows_sm90_kernel.arg_names, args), **constexprs)

    def make_head(h, w2, out32, row_scale, sorted_pair_ids, tile_expert, expert_counts, expert_row_start):
        return kernel_head(gemm, config, h, w2, out32, sorted_pair_ids, tile_expert, expert_counts,
                           expert_row_start, row_scale)

    tensors = (h, w2, out32, row_scale, *(getattr(sort, name) for name in DOWN_SORT_TENSORS))
    return PreparedLaunch(sorted_rows_sm90_kernel, grid, bound, LAUNCH_OPTIONS, make_head, tensors)


# the sort's tensors a prepared down launch takes after h, w2, out32 and row_scale
DOWN_SORT_TENSORS = ("sorted_pair_ids", "tile_expert", "expert_counts", "expert_row_start")


def compile_offline(a, w, out, sort: ExpertSort, config: DxConfig = DxConfig(), num_ctas: int = 132,
                    gemm: str = "dx", swiglu: SwigluOperands | None = None, row_scale: torch.Tensor | None = None):
    """``triton.compile`` of this launch for sm_90 without a GPU (meta tensors are enough), specialised as the JIT
    would specialise it (16-byte aligned pointers, integers divisible by 16); returns the CompiledKernel."""
    _, args, constexprs = launch_args(a, w, out, sort, BLOCK_M, config, num_ctas, gemm, swiglu, row_scale)
    return sm90.compile_offline(sorted_rows_sm90_kernel, args, constexprs)
