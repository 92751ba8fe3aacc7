"""The MoE backward's dx GEMM for Hopper (sm_90) in Gluon: ``dx32[token] += d(gate, up)[row] @ w1[e]``.

The same product as ``triton_gemm.dx_launch`` (``_down_combine_kernel`` with K = 2F, N = d, no row scale) over the
expert-sorted rows of ``dispatch.ExpertSort``: row tile t (BLOCK_M = 128 sorted rows, one expert) times the
expert's weight block ``w1[e, k0:k0+BLOCK_K, n0:n0+BLOCK_N]``, every valid row's float32 result added atomically
into ``dx32[token]`` (the top_k rows of a token meet there; padding rows are dropped). What changes is the schedule:
Triton's kernel loads both operands with cp.async and waits for each wgmma before the next instruction that could
touch its registers, so its warps alternate between issuing loads and tensor-core work. Here the roles are split
into warp-specialised partitions that only meet at mbarriers:

- **Producer** (one warp, 24 registers after setmaxnreg): walks the CTA's work items in the consumers' order and,
  for each K step, waits until ring stage ``s`` is released ("empty"), then issues two TMA copies into it: the A
  tile ``dgu[tile*128 : +128, k0 : +BLOCK_K]`` (dense in sorted order, no gather needed) and the B tile
  ``w1.view(E*2F, d)[e*2F + k0 : +BLOCK_K, n0 : +BLOCK_N]``, both completing on the stage's "ready" barrier
  (expect-tx of both boxes' bytes). It only computes coordinates, so it runs ahead of the consumers by the whole
  ring (NUM_STAGES stages), across work items too: the next item's first tiles land during the current epilogue.
  A K box never straddles two experts because the wrapper requires 2F % BLOCK_K == 0.
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
  atomics (``REDG.E.ADD.F32x2``: each thread holds adjacent column pairs). No shared-memory staging (Triton's
  kernel converts to 4-wide vectors through the idle ring): here the ring is busy with the next item's loads, and
  a 128x256 fp32 tile (128 KiB) would not fit beside it. In cooperative mode the tensor cores idle during the
  epilogue (negligible at Mixtral's K = 28672, a few percent at Qwen3's K = 1536: what ping-pong is for).

Offline sm_90 builds (triton 3.6, scripts/ab_moe_dx_sm90.py --offline): no spills in any config; the consumers
use at most 175 registers (cooperative 128x256), 96 (cooperative 128x128), 183 (ping-pong 128x128) of their 240;
shared memory 147680 / 196840 bytes at 128x256 with 3 / 4 stages, 98528 + 32768 per stage at 128x128.

Persistent: ``num_ctas`` = the SM count (at most the number of work items); CTA c takes work items c, c + num_ctas,
... Work items are (row tile, column block) pairs numbered in ``triton_gemm._row_tile_and_col_block``'s GROUP_M
order (mirrored in ``common.grouped_block``; Gluon cannot call a @triton.jit helper), so the ~132 items
in flight at any moment cover a few row tiles (mostly one expert) across the column blocks, and the expert's
weight blocks are read from L2 by all but the first of them. The number of row tiles is the number *used* (read
on the device from the sort's last expert: its first row plus its count, rounded up to tiles), not the sort's
worst case ``tile_expert.numel()``, so no CTA draws an empty item while another has two left; this changes the
order of the last, partial group only. Tiles with tile_expert < 0 are skipped all the same (by every partition
alike, so the ring positions stay in step).

The producer step, the consumers' main loop, the barriers' set-up, descriptors and offline builds live in
``common`` (shared with wgrad_sm90); the SASS is as before that move (the 128x128 configs' bit for bit).

Numerics: bf16 (or fp16) operands, float32 accumulation in the wgmma, float32 atomics into dx32: the same as the
Triton kernel up to the order of the K-sum inside the tensor core and the order of the top_k atomic additions
(not fixed: results may differ in the last bits from run to run, as with the Triton kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait

from flashmoe_science.moe.dispatch import ExpertSort
from flashmoe_science.moe.hopper import common
from flashmoe_science.moe.hopper.common import (BARRIER_BYTES, CONSUMER_REGISTERS, GL_DTYPES, LAUNCH_OPTIONS,
                                                NUM_CONSUMERS, PRODUCER_REGISTERS, check_tile_config, grouped_block,
                                                init_barriers, load_stage, mma_steps)
from flashmoe_science.moe.tiles import HOPPER_SMEM_PER_BLOCK, sm_count

BLOCK_M = 128  # rows per work item: the sort's row tile (one expert per tile)



@dataclass(frozen=True)
class DxConfig:
    """The kernel's tile config (constexprs). BLOCK_M is fixed at 128 (the sort's row tile)."""

    block_n: int = 256
    block_k: int = 64
    num_stages: int = 4
    pingpong: bool = False  # consumers alternate work items (block_n 128 only); else both share each item
    group_m: int = 8  # row tiles that sweep the column blocks together (MoETiles.group_m)

    def label(self) -> str:
        mode = "pingpong" if self.pingpong else "coop"
        return f"{BLOCK_M}x{self.block_n}x{self.block_k} s{self.num_stages} {mode} g{self.group_m}"


# H200, scripts/ab_moe_dx_sm90.py (session 9, T=4096, TFLOP/s; Triton dx_launch / torch grouped_mm without the
# combine): ping-pong 128x128, 4 stages: Mixtral 644 (607 / 677), Qwen3 432 (399 / 426), the best at Mixtral and
# within 5% of Qwen3's best (5 stages, 454, but 591 at Mixtral). Cooperative 128x256: 609-598 / 407-418.
MEASURED_CONFIG = DxConfig(block_n=128, num_stages=4, pingpong=True)


def smem_bytes(config: DxConfig, itemsize: int = 2) -> int:
    """Shared memory of the operand ring (A 128 x block_k and B block_k x block_n per stage) plus barriers."""
    return config.num_stages * (BLOCK_M + config.block_n) * config.block_k * itemsize + BARRIER_BYTES


def check_config(config: DxConfig, itemsize: int = 2, smem_limit: int = HOPPER_SMEM_PER_BLOCK) -> None:
    """ValueError unless the kernel can run ``config``."""
    check_tile_config("dx_sm90", config, smem_bytes(config, itemsize), smem_limit)


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
def _producer(a_desc, b_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, expert_counts_ptr, expert_row_start_ptr,
              num_experts, num_tiles_max, K, N, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """One warp: every K step of every work item of this CTA, A and B tiles by TMA into the next ring stage once
    the consumers have released it."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    num_row_tiles, num_work = _num_work(expert_counts_ptr, expert_row_start_ptr, num_experts, num_tiles_max, N,
                                        BM, BN)
    num_col_blocks = gl.cdiv(N, BN)
    k_steps = K // BK
    ring = 0  # K steps issued so far by this CTA (ring position)
    for work in range(gl.program_id(0), num_work, gl.num_programs(0)):
        tile, col_block = grouped_block(work, num_row_tiles, num_col_blocks, GROUP_M)
        expert = gl.load(tile_expert_ptr + tile)
        if expert >= 0:
            b_row = expert * K
            for ks in range(k_steps):
                load_stage(a_desc, tile * BM, ks * BK, b_desc, b_row + ks * BK, col_block * BN, a_smem, b_smem,
                           ready, empty, ring, NUM_STAGES)
                ring += 1


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, turn, dx_ptr, sorted_pair_ids_ptr, tile_expert_ptr, expert_counts_ptr,
              expert_row_start_ptr, num_experts, num_tiles_max, num_pairs, top_k, K, N, stride_dx,
              CONSUMER: gl.constexpr, PINGPONG: gl.constexpr, ROWS: gl.constexpr, GROUP_M: gl.constexpr,
              NUM_STAGES: gl.constexpr):
    """One consumer warpgroup: its rows of every work item (cooperative), or every other work item (ping-pong)."""
    BM: gl.constexpr = a_smem.type.shape[1]
    BK: gl.constexpr = a_smem.type.shape[2]
    BN: gl.constexpr = b_smem.type.shape[2]
    ROW0: gl.constexpr = 0 if PINGPONG else CONSUMER * ROWS
    # wgmma accumulator: the 4 warps stacked along the rows (16 rows each, repeated for 128 rows); N = BN
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)

    num_row_tiles, num_work = _num_work(expert_counts_ptr, expert_row_start_ptr, num_experts, num_tiles_max, N,
                                        BM, BN)
    num_col_blocks = gl.cdiv(N, BN)
    k_steps = K // BK
    ring = 0  # ring position of the current item's first K step
    item = 0  # the CTA's work items so far
    for work in range(gl.program_id(0), num_work, gl.num_programs(0)):
        tile, col_block = grouped_block(work, num_row_tiles, num_col_blocks, GROUP_M)
        expert = gl.load(tile_expert_ptr + tile)
        item_steps = gl.where(expert >= 0, k_steps, 0)
        if PINGPONG:
            mine = item % 2 == CONSUMER
        else:
            mine = True
        if mine:
            # the rows' pair ids, loaded ahead of the K loop so the epilogue does not wait for them
            rows = tile * BM + ROW0 + gl.arange(0, ROWS, layout=row_layout)
            pairs = gl.load(sorted_pair_ids_ptr + rows)
            if PINGPONG:
                # wait until the other consumer has issued its wgmmas of the previous item (its epilogue then
                # overlaps ours), which also means every ring stage this item reads has completed its previous phase
                mbarrier.wait(turn.index(CONSUMER), ((item - 1) // 2) & 1, pred=item > 0)
            acc = gl.zeros([ROWS, BN], gl.float32, layout=acc_layout)
            acc, end = mma_steps(a_smem, b_smem, ready, empty, ring, item_steps, acc, ROW0, ROWS, NUM_STAGES,
                                 False)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if item_steps > 0:
                mbarrier.arrive(empty.index((end + NUM_STAGES - 1) % NUM_STAGES), count=1)
                valid = pairs < num_pairs  # padding rows hold num_pairs
                tokens = gl.where(valid, pairs // top_k, 0).to(gl.int64)
                cols = col_block * BN + gl.arange(0, BN, layout=col_layout)
                ptrs = dx_ptr + gl.expand_dims(tokens * stride_dx, 1) + gl.expand_dims(cols, 0)
                mask = gl.expand_dims(valid, 1) & gl.expand_dims(cols < N, 0)
                gl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
        ring += item_steps
        item += 1


@gluon.jit
def dx_sm90_kernel(a_desc, b_desc, dx_ptr, sorted_pair_ids_ptr, tile_expert_ptr, expert_counts_ptr,
                   expert_row_start_ptr, num_experts, num_tiles_max, num_pairs, top_k, K, N, stride_dx,
                   GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr, ROWS: gl.constexpr):
    """Persistent: each CTA runs work items program_id, program_id + num_programs, ... (see the module docstring)."""
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready, empty, turn = init_barriers(NUM_STAGES, PINGPONG)

    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, ready, empty, turn, dx_ptr, sorted_pair_ids_ptr, tile_expert_ptr,
                     expert_counts_ptr, expert_row_start_ptr, num_experts, num_tiles_max, num_pairs, top_k, K, N,
                     stride_dx, 0, PINGPONG, ROWS, GROUP_M, NUM_STAGES)),
        (_consumer, (a_smem, b_smem, ready, empty, turn, dx_ptr, sorted_pair_ids_ptr, tile_expert_ptr,
                     expert_counts_ptr, expert_row_start_ptr, num_experts, num_tiles_max, num_pairs, top_k, K, N,
                     stride_dx, 1, PINGPONG, ROWS, GROUP_M, NUM_STAGES)),
        (_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, tile_expert_ptr, expert_counts_ptr,
                     expert_row_start_ptr, num_experts, num_tiles_max, K, N, GROUP_M, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


# ----------------------------------------------------------------------------------------------------- the wrapper
def unsupported_reason(dgu, w1, dx32, sort: ExpertSort, block_m: int, config: DxConfig) -> str | None:
    """Why the kernel cannot take these arguments, or None where it can."""
    if not isinstance(sort, ExpertSort):
        return f"dx_sm90: sort must be a dispatch.ExpertSort, got {type(sort).__name__}"
    if block_m != BLOCK_M or sort.block_m != BLOCK_M:
        return (f"dx_sm90: the kernel runs {BLOCK_M}-row tiles; got block_m={block_m}, "
                f"sort.block_m={sort.block_m}")
    if w1.dim() != 3 or dgu.dim() != 2 or dx32.dim() != 2:
        return (f"dx_sm90: expected w1 (E, 2F, d), dgu (rows, 2F), dx32 (T, d); got w1 {tuple(w1.shape)}, "
                f"dgu {tuple(dgu.shape)}, dx32 {tuple(dx32.shape)}")
    if w1.dtype not in GL_DTYPES or dgu.dtype != w1.dtype:
        return (f"dx_sm90: dgu and w1 must share a 16-bit float dtype (bfloat16 or float16), got "
                f"{dgu.dtype} and {w1.dtype}")
    if dx32.dtype != torch.float32:
        return f"dx_sm90: dx32 must be float32 (the atomics add float32), got {dx32.dtype}"
    num_experts, two_d_ff, d_model = w1.shape
    num_rows = sort.tile_expert.numel() * BLOCK_M
    if dgu.shape != (num_rows, two_d_ff):
        return f"dx_sm90: dgu must be (sort rows, 2F) = ({num_rows}, {two_d_ff}), got {tuple(dgu.shape)}"
    if dx32.shape[1] != d_model or dx32.shape[0] * sort.top_k != sort.num_pairs:
        return (f"dx_sm90: dx32 must be (T, d) = ({sort.num_pairs // max(sort.top_k, 1)}, {d_model}), "
                f"got {tuple(dx32.shape)}")
    if sort.expert_counts.numel() != num_experts:
        return f"dx_sm90: the sort has {sort.expert_counts.numel()} experts, w1 {num_experts}"
    if two_d_ff % config.block_k:
        # the B descriptor views w1 as (E*2F, d): a K box must not straddle two experts
        return (f"dx_sm90: 2F = {two_d_ff} must be a multiple of block_k = {config.block_k} (a K tile of "
                f"w1 viewed as (E*2F, d) would cross an expert boundary); use triton_gemm.dx_launch")
    if not (w1.is_contiguous() and dgu.is_contiguous()):
        return "dx_sm90: dgu and w1 must be contiguous (TMA descriptors over their rows)"
    if dx32.stride(1) != 1:
        return f"dx_sm90: dx32 needs a unit last stride, got strides {dx32.stride()}"
    if (d_model * w1.element_size()) % 16 or (two_d_ff * dgu.element_size()) % 16:
        return (f"dx_sm90: TMA needs 16-byte aligned rows: d = {d_model} and 2F = {two_d_ff} must be "
                f"multiples of 8")
    if dgu.data_ptr() % 16 or w1.data_ptr() % 16:
        return "dx_sm90: TMA needs 16-byte aligned base addresses of dgu and w1"
    try:
        check_config(config, w1.element_size())
    except ValueError as error:
        return str(error)
    return None


def _check_args(dgu, w1, dx32, sort: ExpertSort, block_m: int, config: DxConfig) -> None:
    reason = unsupported_reason(dgu, w1, dx32, sort, block_m, config)
    if reason is not None:
        raise ValueError(reason)


def launch_args(dgu, w1, dx32, sort: ExpertSort, block_m: int, config: DxConfig = DxConfig(),
                num_ctas: int | None = None):
    """(grid, positional args, constexprs) of one launch, after the argument checks (ValueError); no device check,
    so that offline builds can pass meta tensors."""
    _check_args(dgu, w1, dx32, sort, block_m, config)
    num_experts, two_d_ff, d_model = w1.shape
    num_tiles_max = sort.tile_expert.numel()
    max_work = num_tiles_max * triton.cdiv(d_model, config.block_n)
    if num_ctas is None:
        num_ctas = sm_count(dx32.device)
    grid = (max(1, min(num_ctas, max_work)),)
    a_desc = common.descriptor(dgu, [BLOCK_M, config.block_k])
    b_desc = common.descriptor(w1.view(num_experts * two_d_ff, d_model), [config.block_k, config.block_n])
    args = (a_desc, b_desc, dx32, sort.sorted_pair_ids, sort.tile_expert, sort.expert_counts, sort.expert_row_start,
            num_experts, num_tiles_max, sort.num_pairs, sort.top_k, two_d_ff, d_model, dx32.stride(0))
    rows = BLOCK_M if config.pingpong else BLOCK_M // NUM_CONSUMERS
    constexprs = dict(GROUP_M=config.group_m, NUM_STAGES=config.num_stages, PINGPONG=config.pingpong, ROWS=rows)
    return grid, args, constexprs


def dx_sm90(dgu, w1, dx32, sort: ExpertSort, block_m: int, config: DxConfig = DxConfig(),
            num_ctas: int | None = None):
    """``dx32[token] += dgu[row] @ w1[expert(row)]`` for every valid sorted row (``triton_gemm.dx_launch``'s product).

    dgu: (sort rows, 2F) bf16/fp16 contiguous, the sorted rows' d(gate, up) (padding rows may hold anything);
    w1: (E, 2F, d) contiguous, same dtype; dx32: (T, d) float32 with unit last stride, accumulated into (zero it
    first); sort: the forward's ExpertSort with block_m = 128. ``num_ctas``: persistent CTAs (default: one per SM).
    Raises ValueError on arguments the kernel cannot take (then use triton_gemm.dx_launch). Returns the compiled
    kernel (registers, spills, SASS for diagnostics)."""
    tensors = (dgu, w1, dx32, sort.sorted_pair_ids, sort.tile_expert, sort.expert_counts, sort.expert_row_start)
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        raise ValueError("dx_sm90: needs CUDA tensors (a Hopper GPU)")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("dx_sm90: all tensors must be on one device")
    grid, args, constexprs = launch_args(dgu, w1, dx32, sort, block_m, config, num_ctas)
    return dx_sm90_kernel[grid](*args, **constexprs, **LAUNCH_OPTIONS)


def compile_offline(dgu, w1, dx32, sort: ExpertSort, config: DxConfig = DxConfig(), num_ctas: int = 132):
    """``triton.compile`` of this launch for sm_90 without a GPU (meta tensors are enough), specialised as the JIT
    would specialise it (16-byte aligned pointers, integers divisible by 16); returns the CompiledKernel."""
    _, args, constexprs = launch_args(dgu, w1, dx32, sort, BLOCK_M, config, num_ctas)
    return common.compile_offline(dx_sm90_kernel, args, constexprs)
