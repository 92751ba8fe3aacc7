"""Rung 0, cpu: the definition, on the CPU.

    S = Q Kᵀ · scale          (Lq x Lk scores per head, all of them, in memory)
    P = softmax(S) row-wise   (subtract the row max first, so exp never overflows)
    O = P V

This is `attention.reference.attention_reference`, the library's specification and test oracle: a handful of
PyTorch calls, each a full pass over the Lq x Lk matrix in float32 (PyTorch's CPU matmul does the products with
SIMD FMA on every core). It is the baseline every later rung is measured against, and it shows the two costs
the GPU rungs attack: the FLOPs (4·Lq·Lk·D per head) and the memory the scores take (4·Lq·Lk bytes per head,
and PyTorch's eager ops make several passes over them).
"""

from __future__ import annotations

import torch

from flashmoe_science.attention.ladder.inputs import check_inputs
from flashmoe_science.attention.reference import attention_reference


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v by the reference, on CPU tensors (a CUDA tensor is refused: this rung is the CPU)."""
    scale = check_inputs(q, k, v, softmax_scale)
    if q.device.type != "cpu":
        raise ValueError(f"the cpu rung takes CPU tensors, got q on {q.device}")
    out, _ = attention_reference(q, k, v, bool(causal), scale)
    return out
