"""Attention against a KV cache in Triton: any number of query tokens per sequence against a long,
per-sequence-length, paged or contiguous cache (bf16/fp16/fp32, or e4m3 with per-KV-head scales).

Three kernels, launched by `attention.decode` on checked tensors:

1. `_append_kernel` (only with ``k_new``): writes the new keys/values into the cache at positions
   ``cache_seqlens[b] + t``, applying rotary embeddings to k_new (and to q, into a scratch copy) when cos/sin are
   given, and quantising to e4m3 (value / scale, saturated to +-448) for an FP8 cache. Nothing is written for a
   sequence whose lengths are out of range, nor into a block outside the pool.
2. `_decode_kernel`: one program per (key split, sequence x KV head, row tile). The rows of a tile are (query
   token, query head of this KV head) pairs, token-major (row r is token ``r // group``, query head
   ``kv_head * group + r % group``), so each KV head's keys and values are read once for its whole group and a
   tile covers a run of consecutive tokens: one token of decode, or a run of a chunked prefill's thousands. The
   keys the tile's tokens see (`mask.key_tile_range`, bottom-right aligned: ``diagonal = Lk - Lq``) are cut into
   ``num_splits`` equal runs of BLOCK_N tiles; each program walks its run with an online softmax in base 2. Tiles
   every row sees whole run without mask arithmetic; the others use `mask.visible`. Scores go through
   `mask.score_to_log2` (scale, softcap, ALiBi); an FP8 cache's keys enter the product as e4m3 values converted to
   q's dtype (exact; bf16 q runs as float16, scaled by a power of two), the key scale is folded into the score's scalar (scale·log2e, or the softcap's scale/c)
   once per program and the value scale multiplies the output once.
   With one split the program writes the final output; otherwise an fp32 partial output and its log-sum-exp.
   Queries come as ``(B, Lq, Hq, D)`` (decode) or packed ``(total_q, Hq, D)`` with cu_seqlens_q (varlen).
3. `_combine_kernel` (only with several splits): merges the partial results of each row by their log-sum-exp.

A sequence's keys are cache positions [start, end + num_new) of its row (contiguous: row ``cache_batch_idx[b]``
or b, start ``cache_leftpad[b]`` or a packed sequence's first row; paged: block table row b, start 0). Cache rows
are addressed in 64 bits (a 1M-token cache has 2**30 elements per sequence). Values are never trusted: a sequence
whose lengths leave the cache, whose cache row is out of range or whose block table names a block outside the pool
gets NaN outputs (and LSE), never another sequence's keys; every address is clamped into the cache, so nothing is
read or written outside it. (The front door checks the values on the host where it may synchronise.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashmoe_science.attention import fp8_format
from flashmoe_science.attention.mask import LN_2, LOG2_E, key_tile_range, score_to_log2, visible
from flashmoe_science.attention.seqlen import sequence_bounds

FP8_MAX = tl.constexpr(fp8_format.FP8_MAX)  # quantised keys and values saturate there


# ----------------------------------------------------------------------------------------------------------------
# Addressing: one place for contiguous and paged caches, and for the validity of each sequence's values
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _row_entries(block_table_row, pos, row_ok, max_blocks, PAGE_SIZE: tl.constexpr):
    """The block-table entry of each cache position ``pos`` (0 where ``row_ok`` is False), as stored: `_cache_rows`
    clamps them into the pool and flags the ones outside it."""
    return tl.load(block_table_row + tl.minimum(pos // PAGE_SIZE, max_blocks - 1), mask=row_ok, other=0)


@triton.jit
def _page_block(block_table_row, pos, num_blocks, max_blocks, PAGE_SIZE: tl.constexpr):
    """(the cache block holding position ``pos``, clamped into the pool as a 64-bit index; whether the table's
    entry lies in the pool)."""
    block = _row_entries(block_table_row, pos, True, max_blocks, PAGE_SIZE)
    in_pool = (block >= 0) & (block < num_blocks)
    return tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64), in_pool


@triton.jit
def _cache_rows(cache_row, page, page_ok, entries, pos, num_blocks, stride_b, stride_row, PAGED: tl.constexpr,
                PAGE_SIZE: tl.constexpr, ONE_PAGE: tl.constexpr):
    """(64-bit element offsets of the cache rows at positions ``pos`` of one sequence, head offset excluded; which of
    them come from a block-table entry inside the pool).

    Contiguous: ``cache_row * stride_b + pos * stride_row``. Paged: the row's block (its table entry, clamped into
    [0, num_blocks)) times the block stride plus ``pos % PAGE_SIZE`` rows. ONE_PAGE: all of ``pos`` lie in the block
    ``page`` (from `_page_block`, with its ``page_ok``; a tile no larger than a page, aligned to it); otherwise
    ``entries`` holds each row's table entry (`_row_entries`), read by the caller so that a key loop can read them
    one tile ahead.
    """
    if PAGED:
        if ONE_PAGE:
            block = page
            ok = (pos >= 0) & page_ok  # the page's flag over the tile's rows
        else:
            ok = (entries >= 0) & (entries < num_blocks)
            block = tl.minimum(tl.maximum(entries, 0), num_blocks - 1).to(tl.int64)
        return block * stride_b + (pos % PAGE_SIZE).to(tl.int64) * stride_row, ok
    return cache_row * stride_b + pos.to(tl.int64) * stride_row, pos >= 0


@triton.jit
def _sequence_keys(SEQLENS, STARTS, CACHE_ROWS, batch, num_new, capacity, cache_batch,
                   HAS_STARTS: tl.constexpr, HAS_CACHE_ROWS: tl.constexpr):
    """(first cache position, end position before the append, number of keys after it, the cache row (int64,
    clamped), whether the values are out of range) of sequence ``batch``. Out of range: end < start, start < 0,
    end + num_new > capacity, a cache row outside [0, cache_batch); such a sequence gets no keys."""
    end = tl.load(SEQLENS + batch)
    start = 0
    if HAS_STARTS:
        start = tl.load(STARTS + batch)
    bad = (end < start) | (end + num_new > capacity) | (start < 0)
    if HAS_CACHE_ROWS:
        row = tl.load(CACHE_ROWS + batch)
        bad = bad | (row < 0) | (row >= cache_batch)
        row = tl.minimum(tl.maximum(row, 0), cache_batch - 1).to(tl.int64)
    else:
        row = batch.to(tl.int64)
    return start, end, tl.where(bad, 0, end + num_new - start), row, bad


# ----------------------------------------------------------------------------------------------------------------
# 1. Append (with rotary, with e4m3 quantisation)
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _rotate(row_ptr, cols, pos, COS, SIN, stride_cos, rotary_rows, HEAD_DIM: tl.constexpr,
            ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """One head's row of HEAD_DIM values with its first ROTARY_DIM rotated by the angle table's row ``pos``.

    Non-interleaved (GPT-NeoX): pairs (d, d + R/2); interleaved (GPT-J): pairs (2j, 2j + 1). Each value takes
    ``x·cos ± partner·sin``; the angle row is clamped into the table.
    """
    in_row = cols < HEAD_DIM
    x = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    rotated = cols < ROTARY_DIM
    if INTERLEAVED:
        angle = cols // 2
        partner = cols ^ 1
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        half: tl.constexpr = ROTARY_DIM // 2
        angle = cols % half
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    pos = tl.minimum(tl.maximum(pos, 0), rotary_rows - 1).to(tl.int64)
    cos = tl.load(COS + pos * stride_cos + angle, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(SIN + pos * stride_cos + angle, mask=rotated, other=0.0).to(tl.float32)
    other = tl.load(row_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
    return tl.where(rotated, x * cos + sign * other * sin, x)


@triton.jit
def _round_to_e4m3(x):
    """float32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even: 3 mantissa bits, so the grid step is
    2^(exponent - 3), or 2^-9 below the smallest normal 2^-6. The conversion that follows is then exact (the same
    rounding as the hardware's; Triton's CPU interpreter does not carry a rounded-up mantissa into the exponent)."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    y = x / step
    low = tl.math.floor(y)
    frac = y - low
    odd = (low - 2.0 * tl.math.floor(low * 0.5)) == 1.0
    return (low + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)) * step


@triton.jit
def _to_cache(x, SCALE, head, stride_scale, FP8: tl.constexpr, CACHE_DTYPE: tl.constexpr):
    """A row of values as the cache stores them: e4m3 of value / scale (saturated) for an FP8 cache."""
    if FP8:
        scale = tl.load(SCALE + head * stride_scale)
        x = _round_to_e4m3(tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX))
    return x.to(CACHE_DTYPE)


@triton.jit
def _append_kernel(
    Q, Q_OUT, K_NEW, V_NEW, K, V, BLOCK_TABLE, SEQLENS, STARTS, CACHE_ROWS, COS, SIN, K_SCALE, V_SCALE,
    stride_qb, stride_qm, stride_qh, stride_ob, stride_om, stride_oh,
    stride_nb, stride_nm, stride_nh, stride_vnb, stride_vnm, stride_vnh,
    stride_kb, stride_krow, stride_kh, stride_vb, stride_vrow, stride_vh,
    stride_btb, stride_cos, stride_scale,
    seqlen_q, num_new, num_q_heads, capacity, cache_batch, num_blocks, max_blocks, rotary_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_STARTS: tl.constexpr, HAS_CACHE_ROWS: tl.constexpr, FP8: tl.constexpr,
    ROTARY: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, Q_POSITIONS_PER_TOKEN: tl.constexpr,
):
    """Program (token t, batch b, head slot): slots < num_q_heads rotate q's head into Q_OUT (ROTARY only); the
    rest append k_new/v_new of KV head ``slot - num_q_heads`` at cache position ``cache_seqlens[b] + t``."""
    token = tl.program_id(0)
    batch = tl.program_id(1)
    slot = tl.program_id(2)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < HEAD_DIM
    start, end, seqlen_k, cache_row, bad = _sequence_keys(SEQLENS, STARTS, CACHE_ROWS, batch, num_new, capacity,
                                                          cache_batch, HAS_STARTS, HAS_CACHE_ROWS)
    b64 = batch.to(tl.int64)
    if slot < num_q_heads:
        if ROTARY:
            if token < seqlen_q:
                # flash-attn's convention: with a causal or windowed mask each new query token sits at its own
                # position; without one, all of them at cache_seqlens.
                pos = end + token if Q_POSITIONS_PER_TOKEN else end
                src = Q + b64 * stride_qb + token * stride_qm + slot * stride_qh
                q = _rotate(src, cols, pos, COS, SIN, stride_cos, rotary_rows, HEAD_DIM, ROTARY_DIM, INTERLEAVED)
                dst = Q_OUT + b64 * stride_ob + token * stride_om + slot * stride_oh
                tl.store(dst + cols, q.to(Q_OUT.dtype.element_ty), mask=in_row)
    else:
        head = slot - num_q_heads
        pos = end + token
        table_row = BLOCK_TABLE + b64 * stride_btb
        page = tl.zeros([], dtype=tl.int64)
        in_pool = True
        if PAGED:
            page, in_pool = _page_block(table_row, pos, num_blocks, max_blocks, PAGE_SIZE)
        if (token < num_new) & (bad == 0) & in_pool:
            src = K_NEW + b64 * stride_nb + token * stride_nm + head * stride_nh
            if ROTARY:  # rounded to k_new's dtype first: the cache holds (or quantises) what a bf16 k_new would be
                k = _rotate(src, cols, pos, COS, SIN, stride_cos, rotary_rows, HEAD_DIM, ROTARY_DIM,
                            INTERLEAVED).to(K_NEW.dtype.element_ty)
            else:
                k = tl.load(src + cols, mask=in_row, other=0.0)
            v = tl.load(V_NEW + b64 * stride_vnb + token * stride_vnm + head * stride_vnh + cols, mask=in_row,
                        other=0.0)
            # one position: its page is `_page_block`'s, read above
            k_row, _ = _cache_rows(cache_row, page, in_pool, 0, pos, num_blocks, stride_kb, stride_krow, PAGED,
                                   PAGE_SIZE, True)
            v_row, _ = _cache_rows(cache_row, page, in_pool, 0, pos, num_blocks, stride_vb, stride_vrow, PAGED,
                                   PAGE_SIZE, True)
            tl.store(K + k_row + head * stride_kh + cols, _to_cache(k, K_SCALE, head, stride_scale, FP8,
                                                                     K.dtype.element_ty), mask=in_row)
            tl.store(V + v_row + head * stride_vh + cols, _to_cache(v, V_SCALE, head, stride_scale, FP8,
                                                                     V.dtype.element_ty), mask=in_row)


# ----------------------------------------------------------------------------------------------------------------
# 2. Split-KV attention over the cache
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _attend(acc, l_i, m_i, outside, q, token, slope_log2, key_lo, key_hi,
            k_head, v_head, block_table_row, cache_row, key_start, seqlen_k, diagonal, num_blocks, max_blocks,
            stride_kb, stride_krow, stride_vb, stride_vrow,
            window_left, window_right, qk_scale, softcap_scale,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
            PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, ONE_PAGE: tl.constexpr, FP8: tl.constexpr,
            MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
            SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold key tiles [key_lo, key_hi) into the running (acc, l, m). MASKED tiles check bounds and the window.
    ``outside`` counts tiles that met a block-table entry outside the pool (the caller poisons the output)."""
    cols = tl.arange(0, BLOCK_D)
    # The next tile's block-table entries are read one iteration ahead (one entry for a one-page tile, one per key
    # otherwise), so the K/V loads do not wait on a table load of their own iteration and software-pipeline like a
    # contiguous cache's.
    page = tl.zeros([], dtype=tl.int64)
    page_ok = True
    entries = tl.zeros([BLOCK_N], dtype=tl.int32)
    if PAGED:
        if ONE_PAGE:
            page, page_ok = _page_block(block_table_row, key_lo, num_blocks, max_blocks, PAGE_SIZE)
        else:
            first = key_lo + tl.arange(0, BLOCK_N)
            entries = _row_entries(block_table_row, key_start + first, first < seqlen_k, max_blocks, PAGE_SIZE)
    for start_n in range(key_lo, key_hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        pos = start_n + tl.arange(0, BLOCK_N)
        row_ok = pos < seqlen_k
        k_rows, ok = _cache_rows(cache_row, page, page_ok, entries, key_start + pos, num_blocks, stride_kb,
                                 stride_krow, PAGED, PAGE_SIZE, ONE_PAGE)
        v_rows, _ = _cache_rows(cache_row, page, page_ok, entries, key_start + pos, num_blocks, stride_vb,
                                stride_vrow, PAGED, PAGE_SIZE, ONE_PAGE)
        if PAGED:
            if ONE_PAGE:  # one table entry per tile: a scalar test
                outside += tl.where(page_ok, 0, 1)
                page, page_ok = _page_block(block_table_row, tl.minimum(start_n + BLOCK_N, key_hi - 1), num_blocks,
                                            max_blocks, PAGE_SIZE)
            else:
                outside += tl.max(tl.where(ok | (pos >= seqlen_k), 0, 1), 0)
                ahead = pos + BLOCK_N
                entries = _row_entries(block_table_row, key_start + ahead, ahead < seqlen_k, max_blocks, PAGE_SIZE)
        k_ptrs = k_head + k_rows[:, None] + cols[None, :]
        v_ptrs = v_head + v_rows[:, None] + cols[None, :]
        if MASKED or BLOCK_D != HEAD_DIM:
            load_mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
            k = tl.load(k_ptrs, mask=load_mask, other=0.0)
            v = tl.load(v_ptrs, mask=load_mask, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if FP8:  # e4m3 values are exact in q's dtype (float16 for bf16 q); the scales ride the score scalars and output
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s, _ = score_to_log2(s, token[:, None], pos[None, :], diagonal, qk_scale, softcap_scale, slope_log2[:, None],
                             SOFTCAP, ALIBI)
        if MASKED:
            seen = visible(token[:, None], pos[None, :], seqlen_k, diagonal, window_left, window_right,
                           MASK_LEFT, MASK_RIGHT)
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: exp2 gives 0
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i, outside


@triton.jit
def _decode_kernel(
    Q, K, V, BLOCK_TABLE, SEQLENS, STARTS, CACHE_ROWS, CU_SEQLENS_Q, SLOPES, K_SCALE, V_SCALE, O, LSE, O_PART,
    LSE_PART,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_krow, stride_kh, stride_vb, stride_vrow, stride_vh,
    stride_btb, stride_sb, stride_ob, stride_om, stride_oh, stride_lb, stride_lh, stride_scale,
    num_kv_heads, group, seqlen_q, num_new, capacity, cache_batch, num_blocks, max_blocks, num_splits,
    window_left, window_right, qk_scale, softcap_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_TOKENS: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, VARLEN_Q: tl.constexpr,
    HAS_STARTS: tl.constexpr, HAS_CACHE_ROWS: tl.constexpr, FP8: tl.constexpr,
    MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads
    b64 = batch.to(tl.int64)
    max_seqlen_q = seqlen_q
    q_first, seqlen_q = sequence_bounds(CU_SEQLENS_Q, batch, seqlen_q, VARLEN_Q)
    first_row = tl.program_id(2) * BLOCK_M
    first_token = first_row // group
    if first_token >= seqlen_q:  # a packed batch's grid covers its longest sequence
        return

    # GQA packing, token-major: row r of the tile is token r // group, query head kv_head*group + r % group.
    rows = first_row + tl.arange(0, BLOCK_M)
    token = rows // group
    row_ok = token < seqlen_q
    q_head = kv_head * group + rows % group
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_DIM
    q_rows = b64 * stride_qb + (q_first + token) * stride_qm + q_head * stride_qh
    q = tl.load(Q + q_rows[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if ALIBI:  # slopes (B, Hq) with a batch stride of 0 for per-head slopes; log2 units like the scores
        slope_log2 = tl.load(SLOPES + b64 * stride_sb + q_head, mask=row_ok, other=0.0).to(tl.float32) * LOG2_E
    else:
        slope_log2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if FP8:  # the key scale multiplies every raw product: folded once into the scalar that multiplies it first
        k_scale = tl.load(K_SCALE + kv_head * stride_scale)
        if q.dtype == tl.bfloat16:
            # Products in float16: e4m3 -> float16 is one conversion per pair of values, e4m3 -> bfloat16 one more
            # per value. q is scaled by a power of two that puts its largest |value| in (2^13, 2^14], so its bf16
            # values stay exact (float16 keeps 11 bits); P in [0, 1] keeps more bits than in bf16.
            q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
            shift = tl.where((q_max > 0) & (q_max < float("inf")), tl.math.ceil(tl.math.log2(q_max)) - 14.0, 0.0)
            q = (q.to(tl.float32) * tl.math.exp2(-shift)).to(tl.float16)
            k_scale = k_scale * tl.math.exp2(shift)
        if SOFTCAP:
            softcap_scale = softcap_scale * k_scale
        else:
            qk_scale = qk_scale * k_scale

    key_start, _, seqlen_k, cache_row, bad = _sequence_keys(SEQLENS, STARTS, CACHE_ROWS, batch, num_new, capacity,
                                                            cache_batch, HAS_STARTS, HAS_CACHE_ROWS)
    diagonal = seqlen_k - seqlen_q  # the queries are the last seqlen_q positions
    first_key, full_start, full_end, key_end = key_tile_range(
        first_token, seqlen_q, seqlen_k, window_left, window_right, TILE_TOKENS, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    # This split's run of whole tiles; full tiles inside it run without masks.
    tiles_per_split = tl.cdiv(tl.cdiv(key_end - first_key, BLOCK_N), num_splits)
    lo = tl.minimum(first_key + split * tiles_per_split * BLOCK_N, key_end)
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, key_end)
    full_lo = tl.minimum(tl.maximum(full_start, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_end, full_lo), hi)

    k_head = K + kv_head.to(tl.int64) * stride_kh
    v_head = V + kv_head.to(tl.int64) * stride_vh
    table_row = BLOCK_TABLE + b64 * stride_btb
    ONE_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    outside = tl.zeros([], dtype=tl.int32)
    acc, l_i, m_i, outside = _attend(
        acc, l_i, m_i, outside, q, token, slope_log2, lo, full_lo, k_head, v_head, table_row, cache_row, key_start,
        seqlen_k, diagonal, num_blocks, max_blocks, stride_kb, stride_krow, stride_vb, stride_vrow,
        window_left, window_right, qk_scale, softcap_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
        PAGED, PAGE_SIZE, ONE_PAGE, FP8, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DOT_PRECISION)
    acc, l_i, m_i, outside = _attend(
        acc, l_i, m_i, outside, q, token, slope_log2, full_lo, full_hi, k_head, v_head, table_row, cache_row,
        key_start, seqlen_k, diagonal, num_blocks, max_blocks, stride_kb, stride_krow, stride_vb, stride_vrow,
        window_left, window_right, qk_scale, softcap_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
        PAGED, PAGE_SIZE, ONE_PAGE, FP8, False, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DOT_PRECISION)
    acc, l_i, m_i, outside = _attend(
        acc, l_i, m_i, outside, q, token, slope_log2, full_hi, hi, k_head, v_head, table_row, cache_row, key_start,
        seqlen_k, diagonal, num_blocks, max_blocks, stride_kb, stride_krow, stride_vb, stride_vrow,
        window_left, window_right, qk_scale, softcap_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
        PAGED, PAGE_SIZE, ONE_PAGE, FP8, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DOT_PRECISION)

    no_key = l_i == 0.0
    l_safe = tl.where(no_key, 1.0, l_i)
    out = acc / l_safe[:, None]
    if FP8:
        out = out * tl.load(V_SCALE + kv_head * stride_scale)
    lse_log2 = tl.where(no_key, float("-inf"), m_i + tl.math.log2(l_safe))
    poisoned = bad | (outside > 0)  # values out of range: NaN, never another sequence's keys
    out = tl.where(poisoned, float("nan"), out)
    lse_log2 = tl.where(poisoned, float("nan"), lse_log2)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        # partial rows are numbered over (B, Hq, max_seqlen_q)
        part = (split.to(tl.int64) * tl.num_programs(1) * group + b64 * num_kv_heads * group + q_head) \
            * max_seqlen_q + token
        tl.store(LSE_PART + part, lse_log2, mask=row_ok)
        tl.store(O_PART + part[:, None] * HEAD_DIM + cols[None, :], out, mask=out_mask)
    else:
        tl.store(LSE + b64 * stride_lb + q_head * stride_lh + q_first + token, lse_log2 * LN_2, mask=row_ok)
        o_rows = b64 * stride_ob + (q_first + token) * stride_om + q_head * stride_oh
        tl.store(O + o_rows[:, None] + cols[None, :], out.to(O.dtype.element_ty), mask=out_mask)


# ----------------------------------------------------------------------------------------------------------------
# 3. Merge the splits by log-sum-exp
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(O_PART, LSE_PART, O, LSE, CU_SEQLENS_Q, num_rows, num_splits, num_q_heads, max_seqlen_q,
                    stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, VARLEN_Q: tl.constexpr):
    """Program per row (b, query head, token): out = sum_s 2^(lse_s - lse) · out_s with lse = log2 sum_s 2^lse_s.
    Splits that saw no key carry lse -inf and weigh 0; a row no split saw gets zeros and -inf; a poisoned (NaN)
    partial makes the row NaN."""
    row = tl.program_id(0).to(tl.int64)
    token = row % max_seqlen_q
    q_head = (row // max_seqlen_q) % num_q_heads
    batch = row // (max_seqlen_q * num_q_heads)
    q_first, seqlen_q = sequence_bounds(CU_SEQLENS_Q, batch, max_seqlen_q, VARLEN_Q)
    if token >= seqlen_q:
        return
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_DIM
    splits = tl.arange(0, BLOCK_S)
    m = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):  # the running max first: one pass over the small LSE column
        m = tl.maximum(m, tl.load(LSE_PART + (s0 + splits) * num_rows + row, mask=s0 + splits < num_splits,
                                  other=float("-inf")))
    m_max = tl.max(m, 0)
    m_shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        split_ok = s0 + splits < num_splits
        part = (s0 + splits).to(tl.int64) * num_rows + row
        weight = tl.math.exp2(tl.load(LSE_PART + part, mask=split_ok, other=float("-inf")) - m_shift)
        o = tl.load(O_PART + part[:, None] * HEAD_DIM + cols[None, :], mask=split_ok[:, None] & col_ok[None, :],
                    other=0.0)
        total += weight
        acc += weight[:, None] * o
    total_sum = tl.sum(total, 0)
    out = tl.sum(acc, 0) / tl.where(total_sum == 0.0, 1.0, total_sum)
    lse = tl.where(total_sum == 0.0, float("-inf"), (m_shift + tl.math.log2(total_sum)) * LN_2)
    tl.store(LSE + batch * stride_lb + q_head * stride_lh + q_first + token, lse)
    tl.store(O + batch * stride_ob + (q_first + token) * stride_om + q_head * stride_oh + cols,
             out.to(O.dtype.element_ty), mask=col_ok)


# ----------------------------------------------------------------------------------------------------------------
# 4. A prefill chunk's packed sequence bounds (decode.dense_chunk)
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _chunk_bounds_kernel(ENDS, CU_Q, CU_K, INVALID, batch, num_new, capacity, seqlen_q, BLOCK_B: tl.constexpr):
    """One program: sequence b of a contiguous cache (B, capacity, ...) is two packed sequences, its seqlen_q
    queries against its rows [b·capacity, b·capacity + length_b), then no queries against the rest of its rows, with
    length_b = ends_b + num_new; a length outside [0, capacity] (or a negative end) gives no keys and INVALID_b.
    Writes cu_seqlens_q and cu_seqlens_k (2B + 1 entries each) and INVALID: one launch where the same on torch
    ops took sixteen small kernels inside the chunk's CUDA graph."""
    b = tl.arange(0, BLOCK_B)
    in_batch = b < batch
    ends = tl.load(ENDS + b, mask=in_batch, other=0)
    lengths = ends + num_new
    invalid = (ends < 0) | (lengths > capacity)
    lengths = tl.where(invalid, 0, lengths)
    row0 = b * capacity
    q_end = (b + 1) * seqlen_q
    tl.store(CU_Q + 2 * b + 1, q_end, mask=in_batch)
    tl.store(CU_Q + 2 * b + 2, q_end, mask=in_batch)
    tl.store(CU_K + 2 * b + 1, row0 + lengths, mask=in_batch)
    tl.store(CU_K + 2 * b + 2, row0 + capacity, mask=in_batch)
    tl.store(INVALID + b, invalid, mask=in_batch)
    tl.store(CU_Q + b, 0, mask=b == 0)
    tl.store(CU_K + b, 0, mask=b == 0)
