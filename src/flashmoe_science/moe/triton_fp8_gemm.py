"""The FP8 experts' forward in Triton: e4m3 weights in 128x128 blocks, activations in 1x128 groups (``moe/fp8.py``
defines the format). After the token sort (``moe/dispatch.py``, the same as the unquantised layer's), two GEMM
launches over the expert-sorted rows:

- ``_up_swiglu_fp8_kernel``: per 128-wide K block, the gathered x rows are quantised in registers (amax per row,
  scale, e4m3 cast: no quantised copy of x reaches memory) or, with ``Fp8Tiles.quantize_in_gather`` off, read
  from a per-token quantised copy that ``_quantize_groups_kernel`` wrote once (T rows instead of T·k gathered
  rows, and no quantisation repeated by every column block); then ``dot(a, w) * a_scale[row] * w_scale[column]``
  is added to the float32 accumulator: the scales of a K block apply to its partial product, so the sum is exact
  up to the roundings of the format. Gate and up columns are read interleaved as one B tile
  (``triton_gemm._gate_up_columns``). The epilogue computes ``h = silu(gate) * up`` and quantises it per 128
  columns (a column block covers whole groups): e4m3 ``h`` and its scales are all that reach memory.
- ``_down_combine_fp8_kernel``: ``out[token] += weight * (h[row] @ w2[e].T)`` with the same per-K-block scaling,
  the routing weight in the epilogue and float32 atomics for the combine (and for split-K on few tokens), as
  ``triton_gemm._down_combine_kernel``.

Register budget: the K block's partial product and the accumulator are both live (two fp32 tiles), so the tiles
are half the unquantised layer's: 64-row tiles by default (a 64 x (2x128) up tile is 64 registers of fp32 per thread
at 8 warps, twice that with the K step's product); 128-row tiles are candidates of the GPU sweep.

Accuracy: tiles of 16 and 32 rows run mma.sync on e4m3 widened to float16 (exact products, float32 sums); tiles of
64 rows and more run e4m3 wgmma, whose sums inside a 128-wide K block keep ~13-14 bits (DeepSeek-V3's measurement;
the block's product then joins the float32 accumulator, scaled, as in DeepGEMM). h's e4m3 rounding turns that
~1e-3 relative error of gate and up into whole e4m3 steps of a few % of h's elements (tests/moe/fp8_testing.py
quantifies it), about 1% RMS of the output beside the format's own ~6.4%.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from flashmoe_science.device import triton_interpreter_on
from flashmoe_science.moe.dispatch import flat_ids, sort_buffers, sort_launches
from flashmoe_science.moe.fp8_format import BLOCK, FP8, FP8_MAX, SCALE_EPS
from flashmoe_science.moe.gemms import empty
from flashmoe_science.moe.launch import Launch
from flashmoe_science.moe.tiles import GemmTiles, choose_tiles, sm_count, smem_limit, split_k_for
from flashmoe_science.moe.triton_gemm import _gate_up_columns, _row_tile_and_col_block, _tile_rows_and_cols


@triton.jit
def _quantize_rows(values, EPS: tl.constexpr, FP8_LIMIT: tl.constexpr):
    """(rows, 128) float32 -> (e4m3 values, per-row scale): ``scale = max(amax, EPS) / 448``, ``q = e4m3(values /
    scale)``, both divisions rounded to nearest as IEEE float32 (``div_rn``). ``/`` compiles to approximations on
    NVIDIA GPUs (``div.full.f32``, and ``amax * rcp(448)`` for the constant), a few ulp off: enough to move the many
    values that sit exactly on an e4m3 rounding tie (448 x / amax of 16-bit x is a tie for ~0.5% of elements) to
    either side, so that the GPU and the interpreter, or two tile families, would round them differently."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(values), axis=1), EPS), FP8_LIMIT)
    q = tl.clamp(tl.math.div_rn(values, scale[:, None]), -FP8_LIMIT, FP8_LIMIT)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _quantize_groups_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    num_rows,
    num_cols,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_sr,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
    EPS: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
):
    """q, scale = per-row, per-GROUP-column quantisation of x: one (BLOCK_R, GROUP) block per program."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    rows64 = rows.to(tl.int64)
    values = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    q, scale = _quantize_rows(values.to(tl.float32), EPS, FP8_LIMIT)
    tl.store(q_ptr + rows64[:, None] * stride_qr + cols[None, :], q, mask=mask)
    tl.store(scale_ptr + rows64 * stride_sr + group, scale, mask=rows < num_rows)


@triton.jit
def _up_swiglu_fp8_kernel(
    x_ptr,
    x_scale_ptr,
    w1_ptr,
    w1_scale_ptr,
    h_ptr,
    h_scale_ptr,
    sorted_pair_ids_ptr,
    tile_expert_ptr,
    num_pairs,
    top_k,
    d_model,
    d_ff,
    num_row_tiles,
    stride_xt,
    stride_xd,
    stride_xst,
    stride_we,
    stride_wf,
    stride_wd,
    stride_wse,
    stride_wsf,
    stride_wsd,
    stride_hm,
    stride_hsm,
    X_QUANTIZED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EPS: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
):
    """h[row], h_scale[row] = the 1x128 quantisation of silu(gate) * up, gate and up = x[token] @ w1[e]^T with e4m3
    operands and block scales. BLOCK_K is the quantisation group (128); BLOCK_N (gate columns) a multiple of it.
    X_QUANTIZED: x is e4m3 with per-token group scales (else x is quantised here, per K block, as it is loaded)."""
    tile, col_block = _row_tile_and_col_block(tl.program_id(0), num_row_tiles, tl.cdiv(d_ff, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    rows, pairs, row_valid, cols, col_valid = _tile_rows_and_cols(
        tile, col_block, sorted_pair_ids_ptr, num_pairs, d_ff, BLOCK_M, BLOCK_N)
    tokens = tl.where(row_valid, pairs // top_k, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    expert64 = expert.to(tl.int64)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xd
    x_scale_ptrs = x_scale_ptr + tokens * stride_xst
    w_ptrs, w_valid = _gate_up_columns(w1_ptr + expert64 * stride_we, col_block, ks, d_ff, stride_wf, stride_wd,
                                       BLOCK_N)
    # each interleaved column's w1 row (as _gate_up_columns orders them) and its block row of scales
    j = tl.arange(0, 2 * BLOCK_N)
    w_rows = col_block * BLOCK_N + j // 2 + (j % 2) * d_ff
    w_scale_ptrs = w1_scale_ptr + expert64 * stride_wse + (w_rows // BLOCK_K) * stride_wsf
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        if EVEN_K:
            a_mask = row_valid[:, None]
            w = tl.load(w_ptrs, mask=w_valid[None, :], other=0.0)
        else:
            k_valid = (k0 + ks) < d_model
            a_mask = row_valid[:, None] & k_valid[None, :]
            w = tl.load(w_ptrs, mask=k_valid[:, None] & w_valid[None, :], other=0.0)
        if X_QUANTIZED:
            a = tl.load(x_ptrs, mask=a_mask, other=0.0)
            a_scale = tl.load(x_scale_ptrs, mask=row_valid, other=0.0)
        else:
            a, a_scale = _quantize_rows(tl.load(x_ptrs, mask=a_mask, other=0.0).to(tl.float32), EPS, FP8_LIMIT)
        w_scale = tl.load(w_scale_ptrs, mask=w_valid, other=0.0)
        acc += tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])
        x_ptrs += BLOCK_K * stride_xd
        x_scale_ptrs += 1
        w_ptrs += BLOCK_K * stride_wd
        w_scale_ptrs += stride_wsd

    acc_gate, acc_up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up  # columns past F are 0 (their w1 rows load as 0)
    GROUPS: tl.constexpr = BLOCK_N // BLOCK_K
    grouped = tl.reshape(h, [BLOCK_M * GROUPS, BLOCK_K])
    hq, h_scale = _quantize_rows(grouped, EPS, FP8_LIMIT)
    rows64 = rows.to(tl.int64)
    tl.store(h_ptr + rows64[:, None] * stride_hm + cols[None, :], tl.reshape(hq, [BLOCK_M, BLOCK_N]),
             mask=row_valid[:, None] & col_valid[None, :])
    groups = col_block * GROUPS + tl.arange(0, GROUPS)
    tl.store(h_scale_ptr + rows64[:, None] * stride_hsm + groups[None, :], tl.reshape(h_scale, [BLOCK_M, GROUPS]),
             mask=row_valid[:, None] & (groups * BLOCK_K < d_ff)[None, :])


@triton.jit
def _down_combine_fp8_kernel(
    h_ptr,
    h_scale_ptr,
    w2_ptr,
    w2_scale_ptr,
    out_ptr,
    row_scale_ptr,
    sorted_pair_ids_ptr,
    tile_expert_ptr,
    num_pairs,
    top_k,
    K,
    N,
    num_row_tiles,
    stride_hm,
    stride_hsm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """out[token(row), n] += weight[pair(row)] * sum over K blocks of dot(h, w2[e]^T) * h_scale[row] *
    w2_scale[e, n // 128] (float32 atomics). BLOCK_K is the quantisation group (128)."""
    tile, col_block = _row_tile_and_col_block(tl.program_id(0), num_row_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    rows, pairs, row_valid, cols, col_valid = _tile_rows_and_cols(
        tile, col_block, sorted_pair_ids_ptr, num_pairs, N, BLOCK_M, BLOCK_N)
    expert64 = expert.to(tl.int64)
    rows64 = rows.to(tl.int64)

    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    ks = k_begin + tl.arange(0, BLOCK_K)
    # padding rows of h (and their scales) were never written: the row mask keeps them out of the dot
    a_ptrs = h_ptr + rows64[:, None] * stride_hm + ks[None, :]
    a_scale_ptrs = h_scale_ptr + rows64 * stride_hsm + k_begin // BLOCK_K
    b_ptrs = w2_ptr + expert64 * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    b_scale_ptrs = w2_scale_ptr + expert64 * stride_wse + (cols // BLOCK_K) * stride_wsn + (k_begin // BLOCK_K) * stride_wsk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_valid[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_valid[None, :], other=0.0)
        else:
            k_valid = (k0 - k_begin + ks) < k_end
            a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs, mask=row_valid, other=0.0)
        b_scale = tl.load(b_scale_ptrs, mask=col_valid, other=0.0)
        acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
        a_ptrs += BLOCK_K
        a_scale_ptrs += 1
        b_ptrs += BLOCK_K * stride_wk
        b_scale_ptrs += stride_wsk

    acc = acc * tl.load(row_scale_ptr + pairs, mask=row_valid, other=0.0)[:, None]
    tokens = tl.where(row_valid, pairs // top_k, 0).to(tl.int64)
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + cols[None, :]
    tl.atomic_add(out_ptrs, acc, mask=row_valid[:, None] & col_valid[None, :], sem="relaxed")


# -------------------------------------------------------------------------------------------------- tiles
@dataclass(frozen=True)
class Fp8Tiles:
    """The FP8 forward's launch configs. ``up.block_n`` counts gate columns (a multiple of 128: the epilogue
    quantises whole groups of h); both GEMMs step K by 128, one quantisation block per step."""

    block_m: int  # rows per tile of both GEMMs, and the sort's padding
    group_m: int  # row tiles that sweep a column block together (L2 reuse of the expert's weight block)
    up: GemmTiles
    down: GemmTiles
    quantize_in_gather: bool  # x quantised as the up GEMM gathers it (else one quantisation pass over the T tokens)

    def describe(self) -> list[str]:
        x_source = ("x quantised per 1x128 group as it is gathered" if self.quantize_in_gather else
                    "x quantised per token first (triton_fp8_gemm._quantize_groups_kernel), then gathered")
        return [f"up: triton_fp8_gemm._up_swiglu_fp8_kernel, {_label(self.block_m, self.up)}; {x_source}; "
                "h quantised in the SwiGLU epilogue",
                f"down: triton_fp8_gemm._down_combine_fp8_kernel, {_label(self.block_m, self.down)}"]


def _label(block_m: int, gemm: GemmTiles) -> str:
    split = f", split-K {gemm.split_k}" if gemm.split_k > 1 else ""
    return f"{block_m}x{gemm.block_n}x{gemm.block_k} tiles, {gemm.num_warps} warps, {gemm.num_stages} stages{split}"


def _smem_bytes(name: str, block_m: int, gemm: GemmTiles, x_bytes: int) -> int:
    """The operand ring's bytes: the up GEMM's A tile in x's dtype when quantised in the gather (x_bytes), e4m3
    otherwise; its B tile holds 2 x block_n interleaved gate/up columns."""
    if name == "up":
        return gemm.num_stages * (block_m * gemm.block_k * x_bytes + gemm.block_k * 2 * gemm.block_n)
    return gemm.num_stages * (block_m + gemm.block_n) * gemm.block_k


def fit_fp8_tiles(tiles: Fp8Tiles, x_bytes: int, limit: int) -> Fp8Tiles:
    """``tiles`` with fewer pipeline stages (down to 2) where a GEMM's ring exceeds ``limit`` bytes."""
    fitted = {}
    for name in ("up", "down"):
        gemm = getattr(tiles, name)
        a_bytes = x_bytes if name == "up" and tiles.quantize_in_gather else 1
        while gemm.num_stages > 2 and _smem_bytes(name, tiles.block_m, gemm, a_bytes) > limit:
            gemm = replace(gemm, num_stages=gemm.num_stages - 1)
        fitted[name] = gemm
    return replace(tiles, **fitted)


def choose_fp8_tiles(num_tokens: int, top_k: int, num_experts: int, d_model: int, d_ff: int, device,
                     x_bytes: int = 2) -> Fp8Tiles:
    """The FP8 forward's tiles for these dims on ``device`` (``fp8_tile_candidates`` lists the alternatives a GPU
    sweep compares).

    Few rows per expert (<= 32: decode and small batches) stream the expert weights: the unquantised layer's row
    tile, a deep pipeline, split-K for the down GEMM where its programs would not cover the GPU, and x quantised
    in the gather (no extra launch: the GEMMs are bound by the weights' bytes). More rows: 64-row tiles (the
    register budget of the module docstring), 8 warps, x quantised once per token before the up GEMM so that the
    column blocks (112 at Mixtral's F) do not each quantise the same rows again."""
    if triton_interpreter_on():
        # the interpreter runs each program in numpy: few, small programs keep CPU tests quick
        return Fp8Tiles(block_m=16, group_m=4, up=GemmTiles(block_n=BLOCK, block_k=BLOCK, num_warps=4, num_stages=1),
                        down=GemmTiles(block_n=32, block_k=BLOCK, num_warps=4, num_stages=1), quantize_in_gather=True)
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 32:
        block_m = choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, device).block_m
        up = GemmTiles(block_n=BLOCK, block_k=BLOCK, num_warps=4, num_stages=4)
        down = split_k_for(GemmTiles(block_n=64, block_k=BLOCK, num_warps=4, num_stages=5),
                           min(num_experts, num_tokens * top_k), d_ff, d_model, sm_count(device))
        tiles = Fp8Tiles(block_m, 8, up, down, quantize_in_gather=True)
    else:
        tiles = Fp8Tiles(64, 8, up=GemmTiles(block_n=BLOCK, block_k=BLOCK, num_warps=8, num_stages=3),
                         down=GemmTiles(block_n=256, block_k=BLOCK, num_warps=8, num_stages=3),
                         quantize_in_gather=False)
    return fit_fp8_tiles(tiles, x_bytes, smem_limit(device))


def fp8_tile_candidates(num_tokens: int, top_k: int, num_experts: int, d_model: int, d_ff: int, device,
                        x_bytes: int = 2) -> dict[str, Fp8Tiles]:
    """``choose_fp8_tiles``' choice ("default") and the alternatives a GPU sweep times beside it (bench/moe.py,
    ``run_fp8_tile_sweep``): where x is quantised, deeper pipelines, narrower down tiles and, past 48 rows per
    expert, 128-row tiles."""
    default = choose_fp8_tiles(num_tokens, top_k, num_experts, d_model, d_ff, device, x_bytes)
    limit = smem_limit(device)
    deeper = replace(default, up=replace(default.up, num_stages=default.up.num_stages + 1),
                     down=replace(default.down, num_stages=default.down.num_stages + 1))
    candidates = {
        "default": default,
        "x-quantised-" + ("first" if default.quantize_in_gather else "in-gather"):
            replace(default, quantize_in_gather=not default.quantize_in_gather),
        "one-more-stage": deeper,
    }
    if default.block_m >= 64:
        candidates["down-64x128-4warps"] = replace(default, down=GemmTiles(block_n=128, block_k=BLOCK, num_warps=4,
                                                                           num_stages=4))
        # vLLM's / DeepGEMM's block-FP8 tile: 128 rows, 128-wide K steps scaled into float32 (sm_90 offline builds,
        # triton 3.9: down 128x128 w8 s4 255 registers, no spills; up 128x(2x128) w8 s3 spills ~100 LDL/STL,
        # at 16 warps ~200, since the K step's product and the accumulator are two 128x256 float32 tiles)
        down128 = GemmTiles(block_n=128, block_k=BLOCK, num_warps=8, num_stages=4)
        candidates["rows-128"] = replace(default, block_m=128, up=replace(default.up, num_warps=8, num_stages=3),
                                         down=down128)
        candidates["rows-128-up-16warps"] = replace(default, block_m=128, up=replace(default.up, num_warps=16,
                                                                                     num_stages=4), down=down128)
    return {name: fit_fp8_tiles(tiles, x_bytes, limit) for name, tiles in candidates.items()}


# ----------------------------------------------------------------------------------------------- launches
def quantize_groups_launch(x, q, scale) -> Launch:
    """q (T, d) e4m3, scale (T, ceil(d/128)) float32 = x's per-token-group quantisation."""
    num_rows, num_cols = x.shape
    block_r = 32
    args = (x, q, scale, num_rows, num_cols, x.stride(0), x.stride(1), q.stride(0), scale.stride(0))
    meta = dict(BLOCK_R=block_r, GROUP=BLOCK, EPS=SCALE_EPS, FP8_LIMIT=FP8_MAX, num_warps=4)
    return Launch(_quantize_groups_kernel, (triton.cdiv(num_rows, block_r), triton.cdiv(num_cols, BLOCK)), args, meta)


def up_swiglu_fp8_launch(x, x_scale, w1, w1_scale, h, h_scale, sort, tiles: Fp8Tiles) -> Launch:
    """h, h_scale (sorted rows) from x (e4m3 with its scales, or unquantised with ``x_scale`` None) and w1."""
    d_model = x.shape[1]
    d_ff = w1.shape[1] // 2
    num_row_tiles = sort.tile_expert.numel()
    gemm = tiles.up
    quantized = x_scale is not None
    args = (x, x_scale if quantized else h_scale, w1, w1_scale, h, h_scale, sort.sorted_pair_ids, sort.tile_expert,
            sort.num_pairs, sort.top_k, d_model, d_ff, num_row_tiles, x.stride(0), x.stride(1),
            x_scale.stride(0) if quantized else 0, w1.stride(0), w1.stride(1), w1.stride(2), w1_scale.stride(0),
            w1_scale.stride(1), w1_scale.stride(2), h.stride(0), h_scale.stride(0))
    meta = dict(X_QUANTIZED=quantized, BLOCK_M=tiles.block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k,
                GROUP_M=tiles.group_m, EVEN_K=d_model % gemm.block_k == 0, EPS=SCALE_EPS, FP8_LIMIT=FP8_MAX,
                num_warps=gemm.num_warps, num_stages=gemm.num_stages)
    return Launch(_up_swiglu_fp8_kernel, (num_row_tiles * triton.cdiv(d_ff, gemm.block_n),), args, meta)


def down_combine_fp8_launch(h, h_scale, w2, w2_scale, out32, weights32, sort, tiles: Fp8Tiles) -> Launch:
    """out32[token] += weight * dequantised(h[row]) @ dequantised(w2[e]).T."""
    d_model, d_ff = w2.shape[1], w2.shape[2]
    num_row_tiles = sort.tile_expert.numel()
    gemm = tiles.down
    args = (h, h_scale, w2, w2_scale, out32, weights32, sort.sorted_pair_ids, sort.tile_expert, sort.num_pairs,
            sort.top_k, d_ff, d_model, num_row_tiles, h.stride(0), h_scale.stride(0), w2.stride(0), w2.stride(1),
            w2.stride(2), w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2), out32.stride(0))
    meta = dict(BLOCK_M=tiles.block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k, GROUP_M=tiles.group_m,
                SPLIT_K=gemm.split_k, EVEN_K=d_ff % (gemm.block_k * gemm.split_k) == 0,
                num_warps=gemm.num_warps, num_stages=gemm.num_stages)
    return Launch(_down_combine_fp8_kernel, (num_row_tiles * triton.cdiv(d_model, gemm.block_n), gemm.split_k), args,
                  meta)


def check_fp8_tiles(tiles: Fp8Tiles) -> None:
    """The kernels' constraints on a tile config (the sweep passes its own)."""
    if tiles.up.block_k != BLOCK or tiles.down.block_k != BLOCK:
        raise ValueError(f"FP8 tiles must step K by the quantisation block {BLOCK}, got up.block_k="
                         f"{tiles.up.block_k}, down.block_k={tiles.down.block_k}")
    if tiles.up.block_n % BLOCK:
        raise ValueError(f"FP8 tiles: up.block_n must be a multiple of {BLOCK} (the epilogue quantises whole groups "
                         f"of h), got {tiles.up.block_n}")


def fp8_up(x, w1, w1_scale, topk_ids, tiles: Fp8Tiles):
    """The FP8 forward's first stage on checked tensors with T >= 1: the sort, (the quantisation of x,) and the up
    GEMM. Returns ``(sort, h, h_scale)``: e4m3 ``h (rows, F)`` and its 1x128 scales ``(rows, ceil(F/128))``, one row
    per sorted (token, slot) pair (``sort.sorted_pair_ids``; padding rows are not written)."""
    check_fp8_tiles(tiles)
    num_tokens, d_model = x.shape
    num_experts, two_d_ff, _ = w1.shape
    d_ff = two_d_ff // 2
    device = x.device
    sort, chunk_counts, chunk_row_base = sort_buffers(num_tokens, topk_ids.shape[1], num_experts, tiles.block_m,
                                                      device)
    num_rows = sort.tile_expert.numel() * tiles.block_m
    h = empty((num_rows, d_ff), FP8, device)
    h_scale = empty((num_rows, triton.cdiv(d_ff, BLOCK)), torch.float32, device)
    launches = list(sort_launches(flat_ids(topk_ids), sort, chunk_counts, chunk_row_base))
    x_in, x_scale = x, None
    if not tiles.quantize_in_gather:
        x_in = empty(x.shape, FP8, device)
        x_scale = empty((num_tokens, triton.cdiv(d_model, BLOCK)), torch.float32, device)
        launches.append(quantize_groups_launch(x, x_in, x_scale))
    launches.append(up_swiglu_fp8_launch(x_in, x_scale, w1, w1_scale, h, h_scale, sort, tiles))
    for launch in launches:
        launch()
    return sort, h, h_scale


def fp8_down(h, h_scale, w2, w2_scale, weights32, sort, tiles: Fp8Tiles, num_tokens: int) -> torch.Tensor:
    """The second stage: ``out32 (T, d)`` float32, the routing-weighted combine of ``h @ w2[e].T`` per sorted row."""
    out32 = torch.zeros((num_tokens, w2.shape[1]), dtype=torch.float32, device=h.device)
    down_combine_fp8_launch(h, h_scale, w2, w2_scale, out32, weights32, sort, tiles)()
    return out32


def fp8_forward(x, w1, w1_scale, w2, w2_scale, weights32, topk_ids, tiles: Fp8Tiles) -> torch.Tensor:
    """The FP8 experts on checked tensors (weights32 (T, k) contiguous float32): ``fp8_up`` then ``fp8_down``;
    returns (T, d) in x's dtype."""
    if x.shape[0] == 0:
        check_fp8_tiles(tiles)
        return x.new_empty((0, x.shape[1]))
    sort, h, h_scale = fp8_up(x, w1, w1_scale, topk_ids, tiles)
    return fp8_down(h, h_scale, w2, w2_scale, weights32, sort, tiles, x.shape[0]).to(x.dtype)
