"""KV-cache decode in Triton: a few new query tokens against a long, per-sequence-length, paged or contiguous cache.

Three kernels, launched by `attention.decode` on checked tensors:

1. `_append_kernel` (only with ``k_new``): writes the new keys/values into the cache at positions
   ``cache_seqlens[b] + t``, applying rotary embeddings to k_new (and to q, into a scratch copy) when cos/sin are
   given. Positions past the cache's capacity are dropped, never written.
2. `_decode_kernel`: one program per (key split, batch row x KV head, row tile). The rows of its tile are all the
   query heads of that KV head times the new tokens (GQA packing: row r is query head ``kv_head*group + r // Lq``,
   token ``r % Lq``), so each KV head's keys and values are read from memory once for the whole group. The keys
   the tokens see (`mask.key_tile_range`) are cut into ``num_splits`` equal runs of BLOCK_N tiles; each program
   walks its run with an online softmax in base 2. Tiles every row sees whole run without any mask arithmetic;
   the others use `mask.visible`. Scores go through `mask.score_to_log2` (scale, softcap, ALiBi).
   With one split the program writes the final output; otherwise an fp32 partial output and its log-sum-exp.
3. `_combine_kernel` (only with several splits): merges the partial results of each row by their log-sum-exp.

Cache rows are addressed in 64 bits (a 1M-token cache has 2**30 elements per sequence); block-table entries and
sequence lengths are clamped so that no read or write can leave the cache, whatever their values (the front door
checks the values only when asked: checking would synchronise with the host, which CUDA graphs forbid).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashmoe_science.attention.mask import LN_2, LOG2_E, key_tile_range, score_to_log2, visible


# ----------------------------------------------------------------------------------------------------------------
# Addressing: one place for contiguous and paged caches
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _page_block(block_table_row, pos, num_blocks, max_blocks, PAGE_SIZE: tl.constexpr):
    """The cache block holding position ``pos`` of a sequence, as a 64-bit index clamped into the pool."""
    block = tl.load(block_table_row + tl.minimum(pos // PAGE_SIZE, max_blocks - 1))
    return tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)


@triton.jit
def _cache_rows(batch, page, pos, row_ok, block_table_row, num_blocks, max_blocks, stride_b, stride_row,
                PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, ONE_PAGE: tl.constexpr):
    """64-bit element offsets of cache rows at positions ``pos`` of one sequence (head offset excluded).

    Contiguous: ``batch * stride_b + pos * stride_row``. Paged: the row's block ``block_table[pos // PAGE_SIZE]``
    (clamped into [0, num_blocks)) times the block stride plus ``pos % PAGE_SIZE`` rows. ONE_PAGE: all of ``pos``
    lie in the block ``page`` (from `_page_block`; a tile no larger than a page, aligned to it), so the table is
    not read per row.
    """
    if PAGED:
        if ONE_PAGE:
            block = page
        else:
            slot = tl.minimum(pos // PAGE_SIZE, max_blocks - 1)
            block = tl.load(block_table_row + slot, mask=row_ok, other=0)
            block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)
        return block * stride_b + (pos % PAGE_SIZE).to(tl.int64) * stride_row
    return batch.to(tl.int64) * stride_b + pos.to(tl.int64) * stride_row


@triton.jit
def _sequence_length(SEQLENS, batch, num_new, capacity):
    """Keys of the sequence after the append, clamped to [0, capacity] (a bad length can never address past it)."""
    return tl.minimum(tl.maximum(tl.load(SEQLENS + batch) + num_new, 0), capacity)


# ----------------------------------------------------------------------------------------------------------------
# 1. Append (with rotary)
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
def _append_kernel(
    Q, Q_OUT, K_NEW, V_NEW, K, V, BLOCK_TABLE, SEQLENS, COS, SIN,
    stride_qb, stride_qm, stride_qh, stride_ob, stride_om, stride_oh,
    stride_nb, stride_nm, stride_nh, stride_vnb, stride_vnm, stride_vnh,
    stride_kb, stride_krow, stride_kh, stride_vb, stride_vrow, stride_vh,
    stride_btb, stride_cos,
    seqlen_q, num_new, num_q_heads, capacity, num_blocks, max_blocks, rotary_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    ROTARY: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, Q_POSITIONS_PER_TOKEN: tl.constexpr,
):
    """Program (token t, batch b, head slot): slots < num_q_heads rotate q's head into Q_OUT (ROTARY only); the
    rest append k_new/v_new of KV head ``slot - num_q_heads`` at cache position ``cache_seqlens[b] + t``."""
    token = tl.program_id(0)
    batch = tl.program_id(1)
    slot = tl.program_id(2)
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < HEAD_DIM
    old_len = tl.load(SEQLENS + batch)
    b64 = batch.to(tl.int64)
    if slot < num_q_heads:
        if ROTARY:
            if token < seqlen_q:
                # flash-attn's convention: with a causal or windowed mask each new query token sits at its own
                # position; without one, all of them at cache_seqlens.
                pos = old_len + token if Q_POSITIONS_PER_TOKEN else old_len
                src = Q + b64 * stride_qb + token * stride_qm + slot * stride_qh
                q = _rotate(src, cols, pos, COS, SIN, stride_cos, rotary_rows, HEAD_DIM, ROTARY_DIM, INTERLEAVED)
                dst = Q_OUT + b64 * stride_ob + token * stride_om + slot * stride_oh
                tl.store(dst + cols, q.to(Q_OUT.dtype.element_ty), mask=in_row)
    else:
        head = slot - num_q_heads
        pos = old_len + token
        if (token < num_new) & (pos >= 0) & (pos < capacity):
            src = K_NEW + b64 * stride_nb + token * stride_nm + head * stride_nh
            if ROTARY:
                k = _rotate(src, cols, pos, COS, SIN, stride_cos, rotary_rows, HEAD_DIM, ROTARY_DIM, INTERLEAVED)
            else:
                k = tl.load(src + cols, mask=in_row, other=0.0)
            v = tl.load(V_NEW + b64 * stride_vnb + token * stride_vnm + head * stride_vnh + cols, mask=in_row,
                        other=0.0)
            table_row = BLOCK_TABLE + b64 * stride_btb
            k_row = _cache_rows(batch, 0, pos, True, table_row, num_blocks, max_blocks, stride_kb, stride_krow,
                                PAGED, PAGE_SIZE, False)
            v_row = _cache_rows(batch, 0, pos, True, table_row, num_blocks, max_blocks, stride_vb, stride_vrow,
                                PAGED, PAGE_SIZE, False)
            tl.store(K + k_row + head * stride_kh + cols, k.to(K.dtype.element_ty), mask=in_row)
            tl.store(V + v_row + head * stride_vh + cols, v.to(V.dtype.element_ty), mask=in_row)


# ----------------------------------------------------------------------------------------------------------------
# 2. Split-KV attention over the cache
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _attend(acc, l_i, m_i, q, token, slope_log2, key_lo, key_hi,
            k_head, v_head, block_table_row, batch, seqlen_k, diagonal, num_blocks, max_blocks,
            stride_kb, stride_krow, stride_vb, stride_vrow,
            window_left, window_right, qk_scale, softcap_scale,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
            PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, ONE_PAGE: tl.constexpr,
            MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
            SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold key tiles [key_lo, key_hi) into the running (acc, l, m). MASKED tiles check bounds and the window."""
    cols = tl.arange(0, BLOCK_D)
    # One-page tiles: the next tile's block index is read one iteration ahead, so the K/V loads do not wait on a
    # table load of their own iteration and software-pipeline like a contiguous cache's.
    page = tl.zeros([], dtype=tl.int64)
    if PAGED and ONE_PAGE:
        page = _page_block(block_table_row, key_lo, num_blocks, max_blocks, PAGE_SIZE)
    for start_n in range(key_lo, key_hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        pos = start_n + tl.arange(0, BLOCK_N)
        row_ok = pos < seqlen_k
        k_rows = _cache_rows(batch, page, pos, row_ok, block_table_row, num_blocks, max_blocks, stride_kb,
                             stride_krow, PAGED, PAGE_SIZE, ONE_PAGE)
        v_rows = _cache_rows(batch, page, pos, row_ok, block_table_row, num_blocks, max_blocks, stride_vb,
                             stride_vrow, PAGED, PAGE_SIZE, ONE_PAGE)
        if PAGED and ONE_PAGE:
            page = _page_block(block_table_row, tl.minimum(start_n + BLOCK_N, key_hi - 1), num_blocks, max_blocks,
                               PAGE_SIZE)
        k_ptrs = k_head + k_rows[:, None] + cols[None, :]
        v_ptrs = v_head + v_rows[:, None] + cols[None, :]
        if MASKED or BLOCK_D != HEAD_DIM:
            load_mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
            k = tl.load(k_ptrs, mask=load_mask, other=0.0)
            v = tl.load(v_ptrs, mask=load_mask, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
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
    return acc, l_i, m_i


@triton.jit
def _decode_kernel(
    Q, K, V, BLOCK_TABLE, SEQLENS, SLOPES, O, LSE, O_PART, LSE_PART,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_krow, stride_kh, stride_vb, stride_vrow, stride_vh,
    stride_btb, stride_sb, stride_ob, stride_om, stride_oh,
    num_kv_heads, group, num_new, capacity, num_blocks, max_blocks, num_splits,
    window_left, window_right, qk_scale, softcap_scale,
    SEQLEN_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // num_kv_heads
    kv_head = pid_bh % num_kv_heads
    b64 = batch.to(tl.int64)

    # GQA packing: row r of the tile is query head kv_head*group + r // Lq, new token r % Lq.
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * SEQLEN_Q
    token = rows % SEQLEN_Q
    q_head = kv_head * group + rows // SEQLEN_Q
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_DIM
    q_rows = b64 * stride_qb + token * stride_qm + q_head * stride_qh
    q = tl.load(Q + q_rows[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if ALIBI:  # slopes (B, Hq) with a batch stride of 0 for per-head slopes; log2 units like the scores
        slope_log2 = tl.load(SLOPES + b64 * stride_sb + q_head, mask=row_ok, other=0.0).to(tl.float32) * LOG2_E
    else:
        slope_log2 = tl.zeros([BLOCK_M], dtype=tl.float32)

    seqlen_k = _sequence_length(SEQLENS, batch, num_new, capacity)
    diagonal = seqlen_k - SEQLEN_Q  # the new tokens are the last SEQLEN_Q positions
    key_start, full_start, full_end, key_end = key_tile_range(
        0, SEQLEN_Q, seqlen_k, window_left, window_right, SEQLEN_Q, BLOCK_N, MASK_LEFT, MASK_RIGHT)
    # This split's run of whole tiles; full tiles inside it run without masks.
    tiles_per_split = tl.cdiv(tl.cdiv(key_end - key_start, BLOCK_N), num_splits)
    lo = tl.minimum(key_start + split * tiles_per_split * BLOCK_N, key_end)
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
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, token, slope_log2, lo, full_lo, k_head, v_head, table_row, batch,
                            seqlen_k, diagonal, num_blocks, max_blocks, stride_kb, stride_krow, stride_vb, stride_vrow,
                            window_left, window_right, qk_scale, softcap_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                            PAGED, PAGE_SIZE, ONE_PAGE, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DOT_PRECISION)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, token, slope_log2, full_lo, full_hi, k_head, v_head, table_row, batch,
                            seqlen_k, diagonal, num_blocks, max_blocks, stride_kb, stride_krow, stride_vb, stride_vrow,
                            window_left, window_right, qk_scale, softcap_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                            PAGED, PAGE_SIZE, ONE_PAGE, False, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DOT_PRECISION)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, token, slope_log2, full_hi, hi, k_head, v_head, table_row, batch,
                            seqlen_k, diagonal, num_blocks, max_blocks, stride_kb, stride_krow, stride_vb, stride_vrow,
                            window_left, window_right, qk_scale, softcap_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                            PAGED, PAGE_SIZE, ONE_PAGE, True, MASK_LEFT, MASK_RIGHT, SOFTCAP, ALIBI, DOT_PRECISION)

    no_key = l_i == 0.0
    l_safe = tl.where(no_key, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse_log2 = tl.where(no_key, float("-inf"), m_i + tl.math.log2(l_safe))
    # Row (query head, token) as one index into (B, Hq, Lq): the final LSE's layout and the partials' row order.
    row_index = (b64 * num_kv_heads * group + q_head) * SEQLEN_Q + token
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        part = split.to(tl.int64) * tl.num_programs(1) * group * SEQLEN_Q + row_index
        tl.store(LSE_PART + part, lse_log2, mask=row_ok)
        tl.store(O_PART + part[:, None] * HEAD_DIM + cols[None, :], out, mask=out_mask)
    else:
        tl.store(LSE + row_index, lse_log2 * LN_2, mask=row_ok)
        o_rows = b64 * stride_ob + token * stride_om + q_head * stride_oh
        tl.store(O + o_rows[:, None] + cols[None, :], out.to(O.dtype.element_ty), mask=out_mask)


# ----------------------------------------------------------------------------------------------------------------
# 3. Merge the splits by log-sum-exp
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(O_PART, LSE_PART, O, LSE, num_rows, num_splits, num_q_heads, stride_ob, stride_om, stride_oh,
                    SEQLEN_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    """Program per row (b, query head, token): out = sum_s 2^(lse_s - lse) · out_s with lse = log2 sum_s 2^lse_s.
    Splits that saw no key carry lse -inf and weigh 0; a row no split saw gets zeros and -inf."""
    row = tl.program_id(0).to(tl.int64)
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
    tl.store(LSE + row, lse)
    token = row % SEQLEN_Q
    q_head = (row // SEQLEN_Q) % num_q_heads
    batch = row // (SEQLEN_Q * num_q_heads)
    tl.store(O + batch * stride_ob + token * stride_om + q_head * stride_oh + cols, out.to(O.dtype.element_ty),
             mask=col_ok)
