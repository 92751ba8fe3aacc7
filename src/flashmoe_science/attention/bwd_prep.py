"""The two row-wise kernels around every attention backward, the Triton and the Gluon one alike: the preprocess
Δ = rowsum(dO ∘ O) (one float32 value per query row, so no later kernel needs O; it also zeroes a fused path's dQ
workspace and, in the sm_90 one pass's deterministic mode, its int32 counters of one value per row), and the conversion of that float32 workspace into dQ (dQ = dq_accum · scale, in dQ's dtype and strides).

A packed batch whose sm_90 backward stages lse and Δ by TMA takes `padded_stats_kernel` as its preprocess instead: the
same Δ and zeroing, and a copy of lse, with Δ and lse in the layout where every sequence's rows start 16-byte
aligned (seqlen.padded_row_start).

Each launch is given as (kernel, grid, every parameter by name, launch options), so a caller may run it at once or
keep it as a PreparedLaunch. The kernels walk every row of the (possibly packed) `(B, H, L, D)` tensors (the padded
one: every row of its layout), about ROW_KERNEL_ELEMENTS elements per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashmoe_science.attention.seqlen import padded_row_start
from flashmoe_science.attention.tiles import padded_head_dim
from flashmoe_science.attention.triton.common import load_tile

# Elements per program of the row-wise kernels: ~64 fp32 values per thread at 4 warps.
ROW_KERNEL_ELEMENTS = 8192


@triton.jit(do_not_specialize=["num_q_heads", "seqlen_q"])
def preprocess_kernel(
    O, DO, Delta, DQ_ACCUM, SEMAPHORES,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    num_q_heads, seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_DQ_ACCUM: tl.constexpr,
    ROW64: tl.constexpr, ZERO_SEMAPHORES: tl.constexpr = False,
):
    """Δ[b, h, i] = Σ_d dO[b, h, i, d] · O[b, h, i, d] in float32; with ZERO_DQ_ACCUM, zeroes the same rows of
    the fused path's dQ workspace, with ZERO_SEMAPHORES those of the int32 counters laid out like Δ (one launch
    fewer than a separate memset each)."""
    if ROW64:  # row offsets (L-1)·stride_row reach 2**31 elements (e.g. a transposed (B, L, H, D) buffer)
        stride_om, stride_dom = stride_om.to(tl.int64), stride_dom.to(tl.int64)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // num_q_heads).to(tl.int64)
    head = (pid_bh % num_q_heads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    o = load_tile(O + batch * stride_ob + head * stride_oh, O, 0, 0, start_m, seqlen_q, stride_om,
                  BLOCK_M, BLOCK_D, HEAD_DIM, False, True)
    do = load_tile(DO + batch * stride_dob + head * stride_doh, DO, 0, 0, start_m, seqlen_q, stride_dom,
                   BLOCK_M, BLOCK_D, HEAD_DIM, False, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_bounds = offs_m < seqlen_q
    rows = pid_bh.to(tl.int64) * seqlen_q + offs_m
    tl.store(Delta + rows, delta, mask=in_bounds)
    if ZERO_DQ_ACCUM:
        cols = tl.arange(0, BLOCK_D)
        tl.store(DQ_ACCUM + rows[:, None] * BLOCK_D + cols[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=in_bounds[:, None])
    if ZERO_SEMAPHORES:
        tl.store(SEMAPHORES + rows, tl.zeros([BLOCK_M], tl.int32), mask=in_bounds)


@triton.jit
def _sequence_of_padded_rows(CU_SEQLENS, rows, num_seqs):
    """For each row of `rows` (a vector of rows of the padded layout, seqlen.padded_row_start): the last sequence
    whose padded rows start at or before it, found by a branchless bisection over the sequences (log2 of the batch
    size gathers of cu_seqlens). The starts never decrease, so that sequence holds the row or the row is padding."""
    lo = rows * 0
    size = num_seqs
    while size > 1:  # the answer lies in [lo, lo + size): the probe stays below num_seqs
        half = size // 2
        mid = lo + half
        lo = tl.where(padded_row_start(tl.load(CU_SEQLENS + mid), mid) <= rows, mid, lo)
        size -= half
    return lo


@triton.jit(do_not_specialize=["num_q_heads", "total_q", "padded_rows", "num_seqs"])
def padded_stats_kernel(
    O, DO, LSE, LSE_PADDED, DELTA_PADDED, DQ_ACCUM, CU_SEQLENS, SEMAPHORES,
    stride_oh, stride_om, stride_doh, stride_dom,
    num_q_heads, total_q, padded_rows, num_seqs,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ROW64: tl.constexpr,
    ZERO_SEMAPHORES: tl.constexpr = False,
):
    """A packed batch's statistics in their padded layout (seqlen.padded_row_start: every (head, sequence) run of
    rows starts 16-byte aligned), one program per BLOCK_M padded rows of one head: Δ = Σ_d dO ∘ O and a copy of
    the forward's lse (its (H, total_q) layout) at each row's padded slot, 0 and +inf in the padding slots (P = 0
    there, like a row past the sequence). Zeroes the same rows of the dQ workspace (packed layout) and, with
    ZERO_SEMAPHORES, the int32 counters (padded layout, as lse). Every packed row belongs to one sequence
    (cu_seqlens' last entry is total_q: checks.check_varlen), so every row of the workspace is zeroed once."""
    if ROW64:  # row offsets (L-1)·stride_row reach 2**31 elements (e.g. a transposed (B, L, H, D) buffer)
        stride_om, stride_dom = stride_om.to(tl.int64), stride_dom.to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    padded = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    seq = _sequence_of_padded_rows(CU_SEQLENS, padded, num_seqs)
    first = tl.load(CU_SEQLENS + seq)
    row = padded - padded_row_start(first, seq)  # within the sequence
    in_head = padded < padded_rows
    real = (row < tl.load(CU_SEQLENS + seq + 1) - first) & in_head
    packed = first + row
    cols = tl.arange(0, BLOCK_D)
    inside = real[:, None] & (cols[None, :] < HEAD_DIM)
    o = tl.load(O + head * stride_oh + packed[:, None] * stride_om + cols[None, :], mask=inside, other=0.0)
    do = tl.load(DO + head * stride_doh + packed[:, None] * stride_dom + cols[None, :], mask=inside, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # 0 in the padding slots
    lse = tl.load(LSE + head * total_q + packed, mask=real, other=float("inf"))
    slots = head * padded_rows + padded
    tl.store(DELTA_PADDED + slots, delta, mask=in_head)
    tl.store(LSE_PADDED + slots, lse, mask=in_head)
    if ZERO_SEMAPHORES:
        tl.store(SEMAPHORES + slots, tl.zeros([BLOCK_M], tl.int32), mask=in_head)
    rows = head * total_q + packed
    tl.store(DQ_ACCUM + rows[:, None] * BLOCK_D + cols[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
             mask=real[:, None])


@triton.jit(do_not_specialize=["num_q_heads", "seqlen_q"])
def dq_convert_kernel(
    DQ_ACCUM, DQ,
    stride_dqb, stride_dqh, stride_dqm,
    num_q_heads, seqlen_q, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ROW64: tl.constexpr,
):
    """dQ = dq_accum · scale: the fused path's float32 (B, Hq, Lq, BLOCK_D) workspace into dQ's dtype and strides."""
    if ROW64:  # row offsets (L-1)·stride_row reach 2**31 elements (e.g. a transposed (B, L, H, D) buffer)
        stride_dqm = stride_dqm.to(tl.int64)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // num_q_heads).to(tl.int64)
    q_head = (pid_bh % num_q_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    in_bounds = offs_m[:, None] < seqlen_q
    rows = pid_bh.to(tl.int64) * seqlen_q + offs_m
    dq = tl.load(DQ_ACCUM + rows[:, None] * BLOCK_D + cols[None, :], mask=in_bounds, other=0.0) * sm_scale
    mask = in_bounds
    if BLOCK_D != HEAD_DIM:
        mask = mask & (cols[None, :] < HEAD_DIM)
    dq_ptrs = DQ + batch * stride_dqb + q_head * stride_dqh + offs_m[:, None] * stride_dqm + cols[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=mask)


def _row_grid(t: torch.Tensor) -> tuple[int, int, tuple[int, int]]:
    """(padded head dim, rows per program, grid) of a row-wise kernel over the (B, H, L, D) tensor t."""
    block_d = padded_head_dim(t.shape[-1])
    row_block = max(16, min(128, ROW_KERNEL_ELEMENTS // block_d))
    return block_d, row_block, (triton.cdiv(t.shape[2], row_block), t.shape[0] * t.shape[1])


def preprocess_launch(out: torch.Tensor, grad_out: torch.Tensor, delta: torch.Tensor, dq_accum: torch.Tensor | None,
                      row64: bool, semaphores: torch.Tensor | None = None):
    """Δ = rowsum(dO ∘ O) into the float32 `delta` (out's (B, H, L)), and dq_accum (a contiguous float32
    (B, H, L, padded head dim), or None) and `semaphores` (contiguous int32 of delta's shape, or None) zeroed:
    (kernel, grid, parameters by name, options). row64: 64-bit row offsets (layout.needs_64bit_rows of the call's
    tensors)."""
    block_d, row_block, grid = _row_grid(out)
    kernel = preprocess_kernel
    bound = dict(zip(kernel.arg_names, (out, grad_out, delta, dq_accum, semaphores, *out.stride()[:3],
                                        *grad_out.stride()[:3], out.shape[1], out.shape[2])),
                 HEAD_DIM=out.shape[-1], BLOCK_D=block_d, BLOCK_M=row_block, ZERO_DQ_ACCUM=dq_accum is not None,
                 ROW64=row64, ZERO_SEMAPHORES=semaphores is not None)
    return kernel, grid, bound, dict(num_warps=4)


def padded_stats_launch(out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor, lse_padded: torch.Tensor,
                        delta_padded: torch.Tensor, dq_accum: torch.Tensor, cu_seqlens_q: torch.Tensor, row64: bool,
                        semaphores: torch.Tensor | None = None):
    """A packed batch's (out, grad_out: (1, H, total, D); lse: the forward's contiguous (1, H, total)) Δ and lse
    copy into `delta_padded` and `lse_padded`, contiguous float32 (1, H, seqlen.padded_stat_rows(total, B)),
    dq_accum (contiguous float32 (1, H, total, padded head dim)) and `semaphores` (int32 of the padded shape, or
    None) zeroed: (kernel, grid, parameters by name, options)."""
    block_d, row_block, _ = _row_grid(out)
    padded_rows = lse_padded.shape[-1]
    kernel = padded_stats_kernel
    bound = dict(zip(kernel.arg_names, (out, grad_out, lse, lse_padded, delta_padded, dq_accum, cu_seqlens_q,
                                        semaphores, out.stride(1), out.stride(2), grad_out.stride(1),
                                        grad_out.stride(2), out.shape[1], out.shape[2], padded_rows,
                                        cu_seqlens_q.shape[0] - 1)),
                 HEAD_DIM=out.shape[-1], BLOCK_D=block_d, BLOCK_M=row_block, ROW64=row64,
                 ZERO_SEMAPHORES=semaphores is not None)
    return kernel, (triton.cdiv(padded_rows, row_block), out.shape[1]), bound, dict(num_warps=4)


def dq_convert_launch(dq_accum: torch.Tensor, dq: torch.Tensor, softmax_scale: float, row64: bool):
    """dq = dq_accum · softmax_scale (dq_accum: preprocess_launch's workspace, summed into by a fused backward):
    (kernel, grid, parameters by name, options)."""
    block_d, row_block, grid = _row_grid(dq)
    kernel = dq_convert_kernel
    bound = dict(zip(kernel.arg_names, (dq_accum, dq, *dq.stride()[:3], dq.shape[1], dq.shape[2], softmax_scale)),
                 HEAD_DIM=dq.shape[-1], BLOCK_D=block_d, BLOCK_M=row_block, ROW64=row64)
    return kernel, grid, bound, dict(num_warps=4)
