"""What the two hand-written Triton rungs (naive_gpu, tiled_fma) share: tile loads and stores, products on CUDA cores.

A Triton program works on tiles: small 2-D blocks of a tensor held in the registers of its warps. Both rungs load
tiles with masked pointer loads (rows or columns past the end read 0) and multiply them without `tl.dot`, that is
without tensor cores: `fma_dot_t` multiplies two float32 tiles with `tl.dot(..., input_precision="ieee")`, which
the compiler turns into M·N·K fused multiply-adds on the CUDA cores (a broadcast product summed with `tl.sum` may
instead be rewritten into a tf32 tensor-core dot, or mis-compiled at tile sides under 16: it measured wrong on an
H100). That keeps the products in float32 whatever the input dtype, and it is the ceiling of these
rungs: an H200 does about 67 TFLOP/s of float32 FMA against about 989 TFLOP/s of dense bf16 on its tensor cores.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def head_base(X, pid_bh, num_heads, stride_b, stride_h):
    """Pointer to element [b, h, 0, 0] of a (B, H, L, D) tensor for program pid_bh = b·H + h (64-bit offsets:
    B·H·L·D passes 2**31 elements in long runs)."""
    return X + (pid_bh // num_heads).to(tl.int64) * stride_b + (pid_bh % num_heads).to(tl.int64) * stride_h


@triton.jit
def load_f32(base, rows, cols, n_rows, n_cols, stride_row):
    """The tile base[rows, cols] (unit column stride) as float32; rows >= n_rows or cols >= n_cols read 0.
    Row offsets are 64-bit: a materialised Lq x Lk score plane passes 2**31 elements at L = 46341."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    ptrs = base + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_tile(base, rows, cols, n_rows, n_cols, stride_row, tile):
    """base[rows, cols] = tile (converted to base's dtype), where rows < n_rows and cols < n_cols (64-bit rows)."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    ptrs = base + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def fma_dot_t(a, b):
    """a (M, K) times b (N, K) transposed -> (M, N) with float32 operands: M·N·K fused multiply-adds on the CUDA
    cores. `input_precision="ieee"` keeps the products in float32, which the tensor cores do not take (they
    multiply tf32, bf16, fp16 or fp8), so Triton lowers the dot to FMAs. M, N, K >= 16."""
    return tl.dot(a, tl.trans(b), input_precision="ieee")


@triton.jit
def fma_dot(a, b):
    """a (M, K) times b (K, N) -> (M, N) on the CUDA cores in float32, as `fma_dot_t`."""
    return tl.dot(a, b, input_precision="ieee")


def padded(n: int) -> int:
    """Triton tiles have power-of-two sides: a head dim D is covered by the next power of two (at least 16); the
    extra columns are masked (read as 0, never stored)."""
    return max(16, triton.next_power_of_2(n))
