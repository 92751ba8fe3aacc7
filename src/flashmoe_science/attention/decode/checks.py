"""The checks of a cache call, once: shapes, dtypes, devices and options (`check_decode`, `check_cache_varlen`;
TypeError/ValueError naming the argument), and the values on the host in eager calls (`check_decode_values`)."""

from __future__ import annotations

import math
import numbers

import torch

from flashmoe_science.attention.checks import check_backend, check_head_dim
from flashmoe_science.attention.decode.problem import FP8_CACHE, DecodeProblem
from flashmoe_science.attention.mask import make_mask

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 256


def _tensor(name, t, dims: int, dtype=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def _same_device(name, t, device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")


def _unit_last_stride(name, t) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim (got strides {t.stride()}); "
                         "pass .contiguous() explicitly if a copy is intended")


def per_sequence(name, t, batch, device) -> None:
    _tensor(name, t, 1, torch.int32)
    _same_device(name, t, device)
    if t.shape[0] != batch:
        raise ValueError(f"{name} must have q's batch size {batch} entries, got {t.shape[0]}")


def _check_scales(k_cache, k_scale, v_scale, num_kv_heads, device) -> bool:
    """Whether the cache is FP8 (then its scales are checked), refusing scales for a 16/32-bit cache."""
    fp8 = k_cache.dtype == FP8_CACHE
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale apply to float8_e4m3fn caches only, got a {k_cache.dtype} cache")
        return False
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            raise ValueError(f"{name} is required with a float8_e4m3fn cache (float32 of shape ({num_kv_heads},) "
                             f"or (1,): cache value x scale = the key or value)")
        _tensor(name, t, 1, torch.float32)
        _same_device(name, t, device)
        if t.shape[0] not in (1, num_kv_heads):
            raise ValueError(f"{name} must have shape ({num_kv_heads},) or (1,), got {tuple(t.shape)}")
    return True


def _check_cache(q, k_cache, v_cache, head_dim):
    """k_cache/v_cache against q: dtype (q's, or e4m3), device, layout, head dim. Returns Hkv."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, 4)
        if t.dtype not in (q.dtype, FP8_CACHE):
            raise TypeError(f"{name} must be {q.dtype} (q's dtype) or float8_e4m3fn, got {t.dtype}")
        _same_device(name, t, q.device)
        _unit_last_stride(name, t)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)} and dtype {k_cache.dtype}, got "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache's head dim must equal q's ({head_dim}), got {k_cache.shape[3]}")
    num_kv_heads = k_cache.shape[2]
    num_q_heads = q.shape[-2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"q's head count ({num_q_heads}) must be a multiple of the cache's ({num_kv_heads}) "
                         "(GQA/MQA)")
    return num_kv_heads


def _check_block_table(block_table, batch, k_cache, device) -> tuple[int, int]:
    """(block size, capacity) of a paged cache."""
    _tensor("block_table", block_table, 2, torch.int32)
    _same_device("block_table", block_table, device)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must have q's batch size {batch} rows, got {block_table.shape[0]}")
    if block_table.shape[1] == 0:
        raise ValueError("block_table must have at least one column")
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table must have unit stride in dim 1, got strides {block_table.stride()}")
    block_size = k_cache.shape[1]
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"paged k_cache's block size (dim 1) must be in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], or a "
                         f"multiple of such a size with each page's rows adjacent to the next page's in memory, got "
                         f"{block_size}")
    if k_cache.shape[0] == 0:
        raise ValueError("a paged k_cache must hold at least one block (dim 0)")
    return block_size, block_table.shape[1] * block_size


def _check_mask_options(q, batch, num_q_heads, causal, window, softcap, alibi_slopes, softmax_scale, head_dim):
    mask = make_mask(causal, window, softcap)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
        _same_device("alibi_slopes", alibi_slopes, q.device)
        slope_dtypes = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        if alibi_slopes.dtype not in slope_dtypes or alibi_slopes.shape not in ((num_q_heads,), (batch, num_q_heads)):
            raise ValueError(f"alibi_slopes must be float32 of shape ({num_q_heads},) or ({batch}, {num_q_heads}), "
                             f"got {alibi_slopes.dtype} {tuple(alibi_slopes.shape)}")
        if alibi_slopes.stride(-1) != 1:
            raise ValueError("alibi_slopes must have unit stride in its last dim")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    elif not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return mask, float(softmax_scale)


def _check_query(q, dims):
    _tensor("q", q, dims)
    if q.dtype not in KERNEL_DTYPES + (torch.float64,):
        raise TypeError(f"q must be bfloat16, float16 or float32 (float64 on the reference), got {q.dtype}")
    head_dim = q.shape[-1]
    check_head_dim(head_dim)  # any: the kernels pad the head dim to a power of two and mask the loads
    _unit_last_stride("q", q)
    return head_dim


def check_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, rotary_cos, rotary_sin,
                 causal, softmax_scale, window, softcap, alibi_slopes, *, cache_batch_idx=None, cache_leftpad=None,
                 k_scale=None, v_scale=None) -> DecodeProblem:
    """Check every argument's type, shape, dtype and device (never values: see `check_decode_values`)."""
    head_dim = _check_query(q, 4)
    batch, seqlen_q, num_q_heads, _ = q.shape
    if seqlen_q == 0:
        raise ValueError("q must hold at least one new token (dim 1)")
    num_kv_heads = _check_cache(q, k_cache, v_cache, head_dim)
    fp8 = _check_scales(k_cache, k_scale, v_scale, num_kv_heads, q.device)

    if block_table is None:
        paged, block_size = False, k_cache.shape[1]
        capacity = block_size
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(f"a contiguous k_cache must have q's batch size {batch} in dim 0 (or pass "
                             f"cache_batch_idx), got {k_cache.shape[0]}")
    else:
        for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if t is not None:
                raise ValueError(f"{name} applies to contiguous caches only, not with block_table (as flash_attn)")
        block_size, capacity = _check_block_table(block_table, batch, k_cache, q.device)
        paged = True
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            per_sequence(name, t, batch, q.device)

    if isinstance(cache_seqlens, torch.Tensor):
        per_sequence("cache_seqlens", cache_seqlens, batch, q.device)
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, numbers.Integral):
        raise TypeError(f"cache_seqlens must be an int32 tensor (B,) or an int, got {type(cache_seqlens).__name__}")

    num_new = 0
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _tensor(name, t, 4, q.dtype)
            _same_device(name, t, q.device)
            _unit_last_stride(name, t)
            if t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:]:
                raise ValueError(f"{name} must have shape (B={batch}, L_new, Hkv={num_kv_heads}, D={head_dim}), "
                                 f"got {tuple(t.shape)}")
        if v_new.shape != k_new.shape:
            raise ValueError(f"v_new must have k_new's shape {tuple(k_new.shape)}, got {tuple(v_new.shape)}")
        num_new = k_new.shape[1]
        if num_new > capacity:
            raise ValueError(f"k_new's {num_new} tokens overflow the cache's capacity of {capacity} per sequence")

    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k_new is None:
            raise ValueError("rotary_cos/rotary_sin apply to q and k_new: pass k_new and v_new with them")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _tensor(name, t, 2)
            _same_device(name, t, q.device)
            if not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have unit stride in its last dim")
        if rotary_sin.shape != rotary_cos.shape or rotary_sin.stride() != rotary_cos.stride():
            raise ValueError(f"rotary_sin must have rotary_cos's shape and strides {tuple(rotary_cos.shape)}, "
                             f"got {tuple(rotary_sin.shape)}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if not 0 < rotary_dim <= head_dim or rotary_cos.shape[0] == 0:
            raise ValueError(f"rotary_cos must be (seqlen_ro >= 1, rotary_dim / 2) with rotary_dim <= head dim "
                             f"{head_dim}, got {tuple(rotary_cos.shape)}")

    mask, scale = _check_mask_options(q, batch, num_q_heads, causal, window, softcap, alibi_slopes, softmax_scale,
                                      head_dim)
    packed_cache = not paged and k_cache.is_contiguous() and v_cache.is_contiguous()
    return DecodeProblem(batch, seqlen_q, num_q_heads, num_kv_heads, head_dim, paged, block_size, capacity,
                         num_new, mask, scale, cache_batch=k_cache.shape[0], fp8=fp8, dtype=q.dtype,
                         rows_indexed=cache_batch_idx is not None or cache_leftpad is not None,
                         alibi=alibi_slopes is not None, packed_cache=packed_cache)


def check_cache_varlen(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, block_table, causal, softmax_scale, window,
                       softcap, alibi_slopes, k_scale=None, v_scale=None) -> DecodeProblem:
    """The checks of a packed-query call against a cache (`cache_varlen_call`): q `(total_q, Hq, D)`, queries of
    sequence b at rows [cu_seqlens_q[b], cu_seqlens_q[b+1]), a paged cache with block_table or a packed
    `(total_k, Hkv, D)` key tensor without."""
    head_dim = _check_query(q, 3)
    _tensor("cu_seqlens_q", cu_seqlens_q, 1, torch.int32)
    _same_device("cu_seqlens_q", cu_seqlens_q, q.device)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have batch + 1 entries")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, numbers.Integral) or max_seqlen_q < 0:
        raise TypeError(f"max_seqlen_q must be a non-negative int, got {max_seqlen_q!r}")
    batch = cu_seqlens_q.shape[0] - 1
    if block_table is not None:
        num_kv_heads = _check_cache(q, k_cache, v_cache, head_dim)
        block_size, capacity = _check_block_table(block_table, batch, k_cache, q.device)
    else:
        for name, t in (("k", k_cache), ("v", v_cache)):
            _tensor(name, t, 3)
        num_kv_heads = _check_cache(q, k_cache.unsqueeze(0), v_cache.unsqueeze(0), head_dim)
        block_size = capacity = k_cache.shape[0]
    fp8 = _check_scales(k_cache, k_scale, v_scale, num_kv_heads, q.device)
    mask, scale = _check_mask_options(q, batch, q.shape[1], causal, window, softcap, alibi_slopes, softmax_scale,
                                      head_dim)
    return DecodeProblem(batch, int(max_seqlen_q), q.shape[1], num_kv_heads, head_dim, block_table is not None,
                         block_size, capacity, 0, mask, scale, cache_batch=1, packed_q=True, fp8=fp8,
                         dtype=q.dtype)


def check_decode_values(problem: DecodeProblem, k_cache, cache_seqlens, block_table, rotary_cos, *,
                        cache_starts=None, cache_batch_idx=None, rotary_positions: int = 0, cu_seqlens_q=None,
                        total_q: int = 0) -> None:
    """The value checks, from one device-to-host copy of a few flags (more copies only to name a bad entry).

    cache_seqlens: each sequence's end position before the append; cache_starts: its first position (leftpad, or a
    packed sequence's first key row); rotary_positions: how far past the end the rotary table is read; cu_seqlens_q
    (packed queries): starts at 0, never decreases, ends at most at total_q (rows after it are not attended: their
    output is 0), no sequence longer than the problem's seqlen_q."""
    ends = cache_seqlens.to(torch.int64)
    starts = cache_starts.to(torch.int64) if cache_starts is not None else torch.zeros_like(ends)
    totals = ends + problem.num_new
    flags = [(starts < 0) | (ends < starts), totals > problem.capacity]
    if cache_batch_idx is not None:
        flags.append((cache_batch_idx < 0) | (cache_batch_idx >= problem.cache_batch))
    if block_table is not None:
        used = (totals.clamp(0, problem.capacity) + problem.block_size - 1) // problem.block_size
        in_use = torch.arange(block_table.shape[1], device=block_table.device).unsqueeze(0) < used.unsqueeze(1)
        outside = in_use & ((block_table < 0) | (block_table >= k_cache.shape[0]))
        flags.append(outside.any(dim=1))
    if rotary_cos is not None:
        flags.append(ends + rotary_positions > rotary_cos.shape[0])
    if not ends.numel():
        return
    queries = torch.zeros((), dtype=torch.bool, device=ends.device)
    if cu_seqlens_q is not None:
        lengths = cu_seqlens_q.diff()
        queries = ((cu_seqlens_q[0] != 0) | (cu_seqlens_q[-1] > total_q) | (lengths < 0).any()
                   | (lengths > problem.seqlen_q).any())
    *found, bad_queries = torch.stack([f.any() for f in flags] + [queries]).tolist()  # the one synchronisation
    if bad_queries:
        raise ValueError(f"cu_seqlens_q must start at 0, not decrease, end at most at the {total_q} packed queries, "
                         f"with no sequence longer than max_seqlen_q = {problem.seqlen_q}")
    if not any(found):
        return
    row = lambda f: int(f.nonzero()[0, 0])  # noqa: E731
    if found[0]:
        b = row(flags[0])
        raise ValueError(f"sequence {b}: cache_seqlens[{b}] = {int(ends[b])} must be >= 0 and >= its first position "
                         f"{int(starts[b])} (cache_leftpad)")
    if found[1]:
        b = row(flags[1])
        what = "k_new overflows the cache" if problem.num_new else "cache_seqlens exceeds the cache's capacity"
        where = "block_table's capacity (columns x block size)" if problem.paged else "the cache's length"
        raise ValueError(f"cache_seqlens[{b}] = {int(ends[b])} (+ {problem.num_new} new tokens) must lie in "
                         f"[0, {problem.capacity}], {where}: {what}")
    index = 2
    if cache_batch_idx is not None:
        if found[index]:
            b = row(flags[index])
            raise ValueError(f"cache_batch_idx[{b}] = {int(cache_batch_idx[b])} is out of range: the cache holds rows "
                             f"0..{problem.cache_batch - 1}")
        index += 1
    if block_table is not None:
        if found[index]:
            b, col = (int(i) for i in outside.nonzero()[0])
            raise ValueError(f"block_table[{b}, {col}] = {int(block_table[b, col])} is out of range: the paged cache "
                             f"holds blocks 0..{k_cache.shape[0] - 1}")
        index += 1
    b = row(flags[index])
    raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions; sequence {b} reaches position "
                     f"{int(ends[b]) + rotary_positions - 1}")


def check_call_options(rotary_interleaved, return_lse, num_splits, backend, backends) -> None:
    """The options of the call beside the tensors; `backends`: what `backend=` takes (plan.BACKENDS)."""
    if not isinstance(rotary_interleaved, bool) or not isinstance(return_lse, bool):
        raise TypeError("rotary_interleaved and return_lse must be bools")
    if num_splits != "auto" and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
                                 or num_splits < 1):
        raise ValueError(f"num_splits must be 'auto' or an int >= 1, got {num_splits!r}")
    check_backend(backend, backends)
