"""The front door of attention against a KV cache: `flash_attention_decode` (see the package docstring for the
conventions)."""

from __future__ import annotations

import torch

from flashmoe_science.attention.checks import check_flags
from flashmoe_science.attention.decode import ops
from flashmoe_science.attention.decode.call import decode_call


def flash_attention_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None, v_new=None,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=False, cache_batch_idx=None,
                           cache_leftpad=None, k_scale=None, v_scale=None, causal=True, softmax_scale=None,
                           window=None, softcap=None, alibi_slopes=None, return_lse=False, num_splits="auto",
                           backend="auto", check_values=None):
    """Attention of new tokens (1 for decode, a few for speculative decoding, thousands for a chunked prefill)
    against a KV cache (see the module docstring for the conventions).

    Args:
        q: (B, Lq, Hq, D), Lq >= 1, D in [1, 256], bf16/fp16/fp32 (float64 on the reference), Hq a multiple of
            Hkv.
        k_cache, v_cache: contiguous (B_cache, Lmax, Hkv, D), or paged (num_blocks, block_size, Hkv, D) with
            ``block_table`` (B, max_blocks) int32, block_size in 16..256 or a multiple of such a size with
            adjacent pages (read as smaller pages: `decode.pages`); q's dtype, or float8_e4m3fn with
            ``k_scale``/``v_scale`` (float32 (Hkv,) or (1,)). Written in place when k_new is given.
        cache_seqlens: int32 (B,) (or an int for every row): the cache's end before the call.
        k_new, v_new: (B, L_new, Hkv, D) in q's dtype, appended at cache_seqlens before attending.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), applied to q and k_new (needs k_new);
            ``rotary_interleaved`` picks GPT-J pairs (2j, 2j+1) over GPT-NeoX halves.
        cache_batch_idx, cache_leftpad: int32 (B,), contiguous caches only: the cache row of each sequence, and the
            position its keys start at.
        causal, window (left, right), softcap, alibi_slopes ((Hq,) or (B, Hq) float32): `attention.mask`'s rules
            with diagonal = Lk - Lq.
        return_lse: also return the natural-log LSE, float32 (B, Hq, Lq) (-inf for a row that sees no key).
        num_splits: "auto" (a heuristic on B, Hkv, the cache's capacity and the SM count) or an int >= 1.
        backend: "auto" (CUDA: the Triton kernels; CPU: the reference), "triton", "reference".
        check_values: None (default) checks lengths, cache rows, block-table entries and the rotary table's length
            on the host in eager calls (one synchronisation) and not while a CUDA graph is captured; False never
            (out-of-range values then give NaN rows); True always (refused during capture).

    Returns out (B, Lq, Hq, D) in q's dtype, and lse when return_lse.
    """
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        check_flags(return_lse=return_lse)
        if not isinstance(cache_seqlens, torch.Tensor):
            cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
        op = ops.attention_decode if k_new is None else ops.attention_decode_append
        out, lse = op(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, rotary_cos, rotary_sin,
                      rotary_interleaved, causal, softmax_scale, None if window is None else [int(s) for s in window],
                      softcap, alibi_slopes, 0 if num_splits == "auto" else num_splits, backend, check_values,
                      cache_batch_idx, cache_leftpad, k_scale, v_scale)
    else:
        out, lse = decode_call(q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k_new, v_new=v_new,
                               rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                               cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, k_scale=k_scale,
                               v_scale=v_scale, causal=causal, softmax_scale=softmax_scale, window=window,
                               softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse,
                               num_splits=num_splits, backend=backend, check_values=check_values)
    return (out, lse) if return_lse else out
