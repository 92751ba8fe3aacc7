"""The layer below `flash_attention_decode` and the paged path of `flash_attention_varlen`: checked problem -> plan ->
execute, once per call (the custom ops call these too)."""

from __future__ import annotations

import torch

from flashmoe_science.attention.checks import resolve_check_values
from flashmoe_science.attention.decode.checks import (check_cache_varlen, check_call_options, check_decode,
                                                      check_decode_values, per_sequence)
from flashmoe_science.attention.decode.pages import split_pages
from flashmoe_science.attention.decode.plan import BACKENDS, plan_decode
from flashmoe_science.attention.decode.problem import CacheCall
from flashmoe_science.attention.decode.reference import q_positions_per_token


def decode_call(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None, v_new=None, rotary_cos=None,
                rotary_sin=None, rotary_interleaved=False, cache_batch_idx=None, cache_leftpad=None, k_scale=None,
                v_scale=None, causal=True, softmax_scale=None, window=None, softcap=None, alibi_slopes=None,
                return_lse=False, num_splits="auto", backend="auto", check_values=None):
    """(out, lse) of `flash_attention_decode` (its arguments): the checks, the plan and the kernels, once. The
    custom ops (torch.compile) call this too."""
    k_cache, v_cache, block_table = split_pages(k_cache, v_cache, block_table)
    problem = check_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, rotary_cos, rotary_sin,
                           causal, softmax_scale, window, softcap, alibi_slopes, cache_batch_idx=cache_batch_idx,
                           cache_leftpad=cache_leftpad, k_scale=k_scale, v_scale=v_scale)
    check_call_options(rotary_interleaved, return_lse, num_splits, backend, BACKENDS)
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((problem.batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if resolve_check_values(check_values, q.device):
        reach = max(problem.num_new, problem.seqlen_q if q_positions_per_token(problem) else 1)
        check_decode_values(problem, k_cache, cache_seqlens, block_table, rotary_cos, cache_starts=cache_leftpad,
                            cache_batch_idx=cache_batch_idx, rotary_positions=reach)
    call = CacheCall(q, k_cache, v_cache, cache_seqlens, cache_leftpad, cache_batch_idx, block_table, None, k_new,
                     v_new, rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes, k_scale, v_scale)
    return plan_decode(problem, q, num_splits, backend).plan.run(call, problem)


def cache_varlen_call(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, *, cu_seqlens_k=None, seqused_k=None,
                      block_table=None, causal=False, softmax_scale=None, window=None, softcap=None,
                      alibi_slopes=None, k_scale=None, v_scale=None, num_splits="auto", backend="auto",
                      check_values=None):
    """(out (total_q, Hq, D), lse (Hq, total_q)) of packed queries against keys read in place: a paged cache
    (block_table; sequence b's keys are positions [0, seqused_k[b]) of its table row, or cu_seqlens_k's lengths
    where seqused_k is None) or a packed (total_k, Hkv, D) key tensor whose sequence b starts at row
    cu_seqlens_k[b] and holds seqused_k[b] keys. flash_attn_varlen_func's paged and seqused_k conventions."""
    k_cache, v_cache, block_table = split_pages(k_cache, v_cache, block_table)
    problem = check_cache_varlen(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, block_table, causal, softmax_scale,
                                 window, softcap, alibi_slopes, k_scale, v_scale)
    check_call_options(False, False, num_splits, backend, BACKENDS)
    if seqused_k is None and cu_seqlens_k is None:
        raise ValueError("pass seqused_k or cu_seqlens_k: the keys of each sequence")
    for name, t, size in (("cu_seqlens_k", cu_seqlens_k, problem.batch + 1), ("seqused_k", seqused_k, problem.batch)):
        if t is not None:
            per_sequence(name, t, size, q.device)
    starts = None
    if seqused_k is not None:
        lengths = seqused_k
    else:
        lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if block_table is None:
        if cu_seqlens_k is None:
            raise ValueError("packed keys (no block_table) need cu_seqlens_k: where each sequence's keys start")
        starts = cu_seqlens_k[:-1]
        ends = (starts + lengths).to(torch.int32)
    else:
        ends = lengths
    if resolve_check_values(check_values, q.device):
        check_decode_values(problem, k_cache, ends, block_table, None, cache_starts=starts, cu_seqlens_q=cu_seqlens_q,
                            total_q=q.shape[0])
    call = CacheCall(q, k_cache, v_cache, ends, starts, None, block_table, cu_seqlens_q, alibi_slopes=alibi_slopes,
                     k_scale=k_scale, v_scale=v_scale)
    return plan_decode(problem, q, num_splits, backend).plan.run(call, problem)
