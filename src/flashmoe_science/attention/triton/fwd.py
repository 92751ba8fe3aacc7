"""Attention forward in Triton: FlashAttention-2 work split with an online softmax in base 2.

Read top to bottom:

1. One program owns a tile of BLOCK_M query rows of one (batch, query head). Programs of the same head are
   launched next to each other so their K/V tiles are shared through L2; with causal masking the heaviest
   (bottom) query tiles are launched first.
2. The keys a tile sees split into full tiles, where no score needs a mask, and at most a few boundary tiles
   (the causal diagonal, the ragged end of the sequence), where it does. Full tiles run a loop without any mask
   arithmetic; keys no row of the tile can see are never loaded.
3. Per key tile: s = q kᵀ, a running row max m and row sum l, and an fp32 accumulator rescaled by
   exp2(m_old - m_new) when the max grows. The softmax scale and log2(e) are folded into one multiplier so each
   score costs one FMA before its exp2.
4. The output is acc / l; the log-sum-exp is (m + log2 l) · ln 2. A row that sees no key writes zeros and -inf.

GQA/MQA maps query head h to key/value head h // group: no copy of K/V. Head dims that are not a power of two
are padded inside the kernel (zero-filled loads, masked stores). On Hopper, Q/K/V/O move through TMA tensor
descriptors over the caller's 4-D strides (out-of-bounds rows and columns are zero-filled by the copy engine);
elsewhere, and under the interpreter, through masked pointer loads.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flashmoe_science.attention.features import CallFeatures, as_features
from flashmoe_science.attention.layout import needs_64bit_rows, tma_descriptor
from flashmoe_science.attention.mask import LN_2, LOG2_E, key_tile_range, masked_runs, visible
from flashmoe_science.attention.mods import block_mask_args, call_block_mask, clamp_index
from flashmoe_science.attention.mods import kernel_args as mod_kernel_args
from flashmoe_science.attention.seqlen import launch_sizes, sequence_bounds
from flashmoe_science.attention.tiles import (
    AttentionTiles,
    autotune_enabled,
    forward_search_space,
    forward_tiles,
    padded_head_dim,
)
from flashmoe_science.attention.triton.common import (feature_args, feature_tensors, head_extras, load_tile,
                                                     online_softmax_step, scores_log2)
from flashmoe_science.device import device_traits, dot_precision
from flashmoe_science.prepared_launch import PreparedLaunch


@triton.jit
def _fold_key_tile(acc, l_i, m_i, q, offs_m, start_n,
                   k_base, v_base, K, V, batch, q_head, kv_head, stride_kn, stride_vn,
                   seqlen_q, seqlen_k, diagonal, window_left, window_right, qk_scale, sm_scale, softcap_scale,
                   alibi_slope_log2, BIAS, bias_offset, stride_bias_m, stride_bias_n,
                   mask_mod, mask_args, score_mod, score_args,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                   MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                   SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
                   MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
                   USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the key tile at start_n into the running (acc, l, m). MASKED tiles apply `mask.visible` (bounds and
    window) and the user's mask_mod; a score_mod replaces the built-in score modifiers (mods.py)."""
    k = load_tile(k_base, K, batch, kv_head, start_n, seqlen_k, stride_kn,
                  BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    v = load_tile(v_base, V, batch, kv_head, start_n, seqlen_k, stride_vn,
                  BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA, MASKED)
    key_pos = start_n + tl.arange(0, BLOCK_N)
    if MASK_MOD or SCORE_MOD:  # the mods see positions inside the sequence (ragged edges clamped)
        q_idx = clamp_index(offs_m, seqlen_q)[:, None]
        kv_idx = clamp_index(key_pos, seqlen_k)[None, :]
    if SCORE_MOD:
        x = score_mod(s * sm_scale, batch, q_head, q_idx, kv_idx, *score_args) * LOG2_E
    elif SOFTCAP or ALIBI or HAS_BIAS:
        x, _ = scores_log2(s, offs_m[:, None], key_pos[None, :], seqlen_q, seqlen_k, diagonal, qk_scale,
                           softcap_scale, alibi_slope_log2, BIAS, bias_offset, stride_bias_m, stride_bias_n,
                           SOFTCAP, ALIBI, HAS_BIAS)
    elif MASKED:
        x = s * qk_scale
    else:
        x = s  # plain full tiles: the scale is applied in _online_softmax_step (RAW)
    if MASKED:
        seen = visible(offs_m[:, None], key_pos[None, :], seqlen_k, diagonal, window_left, window_right,
                       MASK_LEFT, MASK_RIGHT)
        if MASK_MOD:
            seen = seen & (offs_m[:, None] < seqlen_q) & mask_mod(batch, q_head, q_idx, kv_idx, *mask_args)
        x = tl.where(seen, x, float("-inf"))
    return online_softmax_step(acc, l_i, m_i, x, v, qk_scale,
                               not (MASKED or SOFTCAP or ALIBI or HAS_BIAS or SCORE_MOD), MASKED, DOT_PRECISION)


@triton.jit
def _attend_key_tiles(acc, l_i, m_i, q, offs_m,
                      k_base, v_base, K, V, batch, q_head, kv_head, stride_kn, stride_vn,
                      key_start, key_end, gap_start, gap_end, seqlen_q, seqlen_k, diagonal,
                      window_left, window_right, qk_scale, sm_scale, softcap_scale, alibi_slope_log2,
                      BIAS, bias_offset, stride_bias_m, stride_bias_n, score_mod, score_args,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                      MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                      SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, SCORE_MOD: tl.constexpr,
                      USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold key tiles [key_start, gap_start) and [gap_end, key_end) into the running (acc, l, m). MASKED tiles
    apply `mask.visible` (bounds and window); the gap lets one loop visit both runs of masked tiles around the
    full ones (a loop per run would be another copy of the body competing for registers)."""
    for start_n in range(key_start, key_end - (gap_end - gap_start), BLOCK_N):
        if MASKED and MASK_LEFT:  # a gap only between two masked runs (see `masked_runs`)
            if start_n >= gap_start:
                start_n += gap_end - gap_start
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _fold_key_tile(acc, l_i, m_i, q, offs_m, start_n, k_base, v_base, K, V, batch, q_head,
                                       kv_head, stride_kn, stride_vn, seqlen_q, seqlen_k, diagonal, window_left,
                                       window_right, qk_scale, sm_scale, softcap_scale, alibi_slope_log2, BIAS,
                                       bias_offset, stride_bias_m, stride_bias_n, None, None, score_mod, score_args,
                                       BLOCK_N, BLOCK_D, HEAD_DIM, MASKED, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI,
                                       HAS_BIAS, False, SCORE_MOD, USE_TMA, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_listed_tiles(acc, l_i, m_i, q, offs_m, TILES, count,
                         k_base, v_base, K, V, batch, q_head, kv_head, stride_kn, stride_vn,
                         seqlen_q, seqlen_k, diagonal, window_left, window_right, qk_scale, sm_scale,
                         mask_mod, mask_args, score_mod, score_args,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                         MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                         SCORE_MOD: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the first `count` key tiles of the block mask's list TILES (tile indices): its partial tiles (MASKED,
    with the mask_mod) or its full ones (no mask at all)."""
    for i in range(0, count):
        start_n = tl.multiple_of(tl.load(TILES + i) * BLOCK_N, BLOCK_N)
        acc, l_i, m_i = _fold_key_tile(acc, l_i, m_i, q, offs_m, start_n, k_base, v_base, K, V, batch, q_head,
                                       kv_head, stride_kn, stride_vn, seqlen_q, seqlen_k, diagonal, window_left,
                                       window_right, qk_scale, sm_scale, 1.0, 0.0, None, 0, 0, 0,
                                       mask_mod, mask_args, score_mod, score_args, BLOCK_N, BLOCK_D, HEAD_DIM,
                                       MASKED, MASK_LEFT, MASK_RIGHT, False, False, False, MASKED, SCORE_MOD,
                                       USE_TMA, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attention_forward_kernel(
    Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES, BIAS,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_alibi_b, stride_alibi_h,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    num_q_heads, group_size, seqlen_q, seqlen_k, lse_rows, qk_scale, softcap_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, ROW64: tl.constexpr,
    # the user's mods (mods.py; None and False without them) and the block mask's tile lists (mods.block_mask_args)
    sm_scale, mask_mod, mask_args, score_mod, score_grad, score_args, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    PARTIAL_COUNTS, PARTIAL_TILES, FULL_COUNTS, FULL_TILES, list_len,
):
    if ROW64:  # row offsets (L-1)·stride_row reach 2**31 elements (e.g. a transposed (B, L, H, D) buffer)
        stride_qm, stride_kn = stride_qm.to(tl.int64), stride_kn.to(tl.int64)
        stride_vn, stride_om = stride_vn.to(tl.int64), stride_om.to(tl.int64)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if MASK_RIGHT:
        pid_m = tl.num_programs(0) - 1 - pid_m  # causal: heaviest query tiles first, a shorter tail of lone programs
    batch = pid_bh // num_q_heads
    q_head = pid_bh % num_q_heads
    kv_head = q_head // group_size
    start_m = pid_m * BLOCK_M
    # varlen: this program's sequence (the grid covers the longest one); the tensors are (1, H, total, D) views
    q_start, seqlen_q = sequence_bounds(CU_SEQLENS_Q, batch, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence_bounds(CU_SEQLENS_K, batch, seqlen_k, VARLEN)
    if VARLEN:
        if start_m >= seqlen_q:
            return
        batch64 = tl.zeros([], tl.int64)  # the tensors' batch index: one packed batch
    else:
        batch64 = batch.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)

    if USE_TMA:  # descriptors carry their own addressing (never varlen: api.py turns TMA off there)
        q_base, k_base, v_base = Q, K, V
    else:  # 64-bit head offsets: B·H·L·D can pass 2**31 elements
        q_base = Q + batch64 * stride_qb + q_head.to(tl.int64) * stride_qh + q_start * stride_qm
        k_base = K + batch64 * stride_kb + kv_head.to(tl.int64) * stride_kh + k_start * stride_kn
        v_base = V + batch64 * stride_vb + kv_head.to(tl.int64) * stride_vh + k_start * stride_vn

    q = load_tile(q_base, Q, batch, q_head, start_m, seqlen_q, stride_qm,
                  BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    alibi_slope_log2, bias_offset = head_extras(ALIBI_SLOPES, batch, batch64, q_head, stride_alibi_b,
                                                stride_alibi_h, stride_bias_b, stride_bias_h, ALIBI)

    diagonal = seqlen_k - seqlen_q  # query i sees key j iff i + diagonal - left <= j <= i + diagonal + right
    if MASK_MOD:  # the block mask's lists of this query tile: its full key tiles, then its partial ones
        tile_row = pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m
        acc, l_i, m_i = _attend_listed_tiles(acc, l_i, m_i, q, offs_m, FULL_TILES + tile_row * list_len,
                                             tl.load(FULL_COUNTS + tile_row), k_base, v_base, K, V, batch, q_head,
                                             kv_head, stride_kn, stride_vn, seqlen_q, seqlen_k, diagonal,
                                             window_left, window_right, qk_scale, sm_scale, mask_mod, mask_args,
                                             score_mod, score_args, BLOCK_N, BLOCK_D, HEAD_DIM, False, MASK_LEFT,
                                             MASK_RIGHT, SCORE_MOD, USE_TMA, DOT_PRECISION)
        acc, l_i, m_i = _attend_listed_tiles(acc, l_i, m_i, q, offs_m, PARTIAL_TILES + tile_row * list_len,
                                             tl.load(PARTIAL_COUNTS + tile_row), k_base, v_base, K, V, batch,
                                             q_head, kv_head, stride_kn, stride_vn, seqlen_q, seqlen_k, diagonal,
                                             window_left, window_right, qk_scale, sm_scale, mask_mod, mask_args,
                                             score_mod, score_args, BLOCK_N, BLOCK_D, HEAD_DIM, True, MASK_LEFT,
                                             MASK_RIGHT, SCORE_MOD, USE_TMA, DOT_PRECISION)
    else:
        key_start, full_start, full_end, key_end = key_tile_range(start_m, seqlen_q, seqlen_k, window_left,
                                                                  window_right, BLOCK_M, BLOCK_N, MASK_LEFT,
                                                                  MASK_RIGHT)
        masked_start, gap_start = masked_runs(key_start, full_start, full_end, MASK_LEFT)
        acc, l_i, m_i = _attend_key_tiles(acc, l_i, m_i, q, offs_m, k_base, v_base, K, V, batch, q_head, kv_head,
                                          stride_kn, stride_vn, full_start, full_end, full_end, full_end,
                                          seqlen_q, seqlen_k, diagonal, window_left, window_right, qk_scale,
                                          sm_scale, softcap_scale, alibi_slope_log2, BIAS, bias_offset,
                                          stride_bias_m, stride_bias_n, score_mod, score_args, BLOCK_N, BLOCK_D,
                                          HEAD_DIM, False, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_BIAS,
                                          SCORE_MOD, USE_TMA, DOT_PRECISION)
        acc, l_i, m_i = _attend_key_tiles(acc, l_i, m_i, q, offs_m, k_base, v_base, K, V, batch, q_head, kv_head,
                                          stride_kn, stride_vn, masked_start, key_end, gap_start, full_end,
                                          seqlen_q, seqlen_k, diagonal, window_left, window_right, qk_scale,
                                          sm_scale, softcap_scale, alibi_slope_log2, BIAS, bias_offset,
                                          stride_bias_m, stride_bias_n, score_mod, score_args, BLOCK_N, BLOCK_D,
                                          HEAD_DIM, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, HAS_BIAS,
                                          SCORE_MOD, USE_TMA, DOT_PRECISION)

    no_key = l_i == 0.0
    l_safe = tl.where(no_key, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(no_key, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN_2)
    lse_row0 = (batch64 * num_q_heads + q_head) * lse_rows + q_start  # lse is (B, H, Lq) or packed (1, H, total)
    tl.store(LSE + lse_row0 + offs_m, lse, mask=offs_m < seqlen_q)

    if USE_TMA:
        O.store([batch, q_head, start_m, 0], out.to(O.dtype).reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        cols = tl.arange(0, BLOCK_D)
        o_ptrs = (O + batch64 * stride_ob + q_head.to(tl.int64) * stride_oh
                  + q_start * stride_om + offs_m[:, None] * stride_om + cols[None, :])
        mask = offs_m[:, None] < seqlen_q
        if BLOCK_D != HEAD_DIM:
            mask = mask & (cols[None, :] < HEAD_DIM)
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal, softmax_scale: float, tiles: AttentionTiles,
):
    """Launch the forward kernel on checked 4-D tensors: q/out `(B, Hq, Lq, D)`, k/v `(B, Hkv, Lk, D)` with
    unit stride in the last dim, lse a contiguous float32 `(B, Hq, Lq)`; `tiles.use_tma` only where
    `tma_compatible(q, k, v, out)` holds (never varlen). `causal` is a bool or a `features.CallFeatures` (window,
    softcap, ALiBi, bias; varlen: q/out `(1, Hq, total_q, D)` views of the packed tensors, k/v likewise, lse
    `(1, Hq, total_q)`; mods: the user's mask_mod / score_mod, a mask_mod walked through its block mask at these
    tiles, `mods.call_block_mask`). Writes `out` and `lse` in place and
    returns Triton's compiled kernel (registers, spills and SASS for diagnostics)."""
    features = as_features(causal)
    blocks = call_block_mask(q, k, features, tiles.block_m, tiles.block_n)
    common, strides = _scalar_args(q, k, v, out, features, softmax_scale, tiles, blocks)
    if autotune_enabled() and q.is_cuda and features.is_plain:
        kernel = _autotuned_kernel(q.shape[-1], q.dtype, device_traits(q.device))
        # box rows are placeholders: each config's pre_hook sets its own
        tensor_args = _tensor_args(tiles.use_tma, 16, 16, common["BLOCK_D"], q, k, v, out, lse, features)
        grid = lambda meta: (triton.cdiv(q.shape[2], meta["BLOCK_M"]), q.shape[0] * q.shape[1])  # noqa: E731
        return kernel[grid](*tensor_args, *strides, **common, **dot_precision(q))

    grid, bound, options = _launch(q, k, v, out, lse, features, tiles, common, strides)
    return _attention_forward_kernel[grid](**bound, **options)


def _scalar_args(q, k, v, out, features: CallFeatures, softmax_scale, tiles: AttentionTiles,
                 blocks=None) -> tuple[dict, tuple]:
    """The kernel's scalars and constexprs (but the tile shape) by name, the mods' arguments and the block mask's
    lists (mods.py), and its strides in order."""
    num_q_heads = q.shape[1]
    scalars, feature_strides = feature_args(q, k, features, softmax_scale)
    # the tensors' lengths: a packed batch's kernel reads each sequence's own from cu_seqlens (sequence_bounds), and
    # its longest lengths, which change per batch, would be specialised on (seqlen.PER_BATCH_ARGS); the grid is
    # sized by them instead (_launch)
    common = dict(
        num_q_heads=num_q_heads, group_size=num_q_heads // k.shape[1], seqlen_q=q.shape[2], seqlen_k=k.shape[2],
        lse_rows=q.shape[2], **scalars, HEAD_DIM=q.shape[3], BLOCK_D=padded_head_dim(q.shape[3]),
        USE_TMA=tiles.use_tma,  # the caller checked tma_compatible(q, k, v, out) when it chose TMA
        ROW64=needs_64bit_rows(q, k, v, out), sm_scale=softmax_scale, **mod_kernel_args(features.mods),
        **block_mask_args(blocks),
    )
    return common, (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *feature_strides)


def _tensor_args(use_tma, block_m, block_n, block_d, q, k, v, out, lse, features: CallFeatures):
    """The kernel's per-call tensor arguments Q, K, V, O, LSE (the tensors, or TMA descriptors over them) and
    the features' tensors."""
    if not use_tma:
        return q, k, v, out, lse, *feature_tensors(features)
    return (tma_descriptor(q, block_m, block_d), tma_descriptor(k, block_n, block_d),
            tma_descriptor(v, block_n, block_d), tma_descriptor(out, block_m, block_d), lse,
            *feature_tensors(features))


def _launch(q, k, v, out, lse, features: CallFeatures, tiles: AttentionTiles, common: dict, strides: tuple):
    """(grid, every kernel parameter by name, launch options) of a launch with the heuristic's tiles."""
    tensor_args = _tensor_args(tiles.use_tma, tiles.block_m, tiles.block_n, common["BLOCK_D"], q, k, v, out, lse,
                               features)
    bound = dict(zip(_attention_forward_kernel.arg_names, (*tensor_args, *strides)), **common,
                 BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **dot_precision(q))
    num_seqs, longest_q, _ = launch_sizes(q, k, features.varlen)
    grid = (triton.cdiv(longest_q, tiles.block_m), num_seqs * q.shape[1])
    return grid, bound, dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def prepare_forward(q, k, v, out, lse, causal: bool, softmax_scale: float, tiles: AttentionTiles) -> PreparedLaunch:
    """This launch as a PreparedLaunch, called as `prepared(q, k, v, out, lse)` on new tensors of the same shapes,
    strides, dtypes, device and 16-byte alignment (arguments as attention_forward, which must have run on them
    without autotuning: the kernel is taken from Triton's cache). Plain calls only (causal or not)."""
    features = as_features(causal)
    common, strides = _scalar_args(q, k, v, out, features, softmax_scale, tiles)
    grid, bound, options = _launch(q, k, v, out, lse, features, tiles, common, strides)
    make_head = functools.partial(_tensor_args, tiles.use_tma, tiles.block_m, tiles.block_n, common["BLOCK_D"])
    return PreparedLaunch(_attention_forward_kernel, grid, bound, options,
                          lambda q, k, v, out, lse: make_head(q, k, v, out, lse, features), (q, k, v, out, lse))


def _set_descriptor_blocks(nargs: dict) -> None:
    # Autotune picks BLOCK_M/BLOCK_N per config; the host TMA descriptors must carry the same box shape.
    block_d = nargs["BLOCK_D"]
    for name, rows in (("Q", nargs["BLOCK_M"]), ("O", nargs["BLOCK_M"]), ("K", nargs["BLOCK_N"]), ("V", nargs["BLOCK_N"])):
        if hasattr(nargs[name], "block_shape"):
            nargs[name].block_shape = [1, 1, rows, block_d]


@functools.lru_cache(maxsize=None)
def _autotuned_kernel(head_dim: int, dtype: torch.dtype, traits):
    """The forward kernel wrapped in `triton.autotune` over `tiles.forward_search_space` (FLASHMOE_AUTOTUNE=1),
    one wrapper per (head dim, dtype, GPU); each wrapper tunes once per causal flag, GQA group and lengths."""
    configs = [
        triton.Config({"BLOCK_M": t.block_m, "BLOCK_N": t.block_n}, num_warps=t.num_warps, num_stages=t.num_stages,
                      pre_hook=_set_descriptor_blocks)
        # no contender fits (fp32 at D=256): the heuristic's own tile, which is shrunk to fit
        for t in forward_search_space(head_dim, dtype, traits) or [forward_tiles(head_dim, dtype, False, traits)]
    ]
    return triton.autotune(configs=configs, key=["MASK_RIGHT", "seqlen_q", "seqlen_k", "group_size"])(
        _attention_forward_kernel)
