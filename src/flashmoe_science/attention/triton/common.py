"""What the portable Triton attention kernels share (fwd, bwd, fp8, and attention/bwd_prep.py): tile loads by
masked pointers or TMA (`load_tile`), the scores in log2 units with the call's modifiers and bias (`scores_log2`,
`head_extras`), the online softmax's per-tile update (`online_softmax_step`), and the arguments every kernel takes for
a call's features (`feature_args`, `feature_tensors`). The kernel files import this module, never each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashmoe_science.attention.features import CallFeatures, bias_strides
from flashmoe_science.attention.mask import HARDWARE_TANH, LOG2_E, score_to_log2


@triton.jit
def load_tile(base, desc_ptr, batch, head, row0, n_rows, stride_row,
              ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
              USE_TMA: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """A (ROWS, BLOCK_D) tile starting at row `row0` of one head (through the TMA descriptor `desc_ptr` with USE_TMA,
    else masked pointer loads from `base`); rows past `n_rows` and columns past HEAD_DIM read 0."""
    if USE_TMA:
        tile = desc_ptr.load([batch, head, row0, 0]).reshape(ROWS, BLOCK_D)
    else:
        rows = row0 + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        ptrs = base + rows[:, None] * stride_row + cols[None, :]
        if CHECK_ROWS:
            mask = rows[:, None] < n_rows
            if BLOCK_D != HEAD_DIM:
                mask = mask & (cols[None, :] < HEAD_DIM)
            tile = tl.load(ptrs, mask=mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def scores_log2(s, q_pos, k_pos, seqlen_q, seqlen_k, diagonal, qk_scale, softcap_scale, alibi_slope_log2,
                BIAS, bias_offset, stride_bias_m, stride_bias_n,
                SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Raw products s = q·k (any orientation: q_pos and k_pos broadcast over s) -> scores in log2 units:
    `mask.score_to_log2` (softcap, ALiBi) and then the bias, read through its (possibly stride-0) strides.
    Returns (scores, t) as score_to_log2 (t = tanh(...) for the softcap's derivative). Used by the forward and
    both backward kernels. `bias_offset`: the (batch, head) plane's offset (`head_extras`)."""
    x, t = score_to_log2(s, q_pos, k_pos, diagonal, qk_scale, softcap_scale, alibi_slope_log2, SOFTCAP, ALIBI)
    if HAS_BIAS:
        in_bounds = (q_pos < seqlen_q) & (k_pos < seqlen_k)
        # 64-bit within the plane too: Lq·Lk passes 2**31 at L = 46341
        bias = tl.load(BIAS + bias_offset + q_pos.to(tl.int64) * stride_bias_m + k_pos.to(tl.int64) * stride_bias_n,
                       mask=in_bounds, other=0.0)
        x = x + bias.to(tl.float32) * LOG2_E
    return x, t


@triton.jit
def head_extras(ALIBI_SLOPES, batch, batch64, q_head, stride_alibi_b, stride_alibi_h, stride_bias_b, stride_bias_h,
                ALIBI: tl.constexpr):
    """One (sequence, query head)'s ALiBi slope in log2 units (0 without ALiBi) and its bias plane's offset (the
    strides are 0 without a bias)."""
    if ALIBI:
        slope_log2 = tl.load(ALIBI_SLOPES + batch * stride_alibi_b + q_head * stride_alibi_h) * LOG2_E
    else:
        slope_log2 = tl.zeros([], tl.float32)
    return slope_log2, batch64 * stride_bias_b + q_head.to(tl.int64) * stride_bias_h


@triton.jit
def online_softmax_step(acc, l_i, m_i, x, v, qk_scale,
                        RAW: tl.constexpr, MAY_BE_EMPTY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores x (log2 units; RAW: plain products q kᵀ, scaled here, where the scale folds into
    the exp2's FMA) and its values v into the running (acc, l, m). MAY_BE_EMPTY: rows may have seen no key."""
    if RAW:
        m_new = tl.maximum(m_i, tl.max(x, 1) * qk_scale)
        m_shift = m_new
        p = tl.math.exp2(x * qk_scale - m_shift[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(x, 1))
        if MAY_BE_EMPTY:
            # A row with no visible key so far keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        p = tl.math.exp2(x - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


def feature_args(q, k, features: CallFeatures, softmax_scale: float) -> tuple[dict, tuple]:
    """The mask's scalars and constexprs (mask.MaskSpec.kernel_args), the feature flags, and the ALiBi and bias
    strides, for the forward and the backward kernels alike."""
    bias = features.attn_bias
    scalars = dict(
        **features.mask.kernel_args(softmax_scale),
        ALIBI=features.alibi_slopes is not None, HAS_BIAS=bias is not None, VARLEN=features.varlen is not None,
    )
    if scalars["SOFTCAP"] and q.is_cuda and q.dtype != torch.float32:
        scalars["SOFTCAP"] = int(HARDWARE_TANH)  # 16-bit inputs on a GPU: the tanh instruction (mask.softcap_tanh)
    alibi_strides = features.alibi_slopes.stride() if features.alibi_slopes is not None else (0, 0)
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return scalars, (*alibi_strides, *(bias_strides(bias, full) if bias is not None else (0, 0, 0, 0)))


def feature_tensors(features: CallFeatures) -> tuple:
    """CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, BIAS (None where the call has none)."""
    varlen = features.varlen
    return (varlen.cu_seqlens_q if varlen is not None else None, varlen.cu_seqlens_k if varlen is not None else None,
            features.alibi_slopes, features.attn_bias)
