"""Rung 2, tiled_fma: one kernel, the scores never leave the chip (FlashAttention's online softmax, on CUDA cores).

One program owns BLOCK_M query rows of one head and keeps them, and their running output, in registers. It walks
the keys BLOCK_N at a time; each key tile's scores exist only in registers, and are folded into the output at once:

    s     = q kᵀ · scale · log2(e)                   (BLOCK_M x BLOCK_N, in registers only)
    m_new = max(m, rowmax(s))                        running row max
    p     = exp2(s - m_new)                          this tile's unnormalised probabilities
    alpha = exp2(m - m_new)                          how much the old max overestimated the new one
    l     = l · alpha + rowsum(p)                    running denominator
    acc   = acc · alpha + p v                        running numerator, rescaled to the new max
    ...   after the last tile: out = acc / l

The rescaling by alpha is what lets softmax be computed in one pass: the numerator and the denominator carry the
same factor exp(-m), so whenever the max grows both are corrected by exp(m_old - m_new), and the result is exact
(`attention.reference.attention_tiled` is the same loop in PyTorch). Base 2 with log2(e) folded into the scale
saves a multiply per score (exp2 is the hardware's native exponential).

Against `naive_gpu`: HBM traffic falls from 24 bytes per score to reading Q, K, V and writing O once (K and V are
re-read by every query tile, but from L2), and memory from O(L²) to O(L): nothing to refuse at any L. With causal
masking, key tiles past the last row's diagonal are never loaded. The products are the same float32 FMAs
(`triton_tiles`), so what this rung gains over the naive one is the memory traffic alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashmoe_science.attention.ladder.inputs import check_inputs
from flashmoe_science.attention.ladder.triton_tiles import (fma_dot, fma_dot_t, head_base, load_f32, padded,
                                                             store_tile)

LOG2_E = 1.4426950408889634
BLOCK_M = 32  # query rows per program
NUM_WARPS = 8


@triton.jit
def _tiled_fma_kernel(Q, K, V, O, num_heads, seqlen_q, seqlen_k, qk_scale,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    q = load_f32(head_base(Q, pid_bh, num_heads, stride_qb, stride_qh), rows, cols, seqlen_q, HEAD_DIM, stride_qm)
    k_base = head_base(K, pid_bh, num_heads, stride_kb, stride_kh)
    v_base = head_base(V, pid_bh, num_heads, stride_vb, stride_vh)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    diagonal = seqlen_k - seqlen_q  # query i sees key j iff j <= i + diagonal (bottom-right causal)
    key_end = seqlen_k
    if CAUSAL:  # no row of this tile sees a key past its last row's diagonal: never load those tiles
        key_end = tl.minimum(seqlen_k, pid_m * BLOCK_M + BLOCK_M + diagonal)
    for start_n in range(0, key_end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = load_f32(k_base, keys, cols, seqlen_k, HEAD_DIM, stride_kn)
        v = load_f32(v_base, keys, cols, seqlen_k, HEAD_DIM, stride_vn)
        s = fma_dot_t(q, k) * qk_scale
        seen = keys[None, :] < seqlen_k
        if CAUSAL:
            seen = seen & (keys[None, :] <= rows[:, None] + diagonal)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2 gives 0, not NaN
        p = tl.math.exp2(s - shift[:, None])
        alpha = tl.math.exp2(m - shift)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + fma_dot(p, v)
        m = m_new

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # a row that saw no key keeps acc = 0
    store_tile(head_base(O, pid_bh, num_heads, stride_ob, stride_oh), rows, cols, seqlen_q, HEAD_DIM, stride_om, out)


def block_n(block_d: int) -> int:
    """Keys per tile: 32 up to D = 64, 16 above (a dot's sides are at least 16). Without tensor cores the float32
    operands of both products sit in registers and shared memory: (32 + 2·BLOCK_N)·D floats per program."""
    return 32 if block_d <= 64 else 16


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v in one launch: tiled online softmax, float32 FMA products."""
    scale = check_inputs(q, k, v, softmax_scale)
    b, h, lq, d = q.shape
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    block_d = padded(d)
    _tiled_fma_kernel[(triton.cdiv(lq, BLOCK_M), b * h)](
        q, k, v, out, h, lq, k.shape[2], scale * LOG2_E,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=bool(causal), BLOCK_M=BLOCK_M, BLOCK_N=block_n(block_d),
        num_warps=NUM_WARPS)
    return out
