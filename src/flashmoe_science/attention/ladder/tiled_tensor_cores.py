"""Rung 3, tiled_tensor_cores: the same tiled online softmax, its two products on tensor cores.

This is the library's portable Triton kernel (`attention/triton/fwd.py`), called through the front door with
``backend="triton"``. Its inner loop is the loop of `tiled_fma`, with the two products written as ``tl.dot``:

    s   = tl.dot(q, tl.trans(k))                 # 16-bit operands, float32 accumulator: tensor cores
    ...   the same online softmax, in base 2 ...
    acc = tl.dot(p.to(v.dtype), v, acc)          # P is rounded to the input dtype for the second product

A tensor core multiplies small matrix tiles in one instruction (mma on Ampere, wgmma on Hopper), so the products
no longer occupy the CUDA cores: the ceiling moves from ~67 TFLOP/s of float32 FMA to ~989 TFLOP/s of dense
bf16/fp16 on an H200, and the operands need far fewer registers, so the tiles can be larger (64 x 64 at D = 128
on an H200, see `attention.tiles.forward_tiles`, instead of 32 x 4), which halves the re-reads of K and V from L2.
The kernel also adds what a production kernel needs: tiles chosen per GPU and head dim, TMA loads on Hopper,
unmasked loops over full tiles, the heaviest causal tiles launched first. The softmax itself (max, exp2, sums,
rescale) still runs on the CUDA cores, in the same instruction stream as the products, waiting for each product
before it can start: that is what the next rung overlaps.
"""

from __future__ import annotations

import torch

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.ladder.inputs import check_inputs


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v by the portable Triton kernel (CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1)."""
    scale = check_inputs(q, k, v, softmax_scale)
    return flash_attention_science(q, k, v, causal=bool(causal), softmax_scale=scale, backend="triton")
