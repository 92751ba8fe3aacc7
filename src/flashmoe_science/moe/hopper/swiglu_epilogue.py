"""The SwiGLU backward in the epilogue of dx_sm90's dh GEMM (SWIGLU_BWD): the producer's loads of the forward's
gate, up and h beside each item's last K step, the fast sigmoid, and d(gate, up) and the routing-weight gradient
computed chunk by chunk from the accumulator (dh never reaches memory); on the host, the operands and their checks.
See dx_sm90's docstring for the protocol; Gluon inlines these helpers into the kernel."""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashmoe_science.gluon.sm90 import column_halves, wgmma_layout
from flashmoe_science.gluon.compat import fence_async_shared, gl, gluon, mbarrier, tma
from flashmoe_science.moe.dispatch import ExpertSort
from flashmoe_science.moe.hopper.dx_configs import DxConfig


@gluon.jit
def load_swiglu_operands(gate_up_desc, h_desc, epi_smem, epi_ready, epi_empty, epi_items, row, col, N):
    """The producer's epilogue step: once the previous item's epilogue has released the buffers (its TMA stores have
    read them), TMA the item's gate, up and h boxes, chunk by chunk, all completing on ``epi_ready``. Issued after
    the item's K steps: the other ping-pong consumer's epilogue is long done by then, and the boxes land while this
    item's last wgmmas run."""
    COLS: gl.constexpr = gate_up_desc.block_type.shape[1]
    CHUNKS: gl.constexpr = epi_smem.type.shape[0] // 3
    # barriers start "phase 1 complete": the first item does not wait
    mbarrier.wait(epi_empty, (epi_items & 1) ^ 1)
    mbarrier.expect(epi_ready, CHUNKS * (2 * gate_up_desc.block_type.nbytes + h_desc.block_type.nbytes))
    for c in gl.static_range(CHUNKS):
        tma.async_load(gate_up_desc, [row, col + c * COLS], epi_ready, epi_smem.index(3 * c))
        tma.async_load(gate_up_desc, [row, N + col + c * COLS], epi_ready, epi_smem.index(3 * c + 1))
        tma.async_load(h_desc, [row, col + c * COLS], epi_ready, epi_smem.index(3 * c + 2))


@gluon.jit
def _fast_sigmoid(x):
    """1 / (1 + 2^(-x log2 e)) with the approximate ex2 and reciprocal (MUFU, flush-to-zero): 2-ulp float32, within
    the output's bf16/fp16 rounding. The IEEE expression (``tl.sigmoid``'s, what _swiglu_backward_kernel computes)
    carries denormal and range fix-ups around both MUFU ops; in this epilogue, run by one warpgroup beside the other
    one's wgmmas, it cost more than the GEMM could hide (Mixtral T=4096: 1.96 vs 1.73 ms; Qwen3: 0.46 vs 0.28 ms)."""
    return gl.inline_asm_elementwise(
        "{ .reg .f32 t; ex2.approx.ftz.f32 t, $1; add.ftz.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }",
        "=r,r", [x * -1.4426950408889634], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def swiglu_backward_columns(dh, CHUNK0: gl.constexpr, valid, scale, epi_smem, dgu_desc, row, col, N):
    """The SwiGLU backward of a tile of dh (float32, accumulator layout) whose first column is chunk CHUNK0 of the
    item's epilogue buffers, one chunk (COLS columns) at a time (halving the tile until it is that wide: the chunk's
    gate, up and h must fit beside the accumulator in registers). Each chunk's d(gate, up) (zeros in padding rows)
    overwrites its gate and up buffers and leaves by TMA store at once (the stores overlap the next chunk's work);
    returns the rows' partial routing-weight gradients sum_cols dh * h."""
    COLS: gl.constexpr = dgu_desc.block_type.shape[1]
    if dh.shape[1] > COLS:
        left, right = column_halves(dh)
        return (swiglu_backward_columns(left, CHUNK0, valid, scale, epi_smem, dgu_desc, row, col, N)
                + swiglu_backward_columns(right, CHUNK0 + dh.shape[1] // 2 // COLS, valid, scale, epi_smem,
                                           dgu_desc, row, col, N))
    else:
        layout: gl.constexpr = wgmma_layout(COLS)
        dh = gl.convert_layout(dh, layout)  # the layout column_halves produced, named (no data moves)
        gate_smem = epi_smem.index(3 * CHUNK0)
        up_smem = epi_smem.index(3 * CHUNK0 + 1)
        row_valid = gl.expand_dims(valid, 1)
        # padding rows: zeros out, whatever their dh and saved operands hold (the gathered copy's padding rows and
        # gate_up's are never written: NaN * 0 would be NaN)
        gate = gl.where(row_valid, gate_smem.load(layout).to(gl.float32), 0.0)
        up = gl.where(row_valid, up_smem.load(layout).to(gl.float32), 0.0)
        h = epi_smem.index(3 * CHUNK0 + 2).load(layout).to(gl.float32)
        # the routing weight's gradient: dout[token] . (h @ w2[e].T) = dh . h (padding rows: masked by the caller)
        dscale = gl.sum(dh * h, axis=1)
        dh = gl.where(row_valid, dh * gl.expand_dims(scale, 1), 0.0)
        sig = _fast_sigmoid(gate)
        dtype: gl.constexpr = dgu_desc.dtype
        # in place: every value is read and rewritten by the same thread
        gate_smem.store((dh * up * sig * (1.0 + gate * (1.0 - sig))).to(dtype))
        up_smem.store((dh * (gate * sig)).to(dtype))
        fence_async_shared()  # the generic-proxy writes before the TMA engine reads them
        tma.async_store(dgu_desc, [row, col + CHUNK0 * COLS], gate_smem)
        tma.async_store(dgu_desc, [row, N + col + CHUNK0 * COLS], up_smem)
        return dscale



class SwigluOperands(NamedTuple):
    """SWIGLU_BWD's operands beside the GEMM's (as ``triton_gemm.swiglu_backward_launch`` takes them)."""

    gate_up: torch.Tensor  # (sort rows, 2F) the forward's saved pre-activations [gate | up], w2's dtype
    h: torch.Tensor  # (sort rows, F) the forward's SwiGLU output, w2's dtype
    row_scale: torch.Tensor  # (T, k) float32 contiguous: the routing weights, read at the rows' pair ids
    dscale: torch.Tensor  # (T, k) float32 contiguous, zeroed by the caller: per-column-block partial sums land here


def swiglu_reason(swiglu, w, dgu, sort: ExpertSort, num_rows: int, config: DxConfig) -> str | None:
    """Why SWIGLU_BWD's own operands do not fit (see SwigluOperands), or None."""
    if not isinstance(swiglu, SwigluOperands):
        return f"dh_swiglu_sm90: needs SwigluOperands (gate_up, h, row_scale, dscale), got {type(swiglu).__name__}"
    d_ff = w.shape[2]
    for name, t, cols, cols_name in (("gate_up", swiglu.gate_up, 2 * d_ff, "2F"), ("h", swiglu.h, d_ff, "F")):
        if t.shape != (num_rows, cols) or t.dtype != w.dtype or t.stride(1) != 1:
            return (f"dh_swiglu_sm90: {name} must be (sort rows, {cols_name}) = ({num_rows}, {cols}) in w2's dtype "
                    f"{w.dtype} with unit last stride, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    for name, t in (("row_scale", swiglu.row_scale), ("dscale", swiglu.dscale)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != sort.num_pairs:
            return (f"dh_swiglu_sm90: {name} must be float32, contiguous, one value per (token, slot) pair "
                    f"({sort.num_pairs}), got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()}")
    if d_ff % config.block_n:
        # the epilogue's gate box at the last column block would reach into up's columns
        return (f"dh_swiglu_sm90: F = {d_ff} must be a multiple of block_n = {config.block_n} (the epilogue moves "
                f"whole column blocks of [gate | up] by TMA); use dh_launch and swiglu_backward_launch")
    for name, t in (("gate_up", swiglu.gate_up), ("h", swiglu.h), ("dgu", dgu)):
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return (f"dh_swiglu_sm90: TMA needs {name}'s rows and base address 16-byte aligned, got strides "
                    f"{t.stride()}")
    return None
