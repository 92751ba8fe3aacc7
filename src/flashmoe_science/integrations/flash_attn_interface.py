"""flash_attn's three entry points, with flash_attn's signatures and layouts, on this library's kernels.

For code written against ``flash_attn`` (serving engines, transformers' flash paths): tensors are token-major as
flash_attn's, ``(batch, seqlen, heads, head_dim)`` or packed ``(total, heads, head_dim)``, and the arguments keep
flash_attn's names and defaults (``window_size=(-1, -1)``, ``softcap=0.0``, ``rotary_interleaved=True``,
``num_splits=0`` for a heuristic). Each call is one public function of this library:

| flash_attn                  | here                                                                 |
|-----------------------------|----------------------------------------------------------------------|
| ``flash_attn_func``         | ``flash_attention_science`` on ``.transpose(1, 2)`` views (no copy)    |
| ``flash_attn_varlen_func``  | ``flash_attention_varlen`` (paged with ``block_table``, ``seqused_k``) |
| ``flash_attn_with_kvcache`` | ``flash_attention_decode`` (any number of new tokens)                  |

``return_attn_probs=True`` returns ``(out, softmax_lse)`` as FlashAttention-3's interface does (the kernels never
form the probabilities; the LSE is what merging partial results needs): lse ``(B, Hq, Lq)``, packed ``(Hq, total_q)``.
``window_size`` is a pair of ints or a 2-element tensor (flash_attn's tests draw it with ``torch.randint``).
Dropout and learnable sinks do not exist here: a nonzero ``dropout_p`` or any other argument flash_attn has and this
module does not raise (never a silent difference).

Errors: flash_attn checks its inputs in C++ (``TORCH_CHECK``: a RuntimeError, e.g. lengths past a block table's
capacity); this library's checks raise ValueError. Here they raise `FlashAttnInputError`, which is both, so code
written against either keeps catching them.
"""

from __future__ import annotations

import contextlib

import torch

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.decode import flash_attention_decode
from flashmoe_science.attention.varlen import flash_attention_varlen


class FlashAttnInputError(RuntimeError, ValueError):
    """A check of the inputs failed: a RuntimeError as flash_attn's own checks raise, and the ValueError this
    library's checks raise."""


@contextlib.contextmanager
def _as_flash_attn_errors():
    try:
        yield
    except FlashAttnInputError:
        raise
    except ValueError as error:
        raise FlashAttnInputError(str(error)) from error


def _refuse(dropout_p, unsupported: dict) -> None:
    if dropout_p:
        raise ValueError(f"dropout_p must be 0.0 (attention dropout is not implemented), got {dropout_p}")
    given = sorted(name for name, value in unsupported.items() if value is not None)
    if given:
        raise TypeError(f"unsupported flash_attn argument(s): {', '.join(given)}")


def _softcap(softcap: float):
    return softcap if softcap else None


def _window(window_size) -> tuple[int, int]:
    """flash_attn's (left, right), -1 for unbounded, as a pair of Python ints."""
    values = window_size.tolist() if isinstance(window_size, torch.Tensor) else list(window_size)
    if len(values) != 2 or any(isinstance(w, bool) or not isinstance(w, int) for w in values):
        raise ValueError(f"window_size must be a pair of ints (left, right), -1 for unbounded; got {window_size!r}")
    return values[0], values[1]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, **unsupported):
    """q (B, Lq, Hq, D), k/v (B, Lk, Hkv, D) -> out (B, Lq, Hq, D), or (out, lse (B, Hq, Lq)) with
    return_attn_probs."""
    _refuse(dropout_p, unsupported)
    with _as_flash_attn_errors():
        result = flash_attention_science(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                                         softmax_scale=softmax_scale, window=_window(window_size),
                                         softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
                                         deterministic=deterministic, return_lse=bool(return_attn_probs))
    if return_attn_probs:
        return result[0].transpose(1, 2), result[1]
    return result.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, seqused_k=None,
                           check_values=None, **unsupported):
    """Packed q (total_q, Hq, D); k/v packed (total_k, Hkv, D), or a paged cache (num_blocks, block_size, Hkv, D)
    with block_table (B, max_blocks) int32 (sequence b's keys: the first cu_seqlens_k[b+1] - cu_seqlens_k[b], or
    seqused_k[b], positions of its table row). check_values as flash_attention_varlen's (False: no host read of
    the lengths; padded tensors whose rows after the last sequence are never read). Returns out (total_q, Hq, D),
    or (out, lse (Hq, total_q)) with return_attn_probs."""
    _refuse(dropout_p, unsupported)
    with _as_flash_attn_errors():
        return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                      causal=causal, softmax_scale=softmax_scale, window=_window(window_size),
                                      softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
                                      deterministic=deterministic, return_lse=bool(return_attn_probs),
                                      block_table=block_table, seqused_k=seqused_k, check_values=check_values)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            k_scale=None, v_scale=None, check_values=None, **unsupported):
    """q (B, Lq, Hq, D) against k_cache/v_cache (contiguous (B_cache, Lmax, Hkv, D) or paged with block_table),
    appending k/v (B, L_new, Hkv, D) at cache_seqlens first (in place). cache_seqlens None: the whole contiguous
    cache. k_scale/v_scale: float32 (Hkv,) scales of float8_e4m3fn caches; check_values as flash_attention_decode's.
    Returns out (B, Lq, Hq, D), and the LSE (B, Hq, Lq) with return_softmax_lse."""
    _refuse(0.0, unsupported)
    if cache_seqlens is None:
        if block_table is not None:
            raise ValueError("cache_seqlens is required with block_table")
        cache_seqlens = k_cache.shape[1] - (0 if k is None else k.shape[1])
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: a heuristic), got {num_splits!r}")
    with _as_flash_attn_errors():
        return flash_attention_decode(
            q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k, v_new=v, rotary_cos=rotary_cos,
            rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, k_scale=k_scale, v_scale=v_scale, causal=causal,
            softmax_scale=softmax_scale, window=_window(window_size), softcap=_softcap(softcap),
            alibi_slopes=alibi_slopes, return_lse=bool(return_softmax_lse),
            num_splits="auto" if num_splits == 0 else num_splits, check_values=check_values)


__all__ = ["FlashAttnInputError", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
