"""FP8 (e4m3) kernels in Triton for Hopper: the fused quantisation (Hadamard rotation, amax, scale, cast, and the
K-major transpose of V) and the attention forward with e4m3 tensor-core products and float32 accumulation.

The forward is the dense Triton kernel's algorithm (fwd.py: FlashAttention-2 work split, online softmax in
base 2, masks from attention/mask.py) with three differences:
- the q and k descales are folded into the softmax multiplier (one scalar per program: free);
- P is rounded to e4m3 in registers before the P·V product (values in [0, 1]: e4m3 keeps 3 mantissa bits);
- V arrives K-major (sequence dim contiguous), as e4m3 wgmma requires for its B operand; its descale multiplies
  the output once, in the epilogue.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashmoe_science.attention.fp8_format import FP8_MAX, hadamard_signs
from flashmoe_science.attention.layout import tma_compatible, tma_descriptor
from flashmoe_science.attention.mask import LN_2, LOG2_E, key_tile_bounds, visible
from flashmoe_science.attention.tiles import AttentionTiles
from flashmoe_science.attention.triton.common import online_softmax_step

# ------------------------------------------------------------------------------------------------ quantisation


@triton.jit
def _fwht(x, BLOCK_R: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    """Unnormalised fast Walsh–Hadamard transform of each row of x (BLOCK_R, D): LOG_D butterfly stages, each
    pairing column c with c + half inside blocks of 2·half columns."""
    for stage in tl.static_range(LOG_D):
        pairs = tl.permute(tl.reshape(x, (BLOCK_R, D // (2 << stage), 2, 1 << stage)), (0, 1, 3, 2))
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK_R, D))
    return x


@triton.jit
def _rows(X, SIGNS, b, h, row0, seqlen, stride_b, stride_h, stride_l,
          BLOCK_R: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr, ROTATE: tl.constexpr):
    """A (BLOCK_R, BLOCK_D) float32 block of rows of head (b, h), rotated when ROTATE (x·diag(s)·H/√D; D is then a
    power of two and BLOCK_D == D), columns past D read as 0; and the mask of the real elements."""
    rows = row0 + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    real = (rows[:, None] < seqlen) & (cols[None, :] < D)
    ptrs = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows[:, None].to(tl.int64) * stride_l + cols[None, :]
    x = tl.load(ptrs, mask=real, other=0.0).to(tl.float32)
    if ROTATE:
        x = _fwht(x * tl.load(SIGNS + cols)[None, :], BLOCK_R, BLOCK_D, LOG_D) * (1.0 / tl.sqrt(D * 1.0))
    return x, rows, cols, real


@triton.jit
def _amax_kernel(X, SIGNS, AMAX, seqlen, num_heads, group, stride_b, stride_h, stride_l,
                 BLOCK_R: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr,
                 ROTATE: tl.constexpr):
    pid_r, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // num_heads, pid_bh % num_heads
    x, _, _, _ = _rows(X, SIGNS, b, h, pid_r * BLOCK_R, seqlen, stride_b, stride_h, stride_l, BLOCK_R, D, BLOCK_D,
                       LOG_D, ROTATE)
    tl.atomic_max(AMAX + b * (num_heads // group) + h // group, tl.max(tl.max(tl.abs(x), 1), 0))


@triton.jit
def _cast_kernel(X, SIGNS, AMAX, OUT, seqlen, row_pitch, num_heads, group, stride_b, stride_h, stride_l,
                 BLOCK_R: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr,
                 ROTATE: tl.constexpr, TRANSPOSE: tl.constexpr, FP8_LIMIT: tl.constexpr):
    pid_r, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // num_heads, pid_bh % num_heads
    x, rows, cols, real = _rows(X, SIGNS, b, h, pid_r * BLOCK_R, seqlen, stride_b, stride_h, stride_l,
                                BLOCK_R, D, BLOCK_D, LOG_D, ROTATE)
    amax = tl.load(AMAX + b * (num_heads // group) + h // group)
    scale = tl.where(amax > 0, amax / FP8_LIMIT, 1.0)
    y = (x / scale).to(OUT.dtype.element_ty)
    if TRANSPOSE:  # (D, row_pitch) per head: the K-major layout of V
        head = OUT + pid_bh.to(tl.int64) * row_pitch * D
        tl.store(head + cols[None, :].to(tl.int64) * row_pitch + rows[:, None], y, mask=real)
    else:
        head = OUT + pid_bh.to(tl.int64) * seqlen * D
        tl.store(head + rows[:, None].to(tl.int64) * D + cols[None, :], y, mask=real)


def quantize_slabs(x: torch.Tensor, group: int, rotate: bool, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, L, D), unit last stride -> (e4m3 (B, H, L, D), float32 descale (B, H // group)). One scale per
    group of `group` heads; `transpose` stores each head as (D, L) (returned as a (B, H, L, D) view of it)."""
    if x.stride(-1) != 1:
        x = x.contiguous()  # quantisation writes a new tensor anyway; this is its input read
    b, h, seqlen, d = x.shape
    amax = torch.zeros(b, h // group, dtype=torch.float32, device=x.device)
    # V^T rows padded to 16 bytes: TMA needs 16-byte aligned strides (the padding is never read)
    row = -(-seqlen // 16) * 16
    buf = torch.empty((b, h, d, row) if transpose else (b, h, seqlen, d), dtype=torch.float8_e4m3fn,
                      device=x.device)
    signs = hadamard_signs(d, x.device)
    block_d = triton.next_power_of_2(d)  # tl.arange takes powers of two: columns past d are masked
    block_r = max(16, min(128, 8192 // block_d))
    grid = (triton.cdiv(seqlen, block_r), b * h)
    common = dict(BLOCK_R=block_r, D=d, BLOCK_D=block_d, LOG_D=int(math.log2(d)) if rotate else 0, ROTATE=rotate)
    if seqlen:
        _amax_kernel[grid](x, signs, amax, seqlen, h, group, *x.stride()[:3], **common, num_warps=4)
        _cast_kernel[grid](x, signs, amax, buf, seqlen, row, h, group, *x.stride()[:3], **common, TRANSPOSE=transpose,
                           FP8_LIMIT=FP8_MAX, num_warps=4)
    descale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (buf[..., :seqlen].transpose(-1, -2) if transpose else buf), descale


# ------------------------------------------------------------------------------------------------ attention


@triton.jit
def _fp8_key_tiles(acc, l_i, m_i, q, offs_m, K, V, batch, kv_head, k_base, v_base, stride_kn, stride_vn, stride_vd,
                   key_start, key_end, seqlen_k, diagonal, qk_scale,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   USE_TMA: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(key_start, key_end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if USE_TMA:  # out-of-bounds rows/columns arrive as zeros; masked scores hide them
            k = K.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
            vt = V.load([batch, kv_head, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
        else:
            k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
            vt_ptrs = v_base + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn
            if MASKED:
                k = tl.load(k_ptrs, mask=offs_n[:, None] < seqlen_k, other=0.0)
                vt = tl.load(vt_ptrs, mask=offs_n[None, :] < seqlen_k, other=0.0)
            else:
                k = tl.load(k_ptrs)
                vt = tl.load(vt_ptrs)
        s = tl.dot(q, tl.trans(k))
        if MASKED:  # the sequence's end and the causal diagonal (mask.visible: causal = window (-1, 0))
            seen = visible(offs_m[:, None], offs_n[None, :], seqlen_k, diagonal, 0, 0, False, CAUSAL)
            s = tl.where(seen, s * qk_scale, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, tl.trans(vt), qk_scale, not MASKED, MASKED, "tf32")
    return acc, l_i, m_i


@triton.jit
def _fp8_forward_kernel(
    Q, K, V, O, LSE, QD, KD, VD,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om,
    num_q_heads, num_kv_heads, group_size, seqlen_q, seqlen_k, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # heaviest query tiles first
    batch, q_head = pid_bh // num_q_heads, pid_bh % num_q_heads
    kv_head = q_head // group_size
    slab = batch * num_kv_heads + kv_head
    qk_scale = qk_scale * tl.load(QD + slab) * tl.load(KD + slab)  # the descales, folded into the multiplier
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    batch64 = batch.to(tl.int64)
    if USE_TMA:
        k_base, v_base = K, V
        q = Q.load([batch, q_head, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    else:
        k_base = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh
        v_base = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh
        q = tl.load(Q + batch64 * stride_qb + q_head.to(tl.int64) * stride_qh
                    + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                    mask=offs_m[:, None] < seqlen_q, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    diagonal = seqlen_k - seqlen_q
    full_end, key_end = key_tile_bounds(start_m, seqlen_k, diagonal, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fp8_key_tiles(acc, l_i, m_i, q, offs_m, K, V, batch, kv_head, k_base, v_base, stride_kn,
                                   stride_vn, stride_vd, 0, full_end, seqlen_k, diagonal, qk_scale, BLOCK_N, HEAD_DIM,
                                   False, CAUSAL, USE_TMA)
    acc, l_i, m_i = _fp8_key_tiles(acc, l_i, m_i, q, offs_m, K, V, batch, kv_head, k_base, v_base, stride_kn,
                                   stride_vn, stride_vd, full_end, key_end, seqlen_k, diagonal, qk_scale, BLOCK_N,
                                   HEAD_DIM, True, CAUSAL, USE_TMA)

    no_key = l_i == 0.0
    l_safe = tl.where(no_key, 1.0, l_i)
    out = acc * (tl.load(VD + slab) / l_safe)[:, None]
    lse = tl.where(no_key, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN_2)
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
    o_ptrs = (O + batch64 * stride_ob + q_head.to(tl.int64) * stride_oh + offs_m[:, None].to(tl.int64) * stride_om
              + offs_d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < seqlen_q)


def fp8_tiles(head_dim: int) -> AttentionTiles:
    """The e4m3 forward's tiles on Hopper. Swept on the H200 (FA3 grid at L=16k and B=8 L=2048, causal and not;
    docs/perf-notes.md, FP8): 64x128 with 4 warps, 3 stages at D <= 128 (128x128 tiles ran 0.6x slower causal);
    128x64 with 8 warps, 3 stages at D=256; TMA loads 3-10% faster than pointer loads everywhere."""
    if head_dim <= 128:
        return AttentionTiles(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True)
    return AttentionTiles(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=True)


def attention_forward_fp8(q, k, v, out, lse, q_descale, k_descale, v_descale, causal: bool, softmax_scale: float,
                          tiles: AttentionTiles | None = None):
    """Launch on checked tensors: e4m3 q (B, Hq, Lq, D), k (B, Hkv, Lk, D) with unit last strides, v (B, Hkv, Lk, D)
    K-major (unit stride on Lk; a row-major v is transposed here, once, with a copy), out bf16 and lse float32
    (B, Hq, Lq) contiguous, descales float32 (B, Hkv)."""
    if v.stride(-2) != 1:
        v = v.transpose(-1, -2).contiguous().transpose(-1, -2)
    tiles = tiles or fp8_tiles(q.shape[-1])
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    grid = (triton.cdiv(lq, tiles.block_m), b * hq)
    vt = v.transpose(-1, -2)  # (B, Hkv, D, Lk), unit stride on Lk
    use_tma = tiles.use_tma and tma_compatible(q, k, vt)
    tensors = (q, k, v)
    if use_tma:
        tensors = (tma_descriptor(q, tiles.block_m, d), tma_descriptor(k, tiles.block_n, d),
                   TensorDescriptor(vt, list(vt.shape), list(vt.stride()), [1, 1, d, tiles.block_n], padding="zero"))
    return _fp8_forward_kernel[grid](
        *tensors, out, lse, q_descale.contiguous(), k_descale.contiguous(), v_descale.contiguous(),
        *q.stride()[:3], *k.stride()[:3], v.stride(0), v.stride(1), v.stride(2), v.stride(3), *out.stride()[:3],
        hq, hkv, hq // hkv, lq, lk, softmax_scale * LOG2_E.value,
        HEAD_DIM=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, CAUSAL=causal, USE_TMA=use_tma,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
