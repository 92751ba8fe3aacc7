"""Attention against a KV cache: the front door (checks, tiles and splits, dispatch) and the PyTorch reference.

``flash_attention_decode`` attends any number of new query tokens (one for decode, a few for speculative
decoding, thousands for a chunked prefill) to a KV cache, contiguous ``(B_cache, Lmax, Hkv, D)`` or paged
``(num_blocks, block_size, Hkv, D)`` with a block table, each sequence with its own length. Conventions follow
``flash_attn_with_kvcache``:

* ``cache_seqlens[b]`` keys are in the cache before the call. With ``k_new``/``v_new`` (``(B, L_new, Hkv, D)``) the
  new keys are first written at positions ``cache_seqlens[b] + t`` (in place), so the sequence has
  ``Lk = cache_seqlens[b] + L_new`` keys; without them ``Lk = cache_seqlens[b]``.
* ``cache_batch_idx[b]`` (contiguous caches): the cache row of sequence b (default b). ``cache_leftpad[b]``
  (contiguous caches): the sequence's keys start at that position; positions before it are padding, so the
  sequence has ``Lk = cache_seqlens[b] + L_new - cache_leftpad[b]`` keys and key j sits at ``j - cache_leftpad[b]``
  for the mask and ALiBi (rotary angles stay those of the cache positions).
* The ``Lq`` query tokens are the last ``Lq`` positions of the sequence: query i sits at ``Lk - Lq + i`` and the
  mask rules of `attention.mask` apply with ``diagonal = Lk - Lq`` (causal: query i sees keys ``<= Lk - Lq + i``).
* Rotary (``rotary_cos``/``rotary_sin`` of shape ``(seqlen_ro, rotary_dim / 2)``, with k_new only): k_new's token t
  is rotated at position ``cache_seqlens[b] + t``; q's token i at ``cache_seqlens[b] + i`` when the mask is causal
  or windowed, else at ``cache_seqlens[b]``. The caller's q is not modified.
* FP8 caches: ``float8_e4m3fn`` k_cache/v_cache with float32 ``k_scale``/``v_scale`` per KV head (``(Hkv,)``, or
  one value for all heads; a cache value times its scale is the key or value, vLLM's and FlashInfer's
  convention). New keys and values are appended as e4m3 of value / scale, saturated at +-448.

The cache kernel (`triton_decode`) serves every query count: its row tiles pack (token, query head of a KV head)
pairs, one tile for a decode step's group, many for a prefill chunk, whose tiles are the dense forward's
(`tiles.forward_tiles`). The packed-query form (`cache_varlen_call`) is the paged path of `flash_attention_varlen`.
A prefill chunk on a contiguous cache, beyond a decode step's tile and with nothing but what the dense forward
computes (`dense_chunk_refusal`), runs the dense packed forward on views of the cache instead (`DenseChunk`: the
Gluon sm_90 kernels on Hopper); ``plan_decode`` says which and why.

Values (lengths, block-table entries, cache rows, the rotary table's length) are checked on the host in eager calls:
one device-to-host copy of a few flags, as flash_attn pays for paged caches. The check is skipped while a CUDA graph
is being captured (``torch.cuda.is_current_stream_capturing()``) and when ``check_values=False``; then the kernels
trust nothing: a sequence whose values are out of range gets NaN outputs, never another sequence's keys, and no
read or write leaves the cache.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass

import torch

from flashmoe_science.attention.checks import check_backend, check_flags, check_head_dim, resolve_check_values
from flashmoe_science.attention.fp8_format import FP8_MAX
from flashmoe_science.attention.mask import MaskSpec, make_mask, score_mods
from flashmoe_science.attention.record import ran
from flashmoe_science.attention.tiles import forward_tiles
from flashmoe_science.backends import Choice, choose
from flashmoe_science.device import device_traits, dot_precision, on_another_cuda_device, triton_interpreter_on

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_CACHE = torch.float8_e4m3fn
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 256
DECODE_ROWS = 64  # row tiles up to this many (token, head) rows read the cache once per KV head: the decode tiles
MAX_SPLITS = 128
MIN_KEYS_PER_SPLIT = 512  # below this a split's fixed cost (partial write, combine) outweighs its parallelism
LONG_SPLIT_KEYS = 2048  # splits this long hide their fixed cost: then two CTAs per SM pay off


# ----------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeProblem:
    """A checked call's shapes and options (everything a kernel launch depends on besides tensor values)."""

    batch: int  # sequences
    seqlen_q: int  # query tokens per sequence (packed queries: the longest sequence's)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    paged: bool
    block_size: int  # paged block size, or Lmax for a contiguous cache (one "block" per sequence)
    capacity: int  # the last cache position + 1 a sequence may use: Lmax, or max_blocks * block_size
    num_new: int
    mask: MaskSpec
    softmax_scale: float
    cache_batch: int = 0  # rows of a contiguous cache (cache_batch_idx indexes them)
    packed_q: bool = False  # queries packed (total_q, Hq, D) with cu_seqlens_q
    fp8: bool = False
    dtype: torch.dtype = torch.bfloat16  # q's
    rows_indexed: bool = False  # cache_leftpad or cache_batch_idx given: sequences do not start at row 0 of row b
    alibi: bool = False
    packed_cache: bool = False  # a contiguous cache whose rows are one (B·Lmax, Hkv, D) tensor without a copy

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


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


def _per_sequence(name, t, batch, device) -> None:
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
        raise ValueError(f"paged k_cache's block size (dim 1) must be in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                         f"got {block_size}")
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
            _per_sequence(name, t, batch, q.device)

    if isinstance(cache_seqlens, torch.Tensor):
        _per_sequence("cache_seqlens", cache_seqlens, batch, q.device)
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


# ----------------------------------------------------------------------------------------------------------------
# Heuristics: tiles and the number of splits
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeTiles:
    block_m: int  # rows ((token, query head) pairs) per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def decode_tiles(problem: DecodeProblem, traits) -> DecodeTiles:
    """Up to DECODE_ROWS rows (a decode step's GQA group x new tokens, padded to the 16 rows of an MMA): one row tile,
    so each KV head's cache is read once. Key tile and pipeline measured on the H200
    (benchmarks/tools/sweep_attention_decode.py, docs/perf-notes.md): 64 keys, 4 warps, 3 stages led at B=1 128k for
    both layouts (3.80 / 3.46 TB/s before the paged prefetch; 32-key and 8-warp tiles down to 2.4). More rows (a
    prefill chunk): compute-bound like the dense forward, so the dense forward's tiles (`tiles.forward_tiles`)."""
    rows = problem.group * problem.seqlen_q
    if traits.capability == (0, 0):  # the interpreter: small tiles exercise the tile boundaries
        return DecodeTiles(min(64, max(16, 1 << (rows - 1).bit_length())), 16, 1, 1)
    if rows > DECODE_ROWS:
        tiles = forward_tiles(problem.head_dim, problem.dtype, problem.mask.causal, traits)
        # Above D=128 the gathered rows' bookkeeping does not fit beside a 64-key tile: the offline build for the
        # H200 (tests/attention/test_decode_build.py's compile) of the 128x64 tile spilled 136 LDL/STL (triton 3.9),
        # the 128x32 one 0-16 (not timed yet).
        block_n = min(tiles.block_n, 32) if problem.head_dim > 128 else tiles.block_n
        return DecodeTiles(tiles.block_m, block_n, tiles.num_warps, tiles.num_stages)
    block_n = 64 if problem.head_dim <= 128 else 32
    # An e4m3 key is half a bf16 key's bytes: twice the keys keep a tile's (and a pipeline stage's) bytes, which is
    # what the bf16 tile was measured for. Not measured for e4m3 yet: the sweep's --kv fp8 mode times the others.
    # A paged tile stays within one page (its one-table-entry prefetch), so page 64 keeps 64-key e4m3 tiles.
    wide = block_n * _key_bytes_factor(problem)
    block_n = wide if not problem.paged or problem.block_size % wide == 0 else block_n
    return DecodeTiles(max(16, 1 << (rows - 1).bit_length()), block_n, 4, 3)


def _key_bytes_factor(problem: DecodeProblem) -> int:
    """How many keys of this cache hold the bytes of one bf16 key (the unit the decode heuristics were measured in):
    2 for an e4m3 cache, else 1."""
    return 2 if problem.fp8 else 1


def choose_num_splits(problem: DecodeProblem, tiles: DecodeTiles, sm_count: int) -> int:
    """Splits of each sequence's keys, from shapes only (CUDA-graph safe), measured on the H200
    (benchmarks/tools/sweep_attention_decode.py, docs/perf-notes.md). batch x KV heads x row tiles programs exist already;
    splits fill the GPU up to a whole number of CTAs per SM and never past it (a few CTAs over a full wave cost a
    whole extra round: at B=2, 128k, 17 splits ran at 3.6 TB/s, 16 at 4.1). Two CTAs per SM where each split still
    gets >= LONG_SPLIT_KEYS keys of the cache's capacity (B=1 1M: 33 splits 4.45, 16 splits 4.28; B=1 128k paged:
    33 splits 3.77, 16 splits 3.34), else one (B=1 32k contiguous: 16 splits 2.67, 33 splits 2.59); never fewer
    than MIN_KEYS_PER_SPLIT keys per split. Key counts are bf16 keys' bytes (an e4m3 cache's thresholds are twice the
    keys)."""
    programs = problem.batch * problem.num_kv_heads * math.ceil(problem.group * problem.seqlen_q / tiles.block_m)
    splits = max(1, 2 * sm_count // programs)
    per_key = _key_bytes_factor(problem)  # the thresholds are bytes: an e4m3 split needs twice the keys
    if problem.capacity < splits * LONG_SPLIT_KEYS * per_key:
        splits = max(1, sm_count // programs)
    return max(1, min(splits, problem.capacity // (MIN_KEYS_PER_SPLIT * per_key), MAX_SPLITS))


# ----------------------------------------------------------------------------------------------------------------
# The reference (CPU path and test oracle's building block)
# ----------------------------------------------------------------------------------------------------------------


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
    values are out of range (`triton_decode`'s rules) gets NaN, as in the kernels."""
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


# ----------------------------------------------------------------------------------------------------------------
# The front door
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheCall:
    """One checked call's tensors as the executors take them: the queries (decode (B, Lq, Hq, D), or packed
    (total_q, Hq, D) with cu_seqlens_q), the caches, each sequence's end (before the append) and optional first
    position and cache row, and the optional append, rotary, ALiBi and FP8 scales."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ends: torch.Tensor
    starts: torch.Tensor | None = None
    cache_rows: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    k_new: torch.Tensor | None = None
    v_new: torch.Tensor | None = None
    rotary_cos: torch.Tensor | None = None
    rotary_sin: torch.Tensor | None = None
    rotary_interleaved: bool = False
    alibi_slopes: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class TritonDecode:
    """The Triton cache kernels (triton_decode): the append (with rotary, quantisation) where new keys come, the
    split-KV attention with `splits` key splits per sequence, and the LSE combine where splits > 1."""

    tiles: DecodeTiles
    splits: int
    backend = "triton"
    kernel = "triton_decode._decode_kernel"

    def run(self, call: CacheCall, problem: DecodeProblem):
        # Triton launches on the current device: make it q's
        with torch.cuda.device(call.q.device) if on_another_cuda_device(call.q) else contextlib.nullcontext():
            ran("forward", self.backend, self.kernel)
            return _launch(call, problem, self.tiles, self.splits)


@dataclass(frozen=True)
class _LaunchArgs:
    """The cache kernels' shared arguments, with placeholder pointers where an optional tensor is absent."""

    table: torch.Tensor
    starts: torch.Tensor
    rows: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    scale_stride: int
    cache_strides: tuple
    num_blocks: int
    max_blocks: int
    block_d: int
    layout: dict

    @classmethod
    def of(cls, call: CacheCall, problem: DecodeProblem, placeholder: torch.Tensor) -> "_LaunchArgs":
        ends, k_cache, v_cache = call.ends, call.k_cache, call.v_cache
        table = call.block_table if call.block_table is not None else ends
        cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3]) if k_cache.dim() == 4 else \
            (0, *k_cache.stride()[:2], 0, *v_cache.stride()[:2])  # a packed (total_k, Hkv, D) key tensor: one row
        return cls(table, call.starts if call.starts is not None else ends,
                   call.cache_rows if call.cache_rows is not None else ends,
                   call.k_scale if call.k_scale is not None else placeholder,
                   call.v_scale if call.v_scale is not None else placeholder,
                   call.k_scale.stride(0) if call.k_scale is not None and call.k_scale.shape[0] > 1 else 0,
                   cache_strides, k_cache.shape[0], table.shape[1] if call.block_table is not None else 1,
                   max(16, 1 << (problem.head_dim - 1).bit_length()),
                   dict(PAGED=problem.paged, PAGE_SIZE=problem.block_size if problem.paged else 1,
                        HAS_STARTS=call.starts is not None, HAS_CACHE_ROWS=call.cache_rows is not None,
                        FP8=problem.fp8))


def _append(call: CacheCall, problem: DecodeProblem, args: _LaunchArgs) -> torch.Tensor:
    """Writes k_new/v_new into the cache (rotated, quantised) where given; returns the queries to attend with (q
    rotated into a new tensor when rotary applies, else q)."""
    from flashmoe_science.attention import triton_decode as kernels

    q = call.q
    if call.k_new is None:
        return q
    rotary = call.rotary_cos is not None
    q_att = torch.empty_like(q) if rotary else q
    cos, sin = (call.rotary_cos, call.rotary_sin) if rotary else (q, q)
    hq, lq = problem.num_q_heads, problem.seqlen_q
    kernels._append_kernel[(max(lq, problem.num_new), problem.batch, hq + problem.num_kv_heads)](
        q, q_att, call.k_new, call.v_new, call.k_cache, call.v_cache, args.table, call.ends, args.starts, args.rows,
        cos, sin, args.k_scale, args.v_scale,
        *q.stride()[:3], *q_att.stride()[:3], *call.k_new.stride()[:3], *call.v_new.stride()[:3],
        *args.cache_strides, args.table.stride(0), cos.stride(0), args.scale_stride,
        lq, problem.num_new, hq, problem.capacity, problem.cache_batch, args.num_blocks, args.max_blocks, cos.shape[0],
        HEAD_DIM=problem.head_dim, BLOCK_D=args.block_d, **args.layout, ROTARY=rotary,
        ROTARY_DIM=2 * call.rotary_cos.shape[1] if rotary else 16, INTERLEAVED=call.rotary_interleaved,
        Q_POSITIONS_PER_TOKEN=q_positions_per_token(problem), num_warps=1)
    return q_att


@dataclass(frozen=True)
class DenseChunk:
    """A prefill chunk on a contiguous cache as the dense packed forward (`call.packed_forward`: the Gluon sm_90
    kernels where they take the call, else the portable ones) over views of the cache, no copy: the cache
    (B, Lmax, Hkv, D) is the packed key tensor (B·Lmax, Hkv, D), and sequence b is two packed sequences, its Lq
    queries against its rows [b·Lmax, b·Lmax + Lk_b), then no queries against the rest of its rows (cu_seqlens built
    on the device from cache_seqlens: no host read, so a CUDA graph captures it). Each packed sequence has its own
    diagonal Lk_b - Lq, the bottom-right alignment of every mask here. The append (rotary, new keys) runs first, as
    in the cache kernel. A sequence whose length is out of range attends no key and gets NaN (the cache kernel's
    rule)."""

    backend = "dense"
    kernel = "decode.dense_chunk"

    def run(self, call: CacheCall, problem: DecodeProblem):
        with torch.cuda.device(call.q.device) if on_another_cuda_device(call.q) else contextlib.nullcontext():
            ran("forward", self.backend, self.kernel)
            placeholder = torch.empty(0, dtype=torch.float32, device=call.q.device)
            q = _append(call, problem, _LaunchArgs.of(call, problem, placeholder))
            return dense_chunk(q, call.k_cache, call.v_cache, call.ends, problem)


def dense_chunk(q, k_cache, v_cache, ends, problem: DecodeProblem):
    """(out (B, Lq, Hq, D), lse (B, Hq, Lq)) of `DenseChunk`: q against contiguous caches already appended to."""
    from flashmoe_science.attention.call import packed_forward

    import triton

    from flashmoe_science.attention import triton_decode as kernels

    batch, lq, hq, d = q.shape
    lmax, mask = problem.capacity, problem.mask
    cu_q = torch.empty(2 * batch + 1, dtype=torch.int32, device=q.device)
    cu_k = torch.empty_like(cu_q)
    invalid = torch.empty(batch, dtype=torch.bool, device=q.device)
    kernels._chunk_bounds_kernel[(1,)](ends, cu_q, cu_k, invalid, batch, problem.num_new, lmax, lq,
                                       BLOCK_B=triton.next_power_of_2(batch))
    window = (mask.window_left, mask.window_right) if mask.bounded_left or mask.bounded_right else None
    keys = (t.view(batch * lmax, problem.num_kv_heads, d) for t in (k_cache, v_cache))
    out, lse = packed_forward(q.reshape(batch * lq, hq, d), *keys, cu_q, cu_k, lq, lmax, causal=mask.causal,
                              softmax_scale=problem.softmax_scale, window=window, softcap=mask.softcap or None,
                              return_lse=True)
    out = out.view(batch, lq, hq, d)
    lse = lse.view(hq, batch, lq).transpose(0, 1).contiguous()
    out.masked_fill_(invalid.view(batch, 1, 1, 1), float("nan"))
    lse.masked_fill_(invalid.view(batch, 1, 1), float("nan"))
    return out, lse


def _launch(call: CacheCall, problem: DecodeProblem, tiles: DecodeTiles, splits: int):
    from flashmoe_science.attention import triton_decode as kernels

    q, k_cache, v_cache = call.q, call.k_cache, call.v_cache
    hq, d = problem.num_q_heads, problem.head_dim
    lq = problem.seqlen_q
    # packed queries: rows after the last sequence are not attended, and read 0
    out = (torch.zeros if problem.packed_q else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    if problem.packed_q:  # (total_q, Hq, D) as a batch of one whose rows each sequence indexes from cu_seqlens_q
        lse = torch.empty(hq, q.shape[0], dtype=torch.float32, device=q.device)
        q_strides, o_strides, lse_strides = (0, *q.stride()[:2]), (0, *out.stride()[:2]), (0, lse.stride(0))
    else:
        lse = torch.empty(problem.batch, hq, lq, dtype=torch.float32, device=q.device)
        q_strides, o_strides, lse_strides = q.stride()[:3], out.stride()[:3], lse.stride()[:2]
    if q.numel() == 0:
        return out, lse
    args = _LaunchArgs.of(call, problem, lse)
    q_att = _append(call, problem, args)
    slopes = call.alibi_slopes
    slope_batch_stride = slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0
    rows_total = problem.batch * hq * lq
    if splits > 1:
        o_part = torch.empty(splits * rows_total * d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(splits * rows_total, dtype=torch.float32, device=q.device)
    else:
        o_part, lse_part = lse, lse
    cu_q = call.cu_seqlens_q if call.cu_seqlens_q is not None else call.ends
    grid = (splits, problem.batch * problem.num_kv_heads, math.ceil(problem.group * lq / tiles.block_m))
    kernels._decode_kernel[grid](
        q_att, k_cache, v_cache, args.table, call.ends, args.starts, args.rows, cu_q,
        slopes if slopes is not None else lse, args.k_scale, args.v_scale, out, lse, o_part, lse_part,
        *q_strides, *args.cache_strides, args.table.stride(0), slope_batch_stride, *o_strides, *lse_strides,
        args.scale_stride, problem.num_kv_heads, problem.group, lq, problem.num_new, problem.capacity,
        problem.cache_batch, args.num_blocks, args.max_blocks, splits, **_mask_args(problem),
        HEAD_DIM=d, BLOCK_D=args.block_d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        TILE_TOKENS=(tiles.block_m - 1) // problem.group + 2, VARLEN_Q=problem.packed_q, **args.layout,
        ALIBI=slopes is not None, SPLIT=splits > 1, **dot_precision(q), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    if splits > 1:
        kernels._combine_kernel[(rows_total,)](
            o_part, lse_part, out, lse, cu_q, rows_total, splits, hq, lq, *o_strides, *lse_strides,
            HEAD_DIM=d, BLOCK_D=args.block_d, BLOCK_S=min(32, 1 << (splits - 1).bit_length()), VARLEN_Q=problem.packed_q,
            num_warps=4)
    return out, lse


def _mask_args(problem: DecodeProblem) -> dict:
    args = problem.mask.kernel_args(problem.softmax_scale)
    return {name: args[name] for name in ("window_left", "window_right", "qk_scale", "softcap_scale",
                                          "MASK_LEFT", "MASK_RIGHT", "SOFTCAP")}


class ReferenceDecode:
    """`decode_reference`: the CPU path, float64, and backend="reference"."""

    backend = "reference"
    kernel = "decode.decode_reference"

    def run(self, call: CacheCall, problem: DecodeProblem):
        ran("forward", self.backend, self.kernel)
        return decode_reference(call.q, call.k_cache, call.v_cache, call.ends, problem, call.block_table, call.k_new,
                                call.v_new, call.rotary_cos, call.rotary_sin, call.rotary_interleaved,
                                call.alibi_slopes, cache_starts=call.starts, cache_batch_idx=call.cache_rows,
                                cu_seqlens_q=call.cu_seqlens_q, k_scale=call.k_scale, v_scale=call.v_scale)


@dataclass(frozen=True, eq=False)
class DecodeCall:
    """What the decode backends decide on: the checked problem, q (device and dtype) and num_splits."""

    problem: DecodeProblem
    q: torch.Tensor
    num_splits: int | str


def dense_chunk_refusal(problem: DecodeProblem, num_splits) -> str | None:
    """Why a cache call is not a `DenseChunk` (None when it is): the rule that sends prefill chunks to the dense
    forward. It takes what that forward computes exactly, and more rows than a decode step's tile: the cache
    kernel reads each KV head once for up to DECODE_ROWS rows, which the dense kernels would not."""
    if problem.group * problem.seqlen_q <= DECODE_ROWS:
        return f"a decode step ({problem.group * problem.seqlen_q} <= {DECODE_ROWS} query rows per KV head)"
    for refused, why in ((problem.packed_q, "packed queries (the paged varlen path)"),
                         (problem.paged, "a paged cache (the dense kernels read no block table)"),
                         (problem.fp8, "an e4m3 cache"),
                         (problem.rows_indexed, "cache_leftpad or cache_batch_idx"),
                         (problem.alibi, "ALiBi slopes"),
                         (not problem.packed_cache, "a cache that is not contiguous"),
                         (problem.batch * problem.capacity >= 2**31, "more cache rows than int32 cu_seqlens count"),
                         (num_splits != "auto", "an explicit num_splits (the cache kernel's)")):
        if refused:
            return f"not a dense chunk: {why}"
    return None


class _DenseChunkBackend:
    name = "dense"

    def decline(self, call: DecodeCall) -> str | None:
        return _TritonDecodeBackend().decline(call) or dense_chunk_refusal(call.problem, call.num_splits)

    def plan(self, call: DecodeCall) -> DenseChunk:
        return DenseChunk()


class _TritonDecodeBackend:
    name = "triton"

    def decline(self, call: DecodeCall) -> str | None:
        if call.q.dtype == torch.float64:
            return "it has no float64 kernel: use bfloat16, float16 or float32"
        if not call.q.is_cuda and not triton_interpreter_on():
            return "it needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)"
        return None

    def plan(self, call: DecodeCall) -> TritonDecode:
        problem, traits = call.problem, device_traits(call.q.device)
        tiles = decode_tiles(problem, traits)
        splits = choose_num_splits(problem, tiles, traits.sm_count) if call.num_splits == "auto" else call.num_splits
        return TritonDecode(tiles, max(1, min(splits, math.ceil(problem.capacity / tiles.block_n))))


class _ReferenceDecodeBackend:
    name = "reference"

    def decline(self, call: DecodeCall) -> str | None:
        return None

    def plan(self, call: DecodeCall) -> ReferenceDecode:
        return ReferenceDecode()


# The ordered backend list of decode calls (walked by backends.choose, as every attention call's).
DECODE_BACKENDS = (_DenseChunkBackend(), _TritonDecodeBackend(), _ReferenceDecodeBackend())
BACKENDS = ("auto", *(b.name for b in DECODE_BACKENDS))


def plan_decode(problem: DecodeProblem, q, num_splits="auto", backend: str = "auto") -> Choice:
    """The decode backend that runs a checked call, its plan (tiles, splits) and why the ones before declined."""
    return choose(DECODE_BACKENDS, DecodeCall(problem, q, num_splits), backend)


def _check_call_options(rotary_interleaved, return_lse, num_splits, backend) -> None:
    if not isinstance(rotary_interleaved, bool) or not isinstance(return_lse, bool):
        raise TypeError("rotary_interleaved and return_lse must be bools")
    if num_splits != "auto" and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
                                 or num_splits < 1):
        raise ValueError(f"num_splits must be 'auto' or an int >= 1, got {num_splits!r}")
    check_backend(backend, BACKENDS)


def decode_call(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None, v_new=None, rotary_cos=None,
                rotary_sin=None, rotary_interleaved=False, cache_batch_idx=None, cache_leftpad=None, k_scale=None,
                v_scale=None, causal=True, softmax_scale=None, window=None, softcap=None, alibi_slopes=None,
                return_lse=False, num_splits="auto", backend="auto", check_values=None):
    """(out, lse) of `flash_attention_decode` (its arguments): the checks, the plan and the kernels, once. The
    custom ops (torch.compile) call this too."""
    problem = check_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, rotary_cos, rotary_sin,
                           causal, softmax_scale, window, softcap, alibi_slopes, cache_batch_idx=cache_batch_idx,
                           cache_leftpad=cache_leftpad, k_scale=k_scale, v_scale=v_scale)
    _check_call_options(rotary_interleaved, return_lse, num_splits, backend)
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
    problem = check_cache_varlen(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, block_table, causal, softmax_scale,
                                 window, softcap, alibi_slopes, k_scale, v_scale)
    _check_call_options(False, False, num_splits, backend)
    if seqused_k is None and cu_seqlens_k is None:
        raise ValueError("pass seqused_k or cu_seqlens_k: the keys of each sequence")
    for name, t, size in (("cu_seqlens_k", cu_seqlens_k, problem.batch + 1), ("seqused_k", seqused_k, problem.batch)):
        if t is not None:
            _per_sequence(name, t, size, q.device)
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
            ``block_table`` (B, max_blocks) int32, block_size in 16..256; q's dtype, or float8_e4m3fn with
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
        op = torch.ops.flashmoe_science.attention_decode if k_new is None else \
            torch.ops.flashmoe_science.attention_decode_append
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
