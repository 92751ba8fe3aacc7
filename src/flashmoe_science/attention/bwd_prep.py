"""The two row-wise kernels around every attention backward, the Triton and the Gluon one alike: the preprocess
Δ = rowsum(dO ∘ O) (one float32 value per query row, so no later kernel needs O; it also zeroes a fused path's dQ
workspace and, in the sm_90 one pass's deterministic mode, its int32 counters of one value per row), and the conversion of that float32 workspace into dQ (dQ = dq_accum · scale, in dQ's dtype and strides).

Each launch is given as (kernel, grid, every parameter by name, launch options), so a caller may run it at once or
keep it as a PreparedLaunch. Both kernels walk every row of the (possibly packed) `(B, H, L, D)` tensors, about
ROW_KERNEL_ELEMENTS elements per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashmoe_science.attention.tiles import padded_head_dim
from flashmoe_science.attention.triton_common import load_tile

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


def dq_convert_launch(dq_accum: torch.Tensor, dq: torch.Tensor, softmax_scale: float, row64: bool):
    """dq = dq_accum · softmax_scale (dq_accum: preprocess_launch's workspace, summed into by a fused backward):
    (kernel, grid, parameters by name, options)."""
    block_d, row_block, grid = _row_grid(dq)
    kernel = dq_convert_kernel
    bound = dict(zip(kernel.arg_names, (dq_accum, dq, *dq.stride()[:3], dq.shape[1], dq.shape[2], softmax_scale)),
                 HEAD_DIM=dq.shape[-1], BLOCK_D=block_d, BLOCK_M=row_block, ROW64=row64)
    return kernel, grid, bound, dict(num_warps=4)
