"""Rung 1, naive_gpu: the definition moved to the GPU as three kernels, the scores in global memory between them.

    kernel 1  S = Q Kᵀ · scale       one program per (32 x 32) tile of S: writes Lq·Lk float32 per head
    kernel 2  P = softmax(S)          one program per row: reads the row three times (max, sum, normalise), writes P
    kernel 3  O = P V                 one program per (32 x 32) tile of O: reads P and V

Each kernel is embarrassingly parallel, so the GPU's thousands of threads are busy, and this rung is already far
faster than the CPU. But the Lq x Lk matrix lives in HBM between the launches: per score, 4 bytes written by
kernel 1, 12 read and 4 written by kernel 2 (P overwrites S), and 4 read by kernel 3, 24 bytes in all, against
4·D FLOPs of products. And it must fit: at L = 16384 with B·H = 16 the scores take 16 GiB, which is why the rung
refuses, before allocating, a problem whose scores exceed the GPU's free memory.

The products run on the CUDA cores in float32 (`triton_tiles.fma_dot_t`, no tensor cores), like the next rung's,
so that the step from this rung to `tiled_fma` changes one thing only: where the scores live.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashmoe_science.attention.ladder.inputs import check_inputs
from flashmoe_science.attention.ladder.triton_tiles import fma_dot, fma_dot_t, head_base, load_f32, store_tile

BLOCK_M = 32  # query rows per program (kernels 1 and 3)
BLOCK_N = 32  # keys per program (kernel 1)
BLOCK_K = 16  # the reduction dim's chunk (a dot's sides are at least 16)
BLOCK_D = 32  # output columns per program (kernel 3)
SOFTMAX_CHUNK = 1024  # row elements per step of kernel 2
SCORE_BYTES = 4  # float32


@triton.jit
def _scores_kernel(Q, K, S, num_heads, seqlen_q, seqlen_k, scale,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """S[bh, rows, cols] = scale · Q[bh, rows] K[bh, cols]ᵀ, masked keys -inf."""
    pid_m, pid_n, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    q_base = head_base(Q, pid_bh, num_heads, stride_qb, stride_qh)
    k_base = head_base(K, pid_bh, num_heads, stride_kb, stride_kh)
    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, HEAD_DIM, BLOCK_K):
        d = d0 + tl.arange(0, BLOCK_K)
        s += fma_dot_t(load_f32(q_base, rows, d, seqlen_q, HEAD_DIM, stride_qm),
                       load_f32(k_base, cols, d, seqlen_k, HEAD_DIM, stride_kn))
    s = s * scale
    if CAUSAL:  # bottom-right aligned: query i sees key j iff j <= i + Lk - Lq
        s = tl.where(cols[None, :] <= rows[:, None] + (seqlen_k - seqlen_q), s, float("-inf"))
    store_tile(S + pid_bh.to(tl.int64) * seqlen_q * seqlen_k, rows, cols, seqlen_q, seqlen_k, seqlen_k, s)


@triton.jit
def _softmax_kernel(S, seqlen_k, CHUNK: tl.constexpr):
    """One row of S -> softmax, in place: pass 1 finds the max, pass 2 sums exp(s - max), pass 3 writes P."""
    row = S + tl.program_id(0).to(tl.int64) * seqlen_k
    running_max = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    for start in range(0, seqlen_k, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        running_max = tl.maximum(running_max, tl.load(row + cols, mask=cols < seqlen_k, other=float("-inf")))
    row_max = tl.max(running_max, 0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row that sees no key: exp gives 0, not NaN
    running_sum = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, seqlen_k, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        running_sum += tl.exp(tl.load(row + cols, mask=cols < seqlen_k, other=float("-inf")) - row_max)
    row_sum = tl.sum(running_sum, 0)
    inv_sum = tl.where(row_sum == 0.0, 0.0, 1.0 / row_sum)  # ... and its P row is all zeros
    for start in range(0, seqlen_k, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        s = tl.load(row + cols, mask=cols < seqlen_k, other=float("-inf"))
        tl.store(row + cols, tl.exp(s - row_max) * inv_sum, mask=cols < seqlen_k)


@triton.jit
def _pv_kernel(P, V, O, num_heads, seqlen_q, seqlen_k,
               stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """O[bh, rows, cols] = P[bh, rows] V[bh, :, cols], summed over the keys BLOCK_K at a time."""
    pid_m, pid_d, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    plane = P + pid_bh.to(tl.int64) * seqlen_q * seqlen_k
    v_base = head_base(V, pid_bh, num_heads, stride_vb, stride_vh)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, seqlen_k, BLOCK_K):
        keys = k0 + tl.arange(0, BLOCK_K)
        acc += fma_dot(load_f32(plane, rows, keys, seqlen_q, seqlen_k, seqlen_k),
                       load_f32(v_base, keys, cols, seqlen_k, HEAD_DIM, stride_vn))
    store_tile(head_base(O, pid_bh, num_heads, stride_ob, stride_oh), rows, cols, seqlen_q, HEAD_DIM, stride_om, acc)


def scores_bytes(q: torch.Tensor, k: torch.Tensor) -> int:
    """Bytes of the materialised float32 scores: B·H·Lq·Lk·4."""
    b, h, lq, _ = q.shape
    return b * h * lq * k.shape[2] * SCORE_BYTES


def free_gpu_bytes(device: torch.device) -> int:
    """What an allocation on `device` can get: the driver's free memory plus what PyTorch's caching allocator holds
    reserved but unused."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_scores_fit(q: torch.Tensor, k: torch.Tensor, free_bytes: int) -> None:
    """ValueError naming L and the bytes needed where the scores would not fit in `free_bytes`."""
    needed = scores_bytes(q, k)
    if needed > free_bytes:
        b, h, lq, _ = q.shape
        raise ValueError(f"naive_gpu: L = {lq} x {k.shape[2]} (B·H = {b * h}) needs {needed} bytes "
                         f"({needed / 2**30:.1f} GiB) of float32 scores, {free_bytes / 2**30:.1f} GiB free on the GPU")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v in three launches with the Lq x Lk float32 scores in global memory."""
    scale = check_inputs(q, k, v, softmax_scale)
    b, h, lq, d = q.shape
    lk = k.shape[2]
    out = torch.empty_like(q)
    if out.numel() == 0 or lk == 0:
        return out.zero_()
    if q.is_cuda:
        check_scores_fit(q, k, free_gpu_bytes(q.device))
    scores = torch.empty(b * h, lq, lk, device=q.device, dtype=torch.float32)
    _scores_kernel[(triton.cdiv(lq, BLOCK_M), triton.cdiv(lk, BLOCK_N), b * h)](
        q, k, scores, h, lq, lk, scale, *q.stride()[:3], *k.stride()[:3],
        HEAD_DIM=d, CAUSAL=bool(causal),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    _softmax_kernel[(b * h * lq,)](scores, lk, CHUNK=SOFTMAX_CHUNK, num_warps=4)
    _pv_kernel[(triton.cdiv(lq, BLOCK_M), triton.cdiv(d, BLOCK_D), b * h)](
        scores, v, out, h, lq, lk, *v.stride()[:3], *out.stride()[:3],
        HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K, num_warps=4)
    return out
