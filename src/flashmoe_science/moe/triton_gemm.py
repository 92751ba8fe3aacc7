"""Grouped expert GEMMs over the expert-sorted rows of ``dispatch.sort_pairs_by_expert``: the Triton kernels and
their launches. ``moe/gemms.py`` wraps them as the portable family of the layer's GEMMs; ``moe/layer.py`` runs each
product in the family the call's plan gives it (``moe/plan.py``), these kernels wherever no earlier family takes it.

Forward, two launches after the sort:
- ``_up_swiglu_kernel``: ``h[row] = silu(x[token] @ w1[e, :F].T) * (x[token] @ w1[e, F:].T)``; the gather of
  token rows happens in the A-operand load, gate and up share it, and only ``h`` (rows, F) reaches memory.
- ``_down_combine_kernel``: ``out[token] += weight[pair] * (h[row] @ w2[e].T)``; the routing weight is applied in
  the epilogue, and the k rows of a token meet in one of two ways (``tiles.COMBINES``, chosen by
  ``tiles.choose_combine``): float32 atomic adds straight into a (T, d) accumulator, so no (T·k, d) buffer is
  written or reduced, and split-K is free for the few-token case (the order of the k additions is not fixed:
  results may differ in the last float32 bit from run to run); or (``STORE_ROWS``) a plain store of each weighted
  row to its own sorted row of a (rows, d) buffer in x's dtype, which ``_combine_rows_kernel`` then sums per
  token in slot order (deterministic; no atomics where the accumulator would outgrow L2).

Gate and up rows of w1 are read as one B tile with interleaved columns (``_gate_up_columns``): one MMA of width
2·BLOCK_N per step instead of two that each re-read the A tile from shared memory.

Backward, four GEMM launches reusing the forward's sort and what a training forward (``save_for_backward=True``)
keeps: the SwiGLU pre-activations ``[gate | up]`` per sorted row (one extra (T·k, 2F) write instead of a backward
that recomputes both, a third more GEMM work) and h (already written for GEMM2); inference keeps nothing:
- ``_gathered_rows_gemm_kernel``: ``dh[row] = dout[token] @ w2[e]``, then ``_swiglu_backward_kernel``
  (elementwise, whole rows) writes ``d(gate, up) = dSwiGLU(weight * dh)`` and the routing-weight gradient
  ``dout[token] . y = dh . h`` (a family whose dh kernel has the SwiGLU backward in its epilogue does both in
  one launch).
- ``_down_combine_kernel`` again for ``dx[token] += d(gate, up)[row] @ w1[e]`` (atomics, or stored rows and
  ``_combine_rows_kernel``, as the forward's down GEMM).
- ``_expert_wgrad_kernel`` twice: ``dw1[e] = d(gate, up)_e^T x_e`` and ``dw2[e] = (weight * dout)_e^T h_e``, a
  reduction over each expert's rows, one writer per output element (deterministic). Their gathered operand
  (x, weight * dout) is first copied to sorted-row order by ``_gather_rows_kernel``. With ``GemmTiles.persistent``
  ``_expert_wgrad_persistent_kernel`` computes the same: a few programs per SM, each running its output tiles'
  reduction steps as one flat loop, so that a tile's store overlaps the next tile's first loads (the reduction is
  short: 64 sorted rows per expert at Mixtral T=256, ~1024 at T=4096).
"""

import triton
import triton.language as tl

from flashmoe_science.device import dot_precision
from flashmoe_science.moe.dispatch import ExpertSort
from flashmoe_science.moe.launch import Launch
from flashmoe_science.moe.tiles import GemmTiles, MoETiles, check_combine, sm_count


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
def _gate_up_columns(w_expert_ptr, col_block, ks, d_ff, stride_wf, stride_wd, BLOCK_N: tl.constexpr):
    """Pointers to a (BLOCK_K, 2*BLOCK_N) tile of w1[e]^T whose columns interleave gate and up rows
    (g0, u0, g1, u1, ...), and the columns' mask. One MMA twice as wide then serves both projections: each A tile
    is read from shared memory once instead of twice, and the product splits back into (gate, up) along the last
    axis, where every thread of the MMA layout already holds adjacent column pairs."""
    j = tl.arange(0, 2 * BLOCK_N)
    ff = col_block * BLOCK_N + j // 2
    w_rows = ff + (j % 2) * d_ff
    return w_expert_ptr + w_rows[None, :] * stride_wf + ks[:, None] * stride_wd, ff < d_ff


@triton.jit(do_not_specialize=["num_pairs", "num_row_tiles"])
def _up_swiglu_kernel(
    x_ptr,
    w1_ptr,
    h_ptr,
    gate_up_ptr,
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
    stride_gum,
    STORE_GATE_UP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """h[row] = silu(gate) * up of x[token] @ w1[e]^T; with STORE_GATE_UP (training) also gate_up[row] = [gate | up],
    the pre-activations the backward reads instead of recomputing them (a third more GEMM work). Training also writes
    h's padding rows, as zeros (their A rows load as zeros: silu(0) * 0 = 0): h is dw2's B operand, and a TMA
    weight-gradient kernel reads the padding rows of an expert's last K step unmasked (TMA cannot mask rows)."""
    tile, col_block = _row_tile_and_col_block(tl.program_id(0), num_row_tiles, tl.cdiv(d_ff, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    rows, pairs, row_valid, cols, col_valid = _tile_rows_and_cols(
        tile, col_block, sorted_pair_ids_ptr, num_pairs, d_ff, BLOCK_M, BLOCK_N)
    tokens = tl.where(row_valid, pairs // top_k, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xd
    w_ptrs, w_valid = _gate_up_columns(w1_ptr + expert.to(tl.int64) * stride_we, col_block, ks, d_ff,
                                       stride_wf, stride_wd, BLOCK_N)
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_valid[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=w_valid[None, :], other=0.0)
        else:
            k_valid = (k0 + ks) < d_model
            a = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_valid[:, None] & w_valid[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xd
        w_ptrs += BLOCK_K * stride_wd

    acc_gate, acc_up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out_mask = row_valid[:, None] & col_valid[None, :]
    row_offsets = rows.to(tl.int64)[:, None]
    h_mask = (row_valid | STORE_GATE_UP)[:, None] & col_valid[None, :]
    tl.store(h_ptr + row_offsets * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=h_mask)
    if STORE_GATE_UP:
        gate_ptrs = gate_up_ptr + row_offsets * stride_gum + cols[None, :]
        tl.store(gate_ptrs, acc_gate.to(gate_up_ptr.dtype.element_ty), mask=out_mask)
        tl.store(gate_ptrs + d_ff, acc_up.to(gate_up_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_pairs", "num_row_tiles"])
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
    STORE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[token(row), n] += scale[pair(row)] * sum_k a[row, k] * b[expert, k, n] (float32 atomics); with STORE_ROWS
    out[row, n] = the same product, stored in out's dtype to the row's own row (SPLIT_K must be 1)."""
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
    out_mask = row_valid[:, None] & col_valid[None, :]
    if STORE_ROWS:
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tokens = tl.where(row_valid, pairs // top_k, 0).to(tl.int64)
        out_ptrs = out_ptr + tokens[:, None] * stride_ot + cols[None, :]
        tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_rows_kernel(
    rows_ptr,
    pair_row_ptr,
    out_ptr,
    num_tokens,
    num_cols,
    stride_rows,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """out[t] = sum over j = 0 .. TOP_K-1 of rows[pair_row[t * TOP_K + j]], in float32, in that order (the same bits
    on every run), rounded once to out's dtype; dropped slots (pair_row -1) add nothing, so a token without a routed
    slot gets zeros."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    token_valid = tokens < num_tokens
    col_valid = (cols < num_cols)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pair_row_ptr + tokens * TOP_K + j, mask=token_valid, other=-1)
        values = tl.load(rows_ptr + row.to(tl.int64)[:, None] * stride_rows + cols[None, :],
                         mask=(row >= 0)[:, None] & col_valid, other=0.0)
        acc += values.to(tl.float32)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=token_valid[:, None] & col_valid)


@triton.jit(do_not_specialize=["num_pairs", "num_row_tiles"])
def _gathered_rows_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sorted_pair_ids_ptr,
    tile_expert_ptr,
    num_pairs,
    top_k,
    K,
    N,
    num_row_tiles,
    stride_at,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[row, n] = sum_k a[token(row), k] * b[expert, k, n] over the sorted rows (the backward's dh = dout @ w2)."""
    tile, col_block = _row_tile_and_col_block(tl.program_id(0), num_row_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    rows, pairs, row_valid, cols, col_valid = _tile_rows_and_cols(
        tile, col_block, sorted_pair_ids_ptr, num_pairs, N, BLOCK_M, BLOCK_N)
    tokens = tl.where(row_valid, pairs // top_k, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + tokens[:, None] * stride_at + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_valid[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_valid[None, :], other=0.0)
        else:
            k_valid = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])
def _swiglu_backward_kernel(
    gate_up_ptr,
    dh_ptr,
    h_ptr,
    row_scale_ptr,
    dgu_ptr,
    dscale_ptr,
    sorted_pair_ids_ptr,
    tile_expert_ptr,
    num_pairs,
    num_rows,
    d_ff,
    stride_gum,
    stride_dhm,
    stride_hm,
    stride_dgum,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Per sorted row, from the forward's saved pre-activations [gate | up] and output h = silu(gate) * up, and
    dh = dout[token] @ w2[e]: d(gate, up) of weight * dh, and the routing-weight gradient dh . h (whole rows per
    program: a plain store, no atomics). The gradient takes the forward's h, rounded once as GEMM2 used it; h
    recomputed from the rounded gate and up doubled that gradient's error in the one-token GPU test.

    Elementwise, so not in the Triton dh GEMM's epilogue: there Triton's layout assignment kept gate/up and the
    accumulator in two register layouts at once and spilled (270+ LDL at 128x128 tiles); this pass moves
    (T·k) x 14F bytes, ~4% of the backward's time at T=4096 (3.7-4.0 TB/s on the H200).

    The padding rows of used row tiles get zeros in d(gate, up) (their loads are masked: 0 * ... = 0), dw1's A
    operand: a TMA weight-gradient kernel reads them unmasked."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs = tl.load(sorted_pair_ids_ptr + rows, mask=rows < num_rows, other=num_pairs)
    row_valid = pairs < num_pairs
    row_used = tl.load(tile_expert_ptr + rows // BLOCK_M, mask=rows < num_rows, other=-1) >= 0
    scale = tl.load(row_scale_ptr + pairs, mask=row_valid, other=0.0)
    row_offsets = rows.to(tl.int64)[:, None]
    dscale = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, d_ff, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_valid[:, None] & (cols < d_ff)[None, :]
        gate_ptrs = gate_up_ptr + row_offsets * stride_gum + cols[None, :]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + d_ff, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + row_offsets * stride_dhm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + row_offsets * stride_hm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        # the routing weight's gradient: dout[token] . (h @ w2[e].T) = (dout[token] @ w2[e]) . h
        dscale += tl.sum(dh * h, axis=1)
        dh = dh * scale[:, None]
        dgu_ptrs = dgu_ptr + row_offsets * stride_dgum + cols[None, :]
        dgu_mask = row_used[:, None] & (cols < d_ff)[None, :]
        tl.store(dgu_ptrs, (dh * up * sig * (1.0 + gate * (1.0 - sig))).to(dgu_ptr.dtype.element_ty), mask=dgu_mask)
        tl.store(dgu_ptrs + d_ff, (dh * silu).to(dgu_ptr.dtype.element_ty), mask=dgu_mask)
    tl.store(dscale_ptr + pairs, dscale, mask=row_valid)


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])
def _gather_rows_kernel(
    src_ptr,
    dst_ptr,
    row_scale_ptr,
    sorted_pair_ids_ptr,
    tile_expert_ptr,
    num_pairs,
    top_k,
    num_rows,
    num_cols,
    stride_src_row,
    stride_src_col,
    stride_dst,
    HAS_ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dst[row] = (scale[pair] *) src[token] for every sorted row holding a pair, zeros in the padding rows of used
    row tiles (the weight-gradient GEMMs' operands: a TMA weight-gradient kernel reads the padding rows of an
    expert's last K step unmasked); rows of unused tiles (tile_expert < 0) are not written."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs = tl.load(sorted_pair_ids_ptr + rows, mask=rows < num_rows, other=num_pairs)
    row_valid = pairs < num_pairs
    row_used = tl.load(tile_expert_ptr + rows // BLOCK_M, mask=rows < num_rows, other=-1) >= 0
    tokens = tl.where(row_valid, pairs // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_valid = (cols < num_cols)[None, :]
    values = tl.load(src_ptr + tokens[:, None] * stride_src_row + cols[None, :] * stride_src_col,
                     mask=row_valid[:, None] & col_valid, other=0.0)  # padding rows: zeros
    if HAS_ROW_SCALE:
        values = values.to(tl.float32) * tl.load(row_scale_ptr + pairs, mask=row_valid, other=0.0)[:, None]
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], values.to(dst_ptr.dtype.element_ty),
             mask=row_used[:, None] & col_valid)


@triton.jit
def _expert_wgrad_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    expert_counts_ptr,
    expert_row_start_ptr,
    M,
    N,
    stride_ar,
    stride_am,
    stride_br,
    stride_bn,
    stride_oe,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[e, m, n] = sum over the sorted rows r of expert e of A[r, m] * B[r, n].

    Both operands are indexed by sorted row (a gathered operand is materialised in sorted order first, by
    ``_gather_rows_kernel``): row addresses are affine in the loop counter, so Triton's pipeliner keeps
    num_stages loads in flight. (Loading the gather index inside this loop made every step wait for its own loads.)
    """
    expert = tl.program_id(1)
    # GROUP_M output row blocks sweep the column blocks together: with column blocks fastest instead, the
    # programs in flight shared two or three row blocks, and B (e.g. h, rows x F for dw2) was re-read from HBM by
    # every row block
    row_block, col_block = _row_tile_and_col_block(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N),
                                                   GROUP_M)
    count = tl.load(expert_counts_ptr + expert)
    first_row = tl.load(expert_row_start_ptr + expert).to(tl.int64)
    ms = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = ms < M
    n_valid = ns < N
    rs = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (first_row + rs)[None, :] * stride_ar + ms[:, None] * stride_am
    b_ptrs = b_ptr + (first_row + rs)[:, None] * stride_br + ns[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, count, BLOCK_K):
        r_valid = (r0 + rs) < count  # rows past the expert's count are padding (masked: may hold anything)
        a = tl.load(a_ptrs, mask=m_valid[:, None] & r_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=r_valid[:, None] & n_valid[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ar
        b_ptrs += BLOCK_K * stride_br
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + ms[:, None] * stride_om + ns[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def _tiles_from(first_tile, program, num_programs):
    # how many of the tiles program, program + num_programs, ... are >= first_tile (elementwise)
    return tl.cdiv(tl.maximum(first_tile - program, 0), num_programs)


@triton.jit
def _expert_wgrad_persistent_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    expert_counts_ptr,
    expert_row_start_ptr,
    num_experts,
    M,
    N,
    stride_ar,
    stride_am,
    stride_br,
    stride_bn,
    stride_oe,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``_expert_wgrad_kernel``'s output from a grid of a few programs per SM. The E x row blocks x column blocks
    output tiles are numbered expert-major (within an expert in ``_row_tile_and_col_block``'s GROUP_M order);
    program p takes tiles p, p + P, p + 2P, ... (P programs), so the tiles in flight at once are neighbours, as in
    the one-program-per-tile grid.

    One flat loop runs all of a program's reduction steps, tile after tile: a tile's step count depends on its
    expert's row count (a device value), which Triton 3.6's loop flattening (``tl.range(flatten=True)``) leaves
    nested: it fuses only inner loops whose bounds are invariant in the outer loop. Flat, the pipeliner issues the next
    tile's first loads while the current tile's last steps and its store run. An expert without rows still takes
    one (fully masked) step per tile, so its tiles are written as zeros."""
    program = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_row_blocks = tl.cdiv(M, BLOCK_M)
    num_col_blocks = tl.cdiv(N, BLOCK_N)
    tiles_per_expert = num_row_blocks * num_col_blocks

    # the loop's trip count: per expert, (this program's tiles of it) x (its reduction steps)
    experts = tl.arange(0, E_POW2)
    counts = tl.load(expert_counts_ptr + experts, mask=experts < num_experts, other=0)
    first_tiles = experts * tiles_per_expert
    own_tiles = _tiles_from(first_tiles + tiles_per_expert, program, num_programs) - \
        _tiles_from(first_tiles, program, num_programs)
    steps_per_tile = tl.maximum(tl.cdiv(counts, BLOCK_K), 1)
    num_steps = tl.sum(tl.where(experts < num_experts, own_tiles * steps_per_tile, 0))

    rs = tl.arange(0, BLOCK_K)
    # the current tile; `step == tile_steps - 1` at entry makes the first iteration start tile `program`
    tile = program - num_programs
    step = 0
    tile_steps = 1
    expert = 0
    row_block = 0
    col_block = 0
    count = 0
    first_row = tl.zeros([], dtype=tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(num_steps):
        step = tl.where(step == tile_steps - 1, 0, step + 1)
        if step == 0:
            tile += num_programs
            expert = tile // tiles_per_expert
            row_block, col_block = _row_tile_and_col_block(tile % tiles_per_expert, num_row_blocks, num_col_blocks,
                                                           GROUP_M)
            count = tl.load(expert_counts_ptr + expert)
            first_row = tl.load(expert_row_start_ptr + expert).to(tl.int64)
            tile_steps = tl.maximum(tl.cdiv(count, BLOCK_K), 1)
        ms = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        ns = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        m_valid = ms < M
        n_valid = ns < N
        # the step's first sorted row as a scalar offset (int64), the tile's offsets from it in int32 (64-bit tensor
        # offsets took ~70 more SASS instructions per step on the H200)
        step_row = first_row + step * BLOCK_K
        r_valid = rs < count - step * BLOCK_K  # rows past the expert's count are padding (masked: any values)
        a = tl.load(a_ptr + step_row * stride_ar + (rs[None, :] * stride_ar + ms[:, None] * stride_am),
                    mask=m_valid[:, None] & r_valid[None, :], other=0.0)
        b = tl.load(b_ptr + step_row * stride_br + (rs[:, None] * stride_br + ns[None, :] * stride_bn),
                    mask=r_valid[:, None] & n_valid[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if step == tile_steps - 1:
            out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + ms[:, None] * stride_om + ns[None, :] * stride_on
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


# ---------------------------------------------------------------------------------------------- launches
def up_swiglu_launch(x, w1, h, gate_up, sort: ExpertSort, tiles: MoETiles) -> Launch:
    """``h[row] = silu(x[token] @ gate.T) * (x[token] @ up.T)`` over the sorted rows (tiles.up); with a ``gate_up``
    buffer (training) also the pre-activations ``[gate | up]`` for the backward."""
    d_model = x.shape[1]
    d_ff = w1.shape[1] // 2
    num_row_tiles = sort.tile_expert.numel()
    gemm = tiles.up
    store_gate_up = gate_up is not None
    gate_up = gate_up if store_gate_up else h  # an unused pointer when not stored
    args = (x, w1, h, gate_up, sort.sorted_pair_ids, sort.tile_expert, sort.num_pairs, sort.top_k, d_model, d_ff,
            num_row_tiles, x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2), h.stride(0),
            gate_up.stride(0))
    meta = dict(STORE_GATE_UP=store_gate_up, BLOCK_M=tiles.block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k,
                GROUP_M=tiles.group_m, EVEN_K=d_model % gemm.block_k == 0, **dot_precision(x),
                num_warps=gemm.num_warps, num_stages=gemm.num_stages)
    return Launch(_up_swiglu_kernel, (num_row_tiles * triton.cdiv(d_ff, gemm.block_n),), args, meta)


def down_combine_launch(a, b, b_strides, out, row_scale, sort: ExpertSort, tiles: MoETiles, gemm: GemmTiles,
                        K: int, N: int) -> Launch:
    """``out[token] += (row_scale *) a[row] @ b[expert]`` into the (T, N) float32 accumulator, or with
    ``tiles.combine == "rows"`` ``out[row] = ...`` into the (sort rows, N) buffer that ``combine_rows_launch`` then
    sums per token; ``b_strides`` = (expert, k, n) strides of b."""
    check_combine(tiles)
    num_row_tiles = sort.tile_expert.numel()
    args = (a, b, out, row_scale if row_scale is not None else out, sort.sorted_pair_ids, sort.tile_expert,
            sort.num_pairs, sort.top_k, K, N, num_row_tiles, a.stride(0), a.stride(1), *b_strides, out.stride(0))
    meta = dict(HAS_ROW_SCALE=row_scale is not None, STORE_ROWS=tiles.combine == "rows", BLOCK_M=tiles.block_m,
                BLOCK_N=gemm.block_n,
                BLOCK_K=gemm.block_k, GROUP_M=tiles.group_m, SPLIT_K=gemm.split_k,
                EVEN_K=K % (gemm.block_k * gemm.split_k) == 0, **dot_precision(a),
                num_warps=gemm.num_warps, num_stages=gemm.num_stages)
    return Launch(_down_combine_kernel, (num_row_tiles * triton.cdiv(N, gemm.block_n), gemm.split_k), args, meta)


def combine_rows_launch(rows, out, sort: ExpertSort) -> Launch:
    """``out[t] = sum_j rows[pair_row[t, j]]`` (slot order, float32 sums, out's dtype): the rows combine's pass
    after the down GEMM or dx stored each sorted row of ``rows`` (sort rows, d)."""
    num_tokens, num_cols = out.shape
    # whole 16-byte vectors per thread, ~4K elements per load step: one pass over the rows at streaming bandwidth
    block_c = min(512, triton.next_power_of_2(num_cols))
    block_t = max(1, 4096 // block_c)
    args = (rows, sort.pair_row, out, num_tokens, num_cols, rows.stride(0), out.stride(0))
    meta = dict(TOP_K=sort.top_k, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    return Launch(_combine_rows_kernel, (triton.cdiv(num_tokens, block_t), triton.cdiv(num_cols, block_c)), args,
                  meta)


def dh_launch(grad_out, w2, dh, sort: ExpertSort, tiles: MoETiles) -> Launch:
    """``dh[row] = dout[token] @ w2[e]`` over the sorted rows (tiles.up_bwd)."""
    d_model, d_ff = w2.shape[1], w2.shape[2]
    num_row_tiles = sort.tile_expert.numel()
    gemm = tiles.up_bwd
    args = (grad_out, w2, dh, sort.sorted_pair_ids, sort.tile_expert, sort.num_pairs, sort.top_k, d_model, d_ff,
            num_row_tiles, grad_out.stride(0), grad_out.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
            dh.stride(0))
    meta = dict(BLOCK_M=tiles.block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k, GROUP_M=tiles.group_m,
                EVEN_K=d_model % gemm.block_k == 0, **dot_precision(grad_out),
                num_warps=gemm.num_warps, num_stages=gemm.num_stages)
    return Launch(_gathered_rows_gemm_kernel, (num_row_tiles * triton.cdiv(d_ff, gemm.block_n),), args, meta)


def swiglu_backward_launch(gate_up, dh, h, weights32, dgu, dweights, sort: ExpertSort) -> Launch:
    """From the forward's saved pre-activations and h, and dh: ``d(gate, up)`` and the routing-weight gradient,
    per sorted row (``_swiglu_backward_kernel``)."""
    num_rows, d_ff = dh.shape
    # H200, benchmarks/tools/sweep_moe_swiglu_backward_tiles.py, T=4096: 1024 elements per step, 4 warps, in 512-column steps
    # (Mixtral F=14336: 4007 GB/s, the best within 1%) or 256 where 512 does not divide F (Qwen3 F=768: 3676 GB/s,
    # the best; 8 rows x 512 columns got 2704 / 1981)
    block_c = min(512 if d_ff % 512 == 0 else 256, triton.next_power_of_2(d_ff))
    block_r = 1024 // block_c
    args = (gate_up, dh, h, weights32, dgu, dweights, sort.sorted_pair_ids, sort.tile_expert, sort.num_pairs, num_rows,
            d_ff, gate_up.stride(0), dh.stride(0), h.stride(0), dgu.stride(0))
    meta = dict(BLOCK_M=sort.block_m, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return Launch(_swiglu_backward_kernel, (triton.cdiv(num_rows, block_r),), args, meta)


def gather_rows_launch(src, dst, row_scale, sort: ExpertSort) -> Launch:
    """``dst[row] = (row_scale[pair] *) src[token]`` over the sorted rows, zeros in the padding rows of used row tiles
    (rows of unused tiles left unwritten); dst has the sort's rows."""
    num_rows, num_cols = dst.shape
    block_r, block_c = 16, min(256, triton.next_power_of_2(num_cols))
    args = (src, dst, row_scale if row_scale is not None else dst, sort.sorted_pair_ids, sort.tile_expert,
            sort.num_pairs, sort.top_k, num_rows, num_cols, src.stride(0), src.stride(1), dst.stride(0))
    meta = dict(HAS_ROW_SCALE=row_scale is not None, BLOCK_M=sort.block_m, BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=4)
    return Launch(_gather_rows_kernel, (triton.cdiv(num_rows, block_r), triton.cdiv(num_cols, block_c)), args, meta)


def wgrad_launch(a, b, out, sort: ExpertSort, gemm: GemmTiles, group_m: int) -> Launch:
    """``out[e] = A_e^T B_e`` over expert e's sorted rows; out (E, M, N); ``group_m`` output row blocks sweep the
    column blocks together (MoETiles.group_m). One program per (output tile, expert) (``_expert_wgrad_kernel``),
    or with ``gemm.persistent`` = n, n programs per SM looping over the tiles (``_expert_wgrad_persistent_kernel``)."""
    num_experts, M, N = out.shape
    block_m = gemm.block_m or gemm.block_n
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2))
    meta = dict(BLOCK_M=block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k, GROUP_M=group_m, **dot_precision(a),
                num_warps=gemm.num_warps, num_stages=gemm.num_stages)
    tiles_per_expert = triton.cdiv(M, block_m) * triton.cdiv(N, gemm.block_n)
    if gemm.persistent:
        args = (a, b, out, sort.expert_counts, sort.expert_row_start, num_experts, M, N, *strides)
        num_programs = min(gemm.persistent * sm_count(out.device), num_experts * tiles_per_expert)
        return Launch(_expert_wgrad_persistent_kernel, (num_programs,), args,
                      dict(meta, E_POW2=triton.next_power_of_2(num_experts)))
    args = (a, b, out, sort.expert_counts, sort.expert_row_start, M, N, *strides)
    return Launch(_expert_wgrad_kernel, (tiles_per_expert, num_experts), args, meta)


def down_forward_launch(h, w2, out, weights32, sort: ExpertSort, tiles: MoETiles) -> Launch:
    """GEMM2 of the forward in Triton: ``out[token] += weight * h[row] @ w2[e].T`` (tiles.down; ``out`` as
    ``down_combine_launch`` takes it for tiles.combine)."""
    d_model, d_ff = w2.shape[1], w2.shape[2]
    w2_strides = (w2.stride(0), w2.stride(2), w2.stride(1))  # (expert, k = F, n = d)
    return down_combine_launch(h, w2, w2_strides, out, weights32, sort, tiles, tiles.down, d_ff, d_model)


def dx_launch(dgu, w1, dx_out, sort: ExpertSort, tiles: MoETiles) -> Launch:
    """``dx[token] += d(gate, up)[row] @ w1[e]`` (tiles.dx; ``dx_out`` as ``down_combine_launch`` takes it)."""
    two_d_ff, d_model = w1.shape[1], w1.shape[2]
    w1_strides = (w1.stride(0), w1.stride(1), w1.stride(2))  # (expert, k = 2F, n = d)
    return down_combine_launch(dgu, w1, w1_strides, dx_out, None, sort, tiles, tiles.dx, two_d_ff, d_model)


def dw1_launch(dgu, x_sorted, dw1, sort: ExpertSort, tiles: MoETiles) -> Launch:
    """``dw1[e] = d(gate, up)_e^T x_e`` (tiles.dw1); ``x_sorted``: x gathered to the sorted rows."""
    return wgrad_launch(dgu, x_sorted, dw1, sort, tiles.dw1, tiles.group_m)


def dw2_launch(g_sorted, h, dw2, sort: ExpertSort, tiles: MoETiles) -> Launch:
    """``dw2[e] = (weight * dout)_e^T h_e`` (tiles.dw2); ``g_sorted``: weight * dout gathered to the sorted rows."""
    return wgrad_launch(g_sorted, h, dw2, sort, tiles.dw2, tiles.group_m)
