"""Attention against a KV cache in PyTorch: the append, the rotary embedding and the gather of each sequence's keys,
then float32 (float64) attention. The CPU path, backend="reference", and the tests' oracle's building block."""

from __future__ import annotations

import torch

from flashmoe_science.attention.decode.problem import FP8_CACHE, DecodeProblem
from flashmoe_science.fp8_format import FP8_MAX
from flashmoe_science.attention.mask import score_mods


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x (B, L, H, D) rotated on its first 2·cos.shape[1] dims at positions (B, L) (clamped into the table)."""
    half = cos.shape[1]
    positions = positions.clamp(0, cos.shape[0] - 1)
    c = cos[positions].to(torch.float64 if x.dtype == torch.float64 else torch.float32).unsqueeze(2)
    s = sin[positions].to(c.dtype).unsqueeze(2)
    xf = x.to(c.dtype)
    rot, rest = xf[..., : 2 * half], xf[..., 2 * half :]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated, rest), dim=-1).to(x.dtype)


def q_positions_per_token(problem: DecodeProblem) -> bool:
    """flash_attn's rotary convention: with a causal or windowed mask each new query token sits at its own position;
    without one, all of them at cache_seqlens."""
    return problem.mask.causal or problem.mask.bounded_left or problem.mask.bounded_right


def rotate_new_tokens(q, k_new, cos, sin, cache_seqlens, problem: DecodeProblem, interleaved: bool):
    """(q, k_new) rotated at their positions: k_new's token t at cache_seqlens + t; q's token i there too when the
    mask is causal or windowed, else at cache_seqlens (flash_attn_with_kvcache's convention)."""
    starts = cache_seqlens.long().unsqueeze(1)
    k_new = apply_rotary(k_new, cos, sin, starts + torch.arange(problem.num_new, device=q.device), interleaved)
    q_pos = starts + torch.arange(problem.seqlen_q, device=q.device) * int(q_positions_per_token(problem))
    return apply_rotary(q, cos, sin, q_pos, interleaved), k_new


def quantize_to_cache(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(..., Hkv, D) values as an e4m3 cache stores them: value / scale per KV head, saturated at +-448."""
    return (x.to(torch.float32) / scale.to(torch.float32).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_CACHE)


def cache_positions(problem: DecodeProblem, block_table, row: int, positions: torch.Tensor):
    """(block index, row in block) of the cache rows at `positions` of cache row `row` (contiguous) or of block-table
    row `row` (paged)."""
    if not problem.paged:
        return torch.full_like(positions, row), positions
    return block_table[row, positions // problem.block_size].long(), positions % problem.block_size


def _attend_sequence(queries, keys, values, problem: DecodeProblem, slopes, compute):
    """queries (Lq, Hq, D), keys/values (Lk, Hkv, D) (dequantised), in `compute` -> (out (Lq, Hq, D), lse (Hq, Lq)).
    One KV head's keys against its group's query heads x tokens (no repeated K/V: the 1M-token oracle fits)."""
    lq, lk = queries.shape[0], keys.shape[0]
    queries = queries.transpose(0, 1).reshape(problem.num_kv_heads, problem.group * lq, problem.head_dim)
    scores = (queries @ keys.permute(1, 2, 0) * problem.softmax_scale).view(1, problem.num_q_heads, lq, lk)
    scores = score_mods(scores, problem.mask, lq, lk, slopes)[0]
    if lk == 0:
        lse = torch.full((problem.num_q_heads, lq), float("-inf"), dtype=compute, device=queries.device)
        return torch.zeros(lq, problem.num_q_heads, problem.head_dim, dtype=compute, device=queries.device), lse
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    weights = torch.exp(scores - torch.where(seen, lse, 0.0).unsqueeze(-1))
    out = (weights.view(problem.num_kv_heads, problem.group * lq, lk) @ values.transpose(0, 1)).view(-1, lq,
                                                                                                    values.shape[-1])
    return out.masked_fill(~seen.unsqueeze(-1), 0.0).transpose(0, 1), lse


def decode_reference(q, k_cache, v_cache, cache_seqlens, problem: DecodeProblem, block_table=None, k_new=None,
                     v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False, alibi_slopes=None, *,
                     cache_starts=None, cache_batch_idx=None, cu_seqlens_q=None, k_scale=None, v_scale=None):
    """Append (in place), gather each sequence's keys, attend: (out in q's layout and dtype, lse (B, Hq, Lq), or
    (Hq, total_q) for packed queries (cu_seqlens_q)), computed in float32 (float64 for float64). A sequence whose
    values are out of range (`triton/decode.py`'s rules) gets NaN, as in the kernels."""
    batch = problem.batch
    ends = torch.as_tensor(cache_seqlens).expand(batch).to("cpu", torch.int64)
    starts = cache_starts.to("cpu", torch.int64) if cache_starts is not None else torch.zeros_like(ends)
    rows = cache_batch_idx.to("cpu", torch.int64) if cache_batch_idx is not None else torch.arange(batch)
    if k_cache.dim() == 3:  # packed (total_k, Hkv, D) keys: one cache row that every sequence reads
        k_cache, v_cache, rows = k_cache.unsqueeze(0), v_cache.unsqueeze(0), torch.zeros_like(rows)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    if rotary_cos is not None:
        q, k_new = rotate_new_tokens(q, k_new, rotary_cos, rotary_sin, ends.to(q.device), problem,
                                     rotary_interleaved)
    if problem.packed_q:
        cu = cu_seqlens_q.to("cpu", torch.int64)
        q_rows = [(slice(None), slice(int(cu[b]), int(cu[b + 1]))) for b in range(batch)]
        out = torch.zeros(q.shape, dtype=compute, device=q.device)
        lse = torch.full((problem.num_q_heads, q.shape[0]), float("-inf"), dtype=compute, device=q.device)
    else:
        q_rows = [(b, slice(None)) for b in range(batch)]
        out = torch.zeros(q.shape, dtype=compute, device=q.device)
        lse = torch.full((batch, problem.num_q_heads, problem.seqlen_q), float("-inf"), dtype=compute,
                         device=q.device)
    num_blocks = k_cache.shape[0]
    k_scale = None if k_scale is None else k_scale.to(compute).expand(problem.num_kv_heads).unsqueeze(-1)
    v_scale = None if v_scale is None else v_scale.to(compute).expand(problem.num_kv_heads).unsqueeze(-1)
    for b in range(batch):
        start, end, row = int(starts[b]), int(ends[b]), int(rows[b])
        lk = end + problem.num_new - start
        bad = start < 0 or end < start or end + problem.num_new > problem.capacity
        bad = bad or (cache_batch_idx is not None and not 0 <= row < problem.cache_batch)
        if not bad and problem.paged:
            used = block_table[row, : (end + problem.num_new + problem.block_size - 1) // problem.block_size]
            bad = bool(((used < 0) | (used >= num_blocks)).any())
        query_rows = q[q_rows[b][0]][q_rows[b][1]] if problem.packed_q else q[b]
        out_view = out[q_rows[b][1]] if problem.packed_q else out[b]
        lse_view = lse[:, q_rows[b][1]] if problem.packed_q else lse[b]
        if bad:
            out_view.fill_(float("nan"))
            lse_view.fill_(float("nan"))
            continue
        if query_rows.shape[0] == 0 and k_new is None:
            continue
        if k_new is not None:
            blocks, cache_rows = cache_positions(problem, block_table, row, torch.arange(end, end + problem.num_new,
                                                                                          device=q.device))
            k_cache[blocks, cache_rows] = k_new[b] if k_scale is None else quantize_to_cache(k_new[b], k_scale[:, 0])
            v_cache[blocks, cache_rows] = v_new[b] if v_scale is None else quantize_to_cache(v_new[b], v_scale[:, 0])
        blocks, cache_rows = cache_positions(problem, block_table, row, torch.arange(start, start + lk,
                                                                                     device=q.device))
        keys, values = k_cache[blocks, cache_rows].to(compute), v_cache[blocks, cache_rows].to(compute)
        if k_scale is not None:
            keys, values = keys * k_scale, values * v_scale
        slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, -1)[b : b + 1]
        seq_out, seq_lse = _attend_sequence(query_rows.to(compute), keys, values, problem, slopes, compute)
        out_view.copy_(seq_out)
        lse_view.copy_(seq_lse)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)
