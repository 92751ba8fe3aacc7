"""The rotary embedding as one Triton launch (forward and backward): eager mode on the GPU otherwise spends about
eight elementwise kernels per tensor on it (chunk, four products, two sums, a concatenation), and as many again in
the backward. Under torch.compile the PyTorch version runs instead: inductor fuses it into the surrounding kernels.

One program rotates one (batch, position) row of BLOCK_H heads: it loads the row's cos and sin once, the two halves
of each head, and writes ``(x1 cos - x2 sin, x2 cos + x1 sin)`` in float32 arithmetic. The backward is the rotation
by the opposite angle (``SIGN=-1``: the rotation is orthogonal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, seqlen, heads,
                   stride_xb, stride_xl, stride_xh, stride_ob, stride_ol, stride_oh, stride_cb, stride_cl,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, SIGN: tl.constexpr):
    row = tl.program_id(0)
    batch, position = row // seqlen, row % seqlen
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col = tl.arange(0, BLOCK_HALF)
    col_ok = col < HALF
    angle_offsets = batch * stride_cb + position * stride_cl + col
    cos = tl.load(cos_ptr + angle_offsets, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin = SIGN * tl.load(sin_ptr + angle_offsets, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    ok = (head < heads)[:, None] & col_ok[None, :]
    x = x_ptr + batch * stride_xb + position * stride_xl + head[:, None] * stride_xh + col[None, :]
    first = tl.load(x, mask=ok, other=0.0).to(tl.float32)
    second = tl.load(x + HALF, mask=ok, other=0.0).to(tl.float32)
    out = out_ptr + batch * stride_ob + position * stride_ol + head[:, None] * stride_oh + col[None, :]
    tl.store(out, (first * cos - second * sin).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + HALF, (second * cos + first * sin).to(out_ptr.dtype.element_ty), mask=ok)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int = 1) -> torch.Tensor:
    """``x (B, L, H, D)`` (unit last stride) rotated by the angles of ``cos``/``sin`` ``(L, D/2)`` or
    ``(B, L, D/2)`` (contiguous), by minus them with ``sign=-1``; a new tensor of x's shape and dtype."""
    batch, seqlen, heads, head_dim = x.shape
    out = torch.empty((batch, seqlen, heads, head_dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    stride_cb = cos.stride(0) if cos.dim() == 3 else 0
    block_h = min(triton.next_power_of_2(heads), 16)
    grid = (batch * seqlen, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](x, cos, sin, out, seqlen, heads, x.stride(0), x.stride(1), x.stride(2),
                         out.stride(0), out.stride(1), out.stride(2), stride_cb, cos.stride(-2),
                         HALF=head_dim // 2, BLOCK_HALF=triton.next_power_of_2(head_dim // 2), BLOCK_H=block_h,
                         SIGN=sign)
    return out


class RotaryTriton(torch.autograd.Function):
    """``rotate`` with its backward (the opposite rotation of the output's gradient); the angles get no gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        return rotate(grad_out, cos, sin, sign=-1), None, None
