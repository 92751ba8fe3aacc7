"""The MoE backward's weight-gradient GEMMs for Hopper (sm_90) in Gluon: ``out[e] = A_e^T B_e``.

The same product as ``triton_gemm.wgrad_launch`` (``_expert_wgrad_kernel`` / ``_expert_wgrad_persistent_kernel``):
a reduction over expert e's sorted rows ``[expert_row_start[e], expert_row_start[e] + expert_counts[e])`` of
``dispatch.ExpertSort``, with A (sort rows, M) and B (sort rows, N) dense in sorted-row order and out (E, M, N).
dw1: A = d(gate, up) (rows, 2F), B = x_sorted (rows, d); dw2: A = weight * dout sorted (rows, d), B = h (rows, F).
The schedule is dx_sm90's (read its docstring; the shared pieces are in ``common``):

- **Work items** are (expert, output row block of BLOCK_M = 128, output column block of BLOCK_N), numbered
  expert-major and, within an expert, in the GROUP_M order of ``common.grouped_block`` (GROUP_M row blocks sweep
  the column blocks together: the ~132 items in flight share a few blocks of A_e and all of B_e's, from L2).
  Persistent: CTA c takes items c, c + num_ctas, ... Item (e, i, j) has ceil(count_e / BLOCK_K) K steps, read from
  the counts on the device by every partition alike (so their ring positions stay in step); an expert without
  rows has none, and its items store zeros.
- **Producer** (one warp): per K step, the A box ``A[row0 : row0 + BLOCK_K, i*128 : +128]`` and the B box
  ``B[row0 : row0 + BLOCK_K, j*BLOCK_N : +BLOCK_N]`` by TMA into the next ring stage (``common.load_stage``).
- **Consumers** (two warpgroups), cooperative (consumer c: output rows [64c, 64c + 64) of the item, a 64 x BLOCK_N
  float32 accumulator) or ping-pong (BLOCK_N = 128: the whole 128 x 128 item, alternating items). The A stage holds
  the (K, M) box, M contiguous; the wgmma reads it transposed straight from shared memory: a permuted view
  ``a_stage.slice(64c, 64, dim=1).permute((1, 0))`` is an MN-major A operand (the transpose bit of the wgmma
  descriptor, legal for 16-bit types), so no register round trip: the SASS has ``HGMMA.64xNx16.F32.BF16 R,
  gdesc[UR].tnspA.tnspB`` (both operands by shared-memory descriptor) and no LDSM. B is (K, N), N contiguous, as
  in dx.
- **Epilogue**: cast to the output dtype, store into the consumer's own shared-memory tile (``[ROWS, BLOCK_N]``,
  beside the ring), fence, one TMA store of the tile into ``out.view(E*M, N)``; the store runs while the
  consumer starts its next item, which waits for it (``tma.store_wait(0)``) only before it rewrites that tile.
  ``epilogue_split`` = 2 stores the tile in two column halves through a half-size tile (the halves are register
  selections of the accumulator: no shuffles in the SASS), which frees the shared memory for a 4th stage at
  128x256 or a 6th in ping-pong; the second half waits for the TMA to have read the first. One writer per output
  element, no atomics: deterministic (the K order inside each tile is fixed). M must be a
  multiple of 128 (a row block never crosses into the next expert's rows of the 2-D view); columns past N are
  clipped by the TMA store, and read as zeros by the TMA loads.

**Padding rows** (``[start + count, ...)`` up to the expert's next multiple of the sort's block_m): a K step of
BLOCK_K rows may cover up to BLOCK_K - 1 of them, and TMA cannot mask rows inside a tensor (it only zero-fills
outside its bounds), so their values reach the wgmma. This kernel requires them to be ZERO in both A and B (a NaN
or Inf there would poison the sum: 0 * NaN = NaN), and the library's producers of these operands write zeros
there (option (a)): ``triton_gemm._gather_rows_kernel`` (x_sorted, g_sorted), ``_swiglu_backward_kernel`` (d(gate,
up)) and ``_up_swiglu_kernel`` (h, when training: save_for_backward) store every row of each used row tile, padding
rows as zeros (rows of unused tiles stay unwritten). Why (a) and not
(b) (zeroing the rows past count in shared memory, per item, in the last K step): (a) writes each padding row once
per operand, (b) once per work item (E x M/128 x N/BLOCK_N times) and puts the zeroing, a generic-to-async proxy
fence and a cross-warpgroup barrier on the consumers' critical path. At Qwen3 T=4096 (~64 padding rows per expert
of ~320) (a) costs ~100 MB of extra writes over the four producers (~25 us, ~1% of the backward); (b) would write
~25 KB of shared memory per work item (~300 MB over dw1's 12288 items) and stall the consumers at each item's last
step. Rows past the expert's last K step (and unused row tiles) are never read: they may hold anything.

Offline sm_90 builds (triton 3.6; the same binaries for dw1 and dw2 and
both models): no spills (no local memory, no LDL/STL) in any config; the highest register the consumers name is
R151 of their 240; shared memory 213200 (128x256 s3), 229592 (128x256 s4, split epilogue), 196856 / 229656
(ping-pong 128x128 s4 / s5), 229656 (ping-pong s6, split epilogue) bytes; 6 TMA loads per K step at 128x256 (the
A box in two 64-column and the B box in four 64-column messages, 128-byte swizzle); the TMA store is likewise
split into 64-column messages, issued by the consumer's warps.

Numerics: bf16 (or fp16) operands, float32 accumulation in the wgmma, rounded once to the output dtype: the same
as the Triton kernel up to the order of the K-sum inside the tensor core. At the heuristic's 128x256x64 Triton tile
both issue the same m64n256k16 wgmmas over the same 64-row steps, so the outputs may well be identical; not
verified on a GPU yet (the A/B reports "identical" and the max difference, expected 0 or an output ulp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from flashmoe_science.gluon import sm90
from flashmoe_science.gluon.sm90 import (BARRIER_BYTES, CONSUMER_REGISTERS, GL_DTYPES, LAUNCH_OPTIONS,
                                            PRODUCER_REGISTERS, column_halves, wgmma_layout)
from flashmoe_science.gluon.compat import fence_async_shared, gl, gluon, mbarrier, tma, warpgroup_mma_wait
from flashmoe_science.moe.dispatch import ExpertSort
from flashmoe_science.moe.hopper.common import (HOPPER_SMEM_PER_BLOCK, NUM_CONSUMERS, check_tile_config,
                                                grouped_block, init_barriers, load_stage, mma_steps)
from flashmoe_science.moe.tiles import sm_count

BLOCK_M = 128  # output rows per work item (M = 2F for dw1, d for dw2)


@dataclass(frozen=True)
class WgradConfig:
    """The kernel's tile config (constexprs). BLOCK_M is fixed at 128 output rows."""

    block_n: int = 256
    block_k: int = 64  # sorted rows per K step
    num_stages: int = 3
    pingpong: bool = False  # consumers alternate work items (block_n 128 only); else both share each item
    group_m: int = 8  # output row blocks that sweep the column blocks together
    epilogue_split: int = 1  # TMA-store the tile in this many column slices through one slice's smem

    def label(self) -> str:
        mode = "pingpong" if self.pingpong else "coop"
        split = f" e{self.epilogue_split}" if self.epilogue_split > 1 else ""
        return f"{BLOCK_M}x{self.block_n}x{self.block_k} s{self.num_stages} {mode}{split} g{self.group_m}"


# H200 (T=4096, TFLOP/s, dw1 / dw2; Triton wgrad_launch / grouped_mm):
# cooperative 128x256, 3 stages: Mixtral 724 / 682 (565 / 599; 582 / 623), Qwen3 505 / 479 (415 / 374; 375 / 357),
# the best at Mixtral and within 6% of Qwen3's best (ping-pong 128x128 s6 split epilogue, 535 / 485)
MEASURED_CONFIG = WgradConfig()


def smem_bytes(config: WgradConfig, itemsize: int = 2) -> int:
    """Shared memory: the operand ring (A block_k x 128 and B block_k x block_n per stage), the two consumers'
    epilogue tiles (128 x block_n in all, cooperative; 2 x 128 x 128 ping-pong; each split by epilogue_split) and
    the barriers."""
    ring = config.num_stages * (BLOCK_M + config.block_n) * config.block_k * itemsize
    epilogue = NUM_CONSUMERS * _rows(config) * config.block_n // config.epilogue_split * itemsize
    return ring + epilogue + BARRIER_BYTES


def _rows(config: WgradConfig) -> int:
    """Output rows per consumer and item."""
    return BLOCK_M if config.pingpong else BLOCK_M // NUM_CONSUMERS


def check_config(config: WgradConfig, itemsize: int = 2, smem_limit: int = HOPPER_SMEM_PER_BLOCK) -> None:
    """ValueError unless the kernel can run ``config``."""
    if config.epilogue_split not in (1, 2):
        raise ValueError(f"wgrad_sm90: epilogue_split must be 1 or 2, got {config.epilogue_split}")
    check_tile_config("wgrad_sm90", config, smem_bytes(config, itemsize), smem_limit)


# ------------------------------------------------------------------------------------------------------ the kernel
@gluon.jit
def _work_item(work, num_row_blocks, num_col_blocks, GROUP_M: gl.constexpr):
    """Work item -> (expert, output row block, output column block): expert-major, GROUP_M order inside."""
    per_expert = num_row_blocks * num_col_blocks
    row_block, col_block = grouped_block(work % per_expert, num_row_blocks, num_col_blocks, GROUP_M)
    return work // per_expert, row_block, col_block


@gluon.jit
def _producer(a_desc, b_desc, a_smem, b_smem, ready, empty, expert_counts_ptr, expert_row_start_ptr, num_experts, M,
              N, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """One warp: every K step of every work item of this CTA, the A and B boxes by TMA into the next ring stage
    once the consumers have released it."""
    BK: gl.constexpr = a_desc.block_type.shape[0]
    BM: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    num_row_blocks = M // BM
    num_col_blocks = gl.cdiv(N, BN)
    num_work = num_experts * num_row_blocks * num_col_blocks
    ring = 0  # K steps issued so far by this CTA (ring position)
    for work in range(gl.program_id(0), num_work, gl.num_programs(0)):
        expert, row_block, col_block = _work_item(work, num_row_blocks, num_col_blocks, GROUP_M)
        first_row = gl.load(expert_row_start_ptr + expert)
        k_steps = gl.cdiv(gl.load(expert_counts_ptr + expert), BK)
        for ks in range(k_steps):
            row = first_row + ks * BK
            load_stage(a_desc, row, row_block * BM, b_desc, row, col_block * BN, a_smem, b_smem, ready, empty, ring,
                       NUM_STAGES)
            ring += 1


@gluon.jit
def _consumer(a_smem, b_smem, c_smem, ready, empty, turn, out_desc, expert_counts_ptr, expert_row_start_ptr,
              num_experts, M, N, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr, ROWS: gl.constexpr,
              GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, EPI_SPLIT: gl.constexpr):
    """One consumer warpgroup: its rows of every work item (cooperative), or every other work item (ping-pong),
    each stored through its own shared-memory tile by TMA."""
    BK: gl.constexpr = a_smem.type.shape[1]
    BM: gl.constexpr = a_smem.type.shape[2]
    BN: gl.constexpr = b_smem.type.shape[2]
    ROW0: gl.constexpr = 0 if PINGPONG else CONSUMER * ROWS
    acc_layout: gl.constexpr = wgmma_layout(BN)
    c_tile = c_smem.index(CONSUMER)

    num_row_blocks = M // BM
    num_col_blocks = gl.cdiv(N, BN)
    num_work = num_experts * num_row_blocks * num_col_blocks
    ring = 0  # ring position of the current item's first K step
    item = 0  # the CTA's work items so far
    for work in range(gl.program_id(0), num_work, gl.num_programs(0)):
        expert, row_block, col_block = _work_item(work, num_row_blocks, num_col_blocks, GROUP_M)
        item_steps = gl.cdiv(gl.load(expert_counts_ptr + expert), BK)
        if PINGPONG:
            mine = item % 2 == CONSUMER
        else:
            mine = True
        if mine:
            if PINGPONG:
                # wait until the other consumer has issued its wgmmas of the previous item (its epilogue then
                # overlaps ours), which also means every ring stage this item reads has completed its previous phase
                mbarrier.wait(turn.index(CONSUMER), ((item - 1) // 2) & 1, pred=item > 0)
            acc = gl.zeros([ROWS, BN], gl.float32, layout=acc_layout)
            acc, end = mma_steps(a_smem, b_smem, ready, empty, ring, item_steps, acc, ROW0, ROWS, NUM_STAGES, True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if item_steps > 0:
                mbarrier.arrive(empty.index((end + NUM_STAGES - 1) % NUM_STAGES), count=1)
            out = acc.to(out_desc.dtype)
            out_row = expert * M + row_block * BM + ROW0
            if EPI_SPLIT == 1:
                tma.store_wait(0)  # this consumer's previous TMA store has read its tile
                c_tile.store(out)
                fence_async_shared()  # the tile's generic-proxy writes before the TMA (async proxy) reads it
                tma.async_store(out_desc, [out_row, col_block * BN], c_tile)
            else:
                halves = column_halves(out)
                for h in gl.static_range(2):
                    tma.store_wait(0)
                    c_tile.store(halves[h])
                    fence_async_shared()
                    tma.async_store(out_desc, [out_row, col_block * BN + h * (BN // 2)], c_tile)
        ring += item_steps
        item += 1
    tma.store_wait(0)


@gluon.jit
def wgrad_sm90_kernel(a_desc, b_desc, out_desc, expert_counts_ptr, expert_row_start_ptr, num_experts, M, N,
                      GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr, ROWS: gl.constexpr,
                      EPI_SPLIT: gl.constexpr):
    """Persistent: each CTA runs work items program_id, program_id + num_programs, ... (see the module docstring)."""
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    ready, empty, turn = init_barriers(NUM_STAGES, PINGPONG)

    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, c_smem, ready, empty, turn, out_desc, expert_counts_ptr, expert_row_start_ptr,
                     num_experts, M, N, 0, PINGPONG, ROWS, GROUP_M, NUM_STAGES, EPI_SPLIT)),
        (_consumer, (a_smem, b_smem, c_smem, ready, empty, turn, out_desc, expert_counts_ptr, expert_row_start_ptr,
                     num_experts, M, N, 1, PINGPONG, ROWS, GROUP_M, NUM_STAGES, EPI_SPLIT)),
        (_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, expert_counts_ptr, expert_row_start_ptr,
                     num_experts, M, N, GROUP_M, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


# ----------------------------------------------------------------------------------------------------- the wrapper
def unsupported_reason(a, b, out, sort: ExpertSort, config: WgradConfig) -> str | None:
    """Why the kernel cannot take these arguments, or None where it can. (It cannot check that the padding rows of
    a and b are zero, which it requires: see the module docstring.)"""
    if not isinstance(sort, ExpertSort):
        return f"wgrad_sm90: sort must be a dispatch.ExpertSort, got {type(sort).__name__}"
    if a.dim() != 2 or b.dim() != 2 or out.dim() != 3:
        return (f"wgrad_sm90: expected a (rows, M), b (rows, N), out (E, M, N); got a {tuple(a.shape)}, "
                f"b {tuple(b.shape)}, out {tuple(out.shape)}")
    if a.dtype not in GL_DTYPES or b.dtype != a.dtype or out.dtype != a.dtype:
        return (f"wgrad_sm90: a, b and out must share a 16-bit float dtype (bfloat16 or float16), got "
                f"{a.dtype}, {b.dtype} and {out.dtype}")
    num_experts, M, N = out.shape
    num_rows = sort.tile_expert.numel() * sort.block_m
    if a.shape != (num_rows, M) or b.shape != (num_rows, N):
        return (f"wgrad_sm90: a and b must be (sort rows, M) = ({num_rows}, {M}) and (sort rows, N) = "
                f"({num_rows}, {N}), got {tuple(a.shape)} and {tuple(b.shape)}")
    if sort.expert_counts.numel() != num_experts:
        return f"wgrad_sm90: the sort has {sort.expert_counts.numel()} experts, out {num_experts}"
    if sort.block_m % config.block_k:
        # a K step must not run past the expert's padded rows into the next expert's
        return (f"wgrad_sm90: the sort's block_m = {sort.block_m} must be a multiple of block_k = "
                f"{config.block_k} (a K step would read the next expert's rows)")
    if M % BLOCK_M:
        return (f"wgrad_sm90: M = {M} must be a multiple of {BLOCK_M} (an output row block of out viewed as "
                f"(E*M, N) would cross an expert boundary); use triton_gemm.wgrad_launch")
    if not (a.is_contiguous() and b.is_contiguous() and out.is_contiguous()):
        return "wgrad_sm90: a, b and out must be contiguous (TMA descriptors over their rows)"
    if (M * a.element_size()) % 16 or (N * b.element_size()) % 16:
        return f"wgrad_sm90: TMA needs 16-byte aligned rows: M = {M} and N = {N} must be multiples of 8"
    if a.data_ptr() % 16 or b.data_ptr() % 16 or out.data_ptr() % 16:
        return "wgrad_sm90: TMA needs 16-byte aligned base addresses of a, b and out"
    try:
        check_config(config, a.element_size())
    except ValueError as error:
        return str(error)
    return None


def launch_args(a, b, out, sort: ExpertSort, config: WgradConfig = WgradConfig(), num_ctas: int | None = None):
    """(grid, positional args, constexprs) of one launch, after the argument checks (ValueError); no device check,
    so that offline builds can pass meta tensors."""
    reason = unsupported_reason(a, b, out, sort, config)
    if reason is not None:
        raise ValueError(reason)
    num_experts, M, N = out.shape
    num_work = num_experts * (M // BLOCK_M) * triton.cdiv(N, config.block_n)
    if num_ctas is None:
        num_ctas = sm_count(out.device)
    grid = (max(1, min(num_ctas, num_work)),)
    a_desc = sm90.descriptor(a, [config.block_k, BLOCK_M])
    b_desc = sm90.descriptor(b, [config.block_k, config.block_n])
    out_desc = sm90.descriptor(out.view(num_experts * M, N),
                                 [_rows(config), config.block_n // config.epilogue_split])
    args = (a_desc, b_desc, out_desc, sort.expert_counts, sort.expert_row_start, num_experts, M, N)
    constexprs = dict(GROUP_M=config.group_m, NUM_STAGES=config.num_stages, PINGPONG=config.pingpong,
                      ROWS=_rows(config), EPI_SPLIT=config.epilogue_split)
    return grid, args, constexprs


def wgrad_sm90(a, b, out, sort: ExpertSort, config: WgradConfig = WgradConfig(), num_ctas: int | None = None):
    """``out[e] = a_e^T b_e`` over expert e's sorted rows (``triton_gemm.wgrad_launch``'s product), every element of
    out written (zeros for experts without rows).

    a: (sort rows, M), b: (sort rows, N), out: (E, M, N), all contiguous, one 16-bit float dtype; M a multiple of
    128; sort: the forward's ExpertSort (block_m a multiple of config.block_k). The padding rows of a and b in the
    experts' last K step must be zero (the library's producers write them so; see the module docstring).
    ``num_ctas``: persistent CTAs (default: one per SM). Raises ValueError on arguments the kernel cannot take
    (then use triton_gemm.wgrad_launch). Returns the compiled kernel (registers, spills, SASS for diagnostics)."""
    tensors = (a, b, out, sort.expert_counts, sort.expert_row_start)
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        raise ValueError("wgrad_sm90: needs CUDA tensors (a Hopper GPU)")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("wgrad_sm90: all tensors must be on one device")
    grid, args, constexprs = launch_args(a, b, out, sort, config, num_ctas)
    return wgrad_sm90_kernel[grid](*args, **constexprs, **LAUNCH_OPTIONS)


def compile_offline(a, b, out, sort: ExpertSort, config: WgradConfig = WgradConfig(), num_ctas: int = 132):
    """``triton.compile`` of this launch for sm_90 without a GPU (meta tensors are enough), specialised as the JIT
    would specialise it; returns the CompiledKernel."""
    _, args, constexprs = launch_args(a, b, out, sort, config, num_ctas)
    return sm90.compile_offline(wgrad_sm90_kernel, args, constexprs)
