"""Grouped expert GEMMs over the expert-sorted rows of ``dispatch.sort_pairs_by_expert``.

Forward, two launches after the sort:
- ``_up_swiglu_kernel``: ``h[row] = silu(x[token] @ w1[e, :F].T) * (x[token] @ w1[e, F:].T)``; the gather of
  token rows happens in the A-operand load, gate and up share it, and only ``h`` (rows, F) reaches memory.
- ``_down_combine_kernel``: ``out[token] += weight[pair] * (h[row] @ w2[e].T)``; the routing weight is applied in
  the epilogue and the k rows of a token meet through float32 atomic adds straight into the (T, d) output, so no
  (T·k, d) buffer is written or reduced. Atomics also make split-K free for the few-token case. The order of
  the k additions is not fixed: results may differ in the last float32 bit from run to run.

Backward, four launches reusing the forward's sort (nothing but the sort is kept from the forward):
- ``_swiglu_backward_kernel``: recomputes gate/up and ``dh = weight * (dout[token] @ w2[e])`` in one pass over
  d (all three contract over d), then writes ``h``, ``d(gate, up)`` and atomically accumulates the routing-weight
  gradient ``dout[token] . y = (dout[token] @ w2[e]) . h``.
- ``_down_combine_kernel`` again for ``dx[token] += d(gate, up)[row] @ w1[e]``.
- ``_expert_wgrad_kernel`` twice: ``dw1[e] = d(gate, up)_e^T x_e`` and ``dw2[e] = (weight * dout)_e^T h_e``, a
  reduction over each expert's rows, one writer per output element (deterministic).
"""

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashmoe_science.moe.dispatch import ExpertSort, sort_pairs_by_expert
from flashmoe_science.moe.tiles import MoETiles, choose_tiles


class SavedForBackward(NamedTuple):
    sort: ExpertSort
    tiles: MoETiles


def _empty(shape, dtype, device):
    """``torch.empty``, or NaN-filled when FLASHMOE_SCIENCE_POISON=1 so tests catch any element a kernel skips."""
    if os.environ.get("FLASHMOE_SCIENCE_POISON", "0") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get exact products; half inputs ignore the setting
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _row_tile_and_col_block(pid, num_row_tiles, num_col_blocks, GROUP_M: tl.constexpr):
    # GROUP_M row tiles (consecutive, so mostly one expert) sweep a column block together: the expert's weight
    # block is read from L2 instead of HBM by all but the first of them
    programs_per_group = GROUP_M * num_col_blocks
    group = pid // programs_per_group
    first_tile = group * GROUP_M
    tiles_in_group = tl.minimum(num_row_tiles - first_tile, GROUP_M)
    tile = first_tile + (pid % programs_per_group) % tiles_in_group
    col_block = (pid % programs_per_group) // tiles_in_group
    return tile, col_block


@triton.jit
def _tile_rows_and_cols(tile, col_block, sorted_pair_ids_ptr, num_pairs, num_cols,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A row tile's sorted rows, the (token, slot) pair each holds, and the column block, with their masks
    (padding rows hold ids >= num_pairs)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + rows)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, pairs, pairs < num_pairs, cols, cols < num_cols


@triton.jit
def _up_swiglu_kernel(
    x_ptr,
    w1_ptr,
    h_ptr,
    sorted_pair_ids_ptr,
    tile_expert_ptr,
    num_pairs,
    top_k,
    d_model,
    d_ff,
    num_row_tiles,
    stride_xt,
    stride_xd,
    stride_we,
    stride_wf,
    stride_wd,
    stride_hm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile, col_block = _row_tile_and_col_block(tl.program_id(0), num_row_tiles, tl.cdiv(d_ff, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    rows, pairs, row_valid, cols, col_valid = _tile_rows_and_cols(
        tile, col_block, sorted_pair_ids_ptr, num_pairs, d_ff, BLOCK_M, BLOCK_N)
    tokens = tl.where(row_valid, pairs // top_k, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xd
    gate_ptrs = w1_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wf + ks[:, None] * stride_wd
    up_ptrs = gate_ptrs + d_ff * stride_wf
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_valid[:, None], other=0.0)
            gate_w = tl.load(gate_ptrs, mask=col_valid[None, :], other=0.0)
            up_w = tl.load(up_ptrs, mask=col_valid[None, :], other=0.0)
        else:
            k_valid = (k0 + ks) < d_model
            a = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            gate_w = tl.load(gate_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
            up_w = tl.load(up_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        acc_gate = tl.dot(a, gate_w, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, up_w, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xd
        gate_ptrs += BLOCK_K * stride_wd
        up_ptrs += BLOCK_K * stride_wd

    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _down_combine_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    row_scale_ptr,
    sorted_pair_ids_ptr,
    tile_expert_ptr,
    num_pairs,
    top_k,
    K,
    N,
    num_row_tiles,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_ot,
    HAS_ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[token(row), n] += scale[pair(row)] * sum_k a[row, k] * b[expert, k, n] (float32 atomics)."""
    tile, col_block = _row_tile_and_col_block(tl.program_id(0), num_row_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    rows, pairs, row_valid, cols, col_valid = _tile_rows_and_cols(
        tile, col_block, sorted_pair_ids_ptr, num_pairs, N, BLOCK_M, BLOCK_N)

    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    ks = k_begin + tl.arange(0, BLOCK_K)
    # padding rows of `a` were never written: the row mask keeps their garbage out of the dot
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_valid[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_valid[None, :], other=0.0)
        else:
            k_valid = (k0 - k_begin + ks) < k_end
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_ROW_SCALE:
        acc = acc * tl.load(row_scale_ptr + pairs, mask=row_valid, other=0.0)[:, None]
    tokens = tl.where(row_valid, pairs // top_k, 0).to(tl.int64)
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + cols[None, :]
    tl.atomic_add(out_ptrs, acc, mask=row_valid[:, None] & col_valid[None, :], sem="relaxed")


@triton.jit
def _swiglu_backward_kernel(
    x_ptr,
    dout_ptr,
    w1_ptr,
    w2_ptr,
    row_scale_ptr,
    h_ptr,
    dgu_ptr,
    dscale_ptr,
    sorted_pair_ids_ptr,
    tile_expert_ptr,
    num_pairs,
    top_k,
    d_model,
    d_ff,
    num_row_tiles,
    stride_xt,
    stride_xd,
    stride_ot,
    stride_od,
    stride_w1e,
    stride_w1f,
    stride_w1d,
    stride_w2e,
    stride_w2d,
    stride_w2f,
    stride_hm,
    stride_dgum,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile, col_block = _row_tile_and_col_block(tl.program_id(0), num_row_tiles, tl.cdiv(d_ff, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    rows, pairs, row_valid, cols, col_valid = _tile_rows_and_cols(
        tile, col_block, sorted_pair_ids_ptr, num_pairs, d_ff, BLOCK_M, BLOCK_N)
    tokens = tl.where(row_valid, pairs // top_k, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xd
    dout_ptrs = dout_ptr + tokens[:, None] * stride_ot + ks[None, :] * stride_od
    gate_ptrs = w1_ptr + expert * stride_w1e + cols[None, :] * stride_w1f + ks[:, None] * stride_w1d
    up_ptrs = gate_ptrs + d_ff * stride_w1f
    w2_ptrs = w2_ptr + expert * stride_w2e + ks[:, None] * stride_w2d + cols[None, :] * stride_w2f
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_dy_w2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        if EVEN_K:
            row_mask = row_valid[:, None]
            w_mask = col_valid[None, :]
        else:
            k_valid = (k0 + ks) < d_model
            row_mask = row_valid[:, None] & k_valid[None, :]
            w_mask = k_valid[:, None] & col_valid[None, :]
        a = tl.load(x_ptrs, mask=row_mask, other=0.0)
        g = tl.load(dout_ptrs, mask=row_mask, other=0.0)
        acc_gate = tl.dot(a, tl.load(gate_ptrs, mask=w_mask, other=0.0), acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up, input_precision=DOT_PRECISION)
        acc_dy_w2 = tl.dot(g, tl.load(w2_ptrs, mask=w_mask, other=0.0), acc_dy_w2, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xd
        dout_ptrs += BLOCK_K * stride_od
        gate_ptrs += BLOCK_K * stride_w1d
        up_ptrs += BLOCK_K * stride_w1d
        w2_ptrs += BLOCK_K * stride_w2d

    sig = tl.sigmoid(acc_gate)
    silu = acc_gate * sig
    h = silu * acc_up
    # gradient of the routing weight: dout[token] . (h @ w2[e].T) = (dout[token] @ w2[e]) . h, this block's share
    tl.atomic_add(dscale_ptr + pairs, tl.sum(acc_dy_w2 * h, axis=1), mask=row_valid, sem="relaxed")
    scale = tl.load(row_scale_ptr + pairs, mask=row_valid, other=0.0)
    dh = acc_dy_w2 * scale[:, None]
    d_up = dh * silu
    d_gate = dh * acc_up * sig * (1.0 + acc_gate * (1.0 - sig))

    out_mask = row_valid[:, None] & col_valid[None, :]
    row_offsets = rows.to(tl.int64)[:, None]
    tl.store(h_ptr + row_offsets * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=out_mask)
    dgu_ptrs = dgu_ptr + row_offsets * stride_dgum + cols[None, :]
    tl.store(dgu_ptrs, d_gate.to(dgu_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dgu_ptrs + d_ff, d_up.to(dgu_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _expert_wgrad_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    row_scale_ptr,
    sorted_pair_ids_ptr,
    expert_counts_ptr,
    expert_row_start_ptr,
    top_k,
    M,
    N,
    stride_ar,
    stride_am,
    stride_br,
    stride_bn,
    stride_oe,
    stride_om,
    stride_on,
    A_GATHER: tl.constexpr,
    A_ROW_SCALE: tl.constexpr,
    B_GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[e, m, n] = sum over the rows r of expert e of A[r, m] * B[r, n].

    A row r is read at the sorted row itself or, with *_GATHER, at its token (pair // top_k).
    """
    expert = tl.program_id(1)
    num_col_blocks = tl.cdiv(N, BLOCK_N)
    row_block = tl.program_id(0) // num_col_blocks
    col_block = tl.program_id(0) % num_col_blocks
    count = tl.load(expert_counts_ptr + expert)
    first_row = tl.load(expert_row_start_ptr + expert)
    ms = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = ms < M
    n_valid = ns < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, count, BLOCK_K):
        rs = r0 + tl.arange(0, BLOCK_K)
        r_valid = rs < count
        rows = first_row + rs
        pairs = tl.load(sorted_pair_ids_ptr + rows, mask=r_valid, other=0)
        tokens = (pairs // top_k).to(tl.int64)
        if A_GATHER:
            a_rows = tokens
        else:
            a_rows = rows.to(tl.int64)
        if B_GATHER:
            b_rows = tokens
        else:
            b_rows = rows.to(tl.int64)
        a = tl.load(
            a_ptr + a_rows[None, :] * stride_ar + ms[:, None] * stride_am,
            mask=m_valid[:, None] & r_valid[None, :],
            other=0.0,
        )
        if A_ROW_SCALE:
            scale = tl.load(row_scale_ptr + pairs, mask=r_valid, other=0.0)
            a = (a * scale[None, :]).to(a_ptr.dtype.element_ty)
        b = tl.load(
            b_ptr + b_rows[:, None] * stride_br + ns[None, :] * stride_bn,
            mask=r_valid[:, None] & n_valid[None, :],
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + ms[:, None] * stride_om + ns[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


# ---------------------------------------------------------------------------------------------- launches
def _launch_down_combine(a, b, b_strides, out32, row_scale, sort, tiles, gemm, K, N):
    """out32[token] += (row_scale *) a[row] @ b[expert]; ``b_strides`` = (expert, k, n) strides of b."""
    num_row_tiles = sort.tile_expert.numel()
    grid = (num_row_tiles * triton.cdiv(N, gemm.block_n), gemm.split_k)
    _down_combine_kernel[grid](
        a,
        b,
        out32,
        row_scale if row_scale is not None else out32,
        sort.sorted_pair_ids,
        sort.tile_expert,
        sort.num_pairs,
        sort.top_k,
        K,
        N,
        num_row_tiles,
        a.stride(0),
        a.stride(1),
        *b_strides,
        out32.stride(0),
        HAS_ROW_SCALE=row_scale is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=gemm.block_n,
        BLOCK_K=gemm.block_k,
        GROUP_M=tiles.group_m,
        SPLIT_K=gemm.split_k,
        EVEN_K=K % (gemm.block_k * gemm.split_k) == 0,
        DOT_PRECISION=_dot_precision(a.dtype),
        num_warps=gemm.num_warps,
        num_stages=gemm.num_stages,
    )


def _launch_wgrad(a, a_gather, a_row_scale, b, b_gather, out, sort, tiles):
    num_experts, M, N = out.shape
    gemm = tiles.wgrad
    grid = (triton.cdiv(M, gemm.block_n) * triton.cdiv(N, gemm.block_n), num_experts)
    _expert_wgrad_kernel[grid](
        a,
        b,
        out,
        a_row_scale if a_row_scale is not None else out,
        sort.sorted_pair_ids,
        sort.expert_counts,
        sort.expert_row_start,
        sort.top_k,
        M,
        N,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        A_GATHER=a_gather,
        A_ROW_SCALE=a_row_scale is not None,
        B_GATHER=b_gather,
        BLOCK_M=gemm.block_n,
        BLOCK_N=gemm.block_n,
        BLOCK_K=gemm.block_k,
        DOT_PRECISION=_dot_precision(a.dtype),
        num_warps=gemm.num_warps,
        num_stages=gemm.num_stages,
    )


def moe_forward(x, w1, w2, weights32, topk_ids, tiles: MoETiles | None = None):
    """Already-checked tensors: x (T, d), w1 (E, 2F, d), w2 (E, d, F), weights32 (T, k) contiguous float32,
    topk_ids (T, k) int. Returns ``(out, SavedForBackward)``."""
    num_tokens, d_model = x.shape
    num_experts, two_d_ff, _ = w1.shape
    d_ff = two_d_ff // 2
    top_k = topk_ids.shape[1]
    if tiles is None:
        tiles = choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, x.device)
    sort = sort_pairs_by_expert(topk_ids, num_experts, tiles.block_m)
    saved = SavedForBackward(sort, tiles)
    if num_tokens == 0:
        return x.new_empty((0, d_model)), saved

    num_row_tiles = sort.tile_expert.numel()
    h = _empty((num_row_tiles * tiles.block_m, d_ff), x.dtype, x.device)
    up = tiles.up
    _up_swiglu_kernel[(num_row_tiles * triton.cdiv(d_ff, up.block_n),)](
        x,
        w1,
        h,
        sort.sorted_pair_ids,
        sort.tile_expert,
        sort.num_pairs,
        top_k,
        d_model,
        d_ff,
        num_row_tiles,
        x.stride(0),
        x.stride(1),
        w1.stride(0),
        w1.stride(1),
        w1.stride(2),
        h.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=up.block_n,
        BLOCK_K=up.block_k,
        GROUP_M=tiles.group_m,
        EVEN_K=d_model % up.block_k == 0,
        DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=up.num_warps,
        num_stages=up.num_stages,
    )
    out32 = torch.zeros((num_tokens, d_model), dtype=torch.float32, device=x.device)
    w2_strides = (w2.stride(0), w2.stride(2), w2.stride(1))  # (expert, k = F, n = d)
    _launch_down_combine(h, w2, w2_strides, out32, weights32, sort, tiles, tiles.down, d_ff, d_model)
    return out32.to(x.dtype), saved


def moe_backward(grad_out, x, w1, w2, weights32, saved: SavedForBackward,
                 need_dx: bool = True, need_dw1: bool = True, need_dw2: bool = True):
    """Gradients ``(dx, dw1, dw2, dweights32)`` of ``moe_forward``'s output, reusing its sort.

    The SwiGLU backward always runs (it also yields the routing-weight gradient); the dx GEMM and each weight
    gradient run only when asked for (frozen experts, router-only training), and come back None otherwise.
    """
    sort, tiles = saved
    num_tokens, d_model = x.shape
    num_experts, two_d_ff, _ = w1.shape
    d_ff = two_d_ff // 2
    dweights = torch.zeros(weights32.shape, dtype=torch.float32, device=x.device)
    dw1 = _empty(w1.shape, w1.dtype, w1.device) if need_dw1 else None
    dw2 = _empty(w2.shape, w2.dtype, w2.device) if need_dw2 else None
    if num_tokens == 0:
        dx = x.new_empty((0, d_model)) if need_dx else None
        return dx, dw1.zero_() if need_dw1 else None, dw2.zero_() if need_dw2 else None, dweights

    num_row_tiles = sort.tile_expert.numel()
    num_rows = num_row_tiles * tiles.block_m
    h = _empty((num_rows, d_ff), x.dtype, x.device)
    dgu = _empty((num_rows, two_d_ff), x.dtype, x.device)
    up = tiles.up
    _swiglu_backward_kernel[(num_row_tiles * triton.cdiv(d_ff, up.block_n),)](
        x,
        grad_out,
        w1,
        w2,
        weights32,
        h,
        dgu,
        dweights,
        sort.sorted_pair_ids,
        sort.tile_expert,
        sort.num_pairs,
        sort.top_k,
        d_model,
        d_ff,
        num_row_tiles,
        x.stride(0),
        x.stride(1),
        grad_out.stride(0),
        grad_out.stride(1),
        w1.stride(0),
        w1.stride(1),
        w1.stride(2),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        h.stride(0),
        dgu.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=up.block_n,
        BLOCK_K=up.block_k,
        GROUP_M=tiles.group_m,
        EVEN_K=d_model % up.block_k == 0,
        DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=up.num_warps,
        # five operand tiles per stage: three stages stay inside Hopper's 227 KiB of shared memory
        num_stages=min(up.num_stages, 3),
    )
    dx = None
    if need_dx:
        dx32 = torch.zeros((num_tokens, d_model), dtype=torch.float32, device=x.device)
        w1_strides = (w1.stride(0), w1.stride(1), w1.stride(2))  # (expert, k = 2F, n = d)
        _launch_down_combine(dgu, w1, w1_strides, dx32, None, sort, tiles, tiles.down, two_d_ff, d_model)
        dx = dx32.to(x.dtype)
    if need_dw1:
        _launch_wgrad(dgu, False, None, x, True, dw1, sort, tiles)
    if need_dw2:
        _launch_wgrad(grad_out, True, weights32, h, False, dw2, sort, tiles)
    return dx, dw1, dw2, dweights
