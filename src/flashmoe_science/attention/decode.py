"""KV-cache decode: the front door (checks, split heuristic, dispatch) and the PyTorch reference.

``flash_attention_decode`` attends a few new query tokens (speculative decoding verifies several) to a KV cache,
contiguous ``(B, Lmax, Hkv, D)`` or paged ``(num_blocks, block_size, Hkv, D)`` with a block table, each sequence
with its own length. Conventions follow ``flash_attn_with_kvcache``:

* ``cache_seqlens[b]`` keys are in the cache before the call. With ``k_new``/``v_new`` (``(B, L_new, Hkv, D)``) the
  new keys are first written at positions ``cache_seqlens[b] + t`` (in place), so the sequence has
  ``Lk = cache_seqlens[b] + L_new`` keys; without them ``Lk = cache_seqlens[b]``.
* The ``Lq`` query tokens are the last ``Lq`` positions of the sequence: query i sits at ``Lk - Lq + i`` and the
  mask rules of `attention.mask` apply with ``diagonal = Lk - Lq`` (causal: query i sees keys ``<= Lk - Lq + i``).
* Rotary (``rotary_cos``/``rotary_sin`` of shape ``(seqlen_ro, rotary_dim / 2)``, with k_new only): k_new's token t
  is rotated at position ``cache_seqlens[b] + t``; q's token i at ``cache_seqlens[b] + i`` when the mask is causal
  or windowed, else at ``cache_seqlens[b]``. The caller's q is not modified.

Values are checked on the device's behalf only when ``check_values`` is set (the default on CPU tensors): checking
block-table entries and lengths needs their values on the host, a synchronisation CUDA graphs forbid. Unchecked,
the kernels clamp every length to the cache's capacity and every block index into the cache, so bad values give
wrong numbers for that sequence but never a read or write outside the cache.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass

import torch

from flashmoe_science.attention.checks import check_backend, check_flags
from flashmoe_science.attention.mask import MaskSpec, make_mask, score_mods
from flashmoe_science.attention.record import ran
from flashmoe_science.backends import Choice, choose
from flashmoe_science.device import device_traits, dot_precision, on_another_cuda_device, triton_interpreter_on

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_NEW_TOKENS = 16
MAX_GROUP = 16  # query heads per KV head
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 256
MAX_SPLITS = 128
MIN_KEYS_PER_SPLIT = 512  # below this a split's fixed cost (partial write, combine) outweighs its parallelism
LONG_SPLIT_KEYS = 2048  # splits this long hide their fixed cost: then two CTAs per SM pay off


# ----------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeProblem:
    """A checked call's shapes and options (everything a kernel launch depends on besides tensor values)."""

    batch: int
    seqlen_q: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    paged: bool
    block_size: int  # paged block size, or Lmax for a contiguous cache (one "block" per sequence)
    capacity: int  # keys one sequence can hold: Lmax, or max_blocks * block_size
    num_new: int
    mask: MaskSpec
    softmax_scale: float

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


def check_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, rotary_cos, rotary_sin,
                 causal, softmax_scale, window, softcap, alibi_slopes) -> DecodeProblem:
    """Check every argument's type, shape, dtype and device (never values: see `check_decode_values`)."""
    _tensor("q", q, 4)
    if q.dtype not in KERNEL_DTYPES + (torch.float64,):
        raise TypeError(f"q must be bfloat16, float16 or float32 (float64 on the reference), got {q.dtype}")
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    if not 1 <= seqlen_q <= MAX_NEW_TOKENS:
        raise ValueError(f"q must hold 1..{MAX_NEW_TOKENS} new tokens (dim 1), got {seqlen_q}")
    if head_dim % 8 or not 16 <= head_dim <= 256:
        raise ValueError(f"head dim (last dim of q) must be a multiple of 8 in [16, 256], got {head_dim}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, 4, q.dtype)
        _same_device(name, t, q.device)
        _unit_last_stride(name, t)
    _unit_last_stride("q", q)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache's head dim must equal q's ({head_dim}), got {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"q's head count ({num_q_heads}) must be a multiple of the cache's ({num_kv_heads}) "
                         f"by 1..{MAX_GROUP} (GQA/MQA)")

    if block_table is None:
        paged, block_size = False, k_cache.shape[1]
        capacity = block_size
        if k_cache.shape[0] != batch:
            raise ValueError(f"a contiguous k_cache must have q's batch size {batch} in dim 0, got {k_cache.shape[0]}")
    else:
        _tensor("block_table", block_table, 2, torch.int32)
        _same_device("block_table", block_table, q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have q's batch size {batch} rows, got {block_table.shape[0]}")
        if block_table.shape[1] and block_table.stride(1) != 1:
            raise ValueError(f"block_table must have unit stride in dim 1, got strides {block_table.stride()}")
        paged, block_size = True, k_cache.shape[1]
        if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"paged k_cache's block size (dim 1) must be in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                             f"got {block_size}")
        if k_cache.shape[0] == 0:
            raise ValueError("a paged k_cache must hold at least one block (dim 0)")
        capacity = block_table.shape[1] * block_size

    if isinstance(cache_seqlens, torch.Tensor):
        _tensor("cache_seqlens", cache_seqlens, 1, torch.int32)
        _same_device("cache_seqlens", cache_seqlens, q.device)
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens must have q's batch size {batch} entries, got {cache_seqlens.shape[0]}")
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
    return DecodeProblem(batch, seqlen_q, num_q_heads, num_kv_heads, head_dim, paged, block_size, capacity,
                         num_new, mask, float(softmax_scale))


def check_decode_values(problem: DecodeProblem, k_cache, cache_seqlens, block_table, rotary_cos) -> None:
    """The value checks (they read tensors on the host: a synchronisation, so not inside a CUDA graph)."""
    seqlens = cache_seqlens.cpu()
    total = seqlens.to(torch.int64) + problem.num_new
    if seqlens.numel() and (seqlens.min() < 0 or total.max() > problem.capacity):
        worst = int(total.argmax()) if total.max() > problem.capacity else int(seqlens.argmin())
        what = "k_new overflows the cache" if problem.num_new else "cache_seqlens exceeds the cache's capacity"
        raise ValueError(f"cache_seqlens[{worst}] = {int(seqlens[worst])} (+ {problem.num_new} new tokens) must lie "
                         f"in [0, {problem.capacity}]: {what}" if total.max() > problem.capacity else
                         f"cache_seqlens[{worst}] = {int(seqlens[worst])} must be >= 0")
    if block_table is not None and seqlens.numel():
        table = block_table.cpu()
        used = (total + problem.block_size - 1) // problem.block_size  # blocks each sequence touches
        in_use = torch.arange(table.shape[1]).unsqueeze(0) < used.unsqueeze(1)
        bad = in_use & ((table < 0) | (table >= k_cache.shape[0]))
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"block_table[{row}, {col}] = {int(table[row, col])} is out of range: the paged cache "
                             f"holds blocks 0..{k_cache.shape[0] - 1}")
    if rotary_cos is not None and seqlens.numel():
        needed = int(total.max())
        if needed > rotary_cos.shape[0]:
            raise ValueError(f"rotary_cos has {rotary_cos.shape[0]} positions; the sequences reach position "
                             f"{needed - 1}")


# ----------------------------------------------------------------------------------------------------------------
# Heuristics: tiles and the number of splits
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeTiles:
    block_m: int  # rows (query heads x new tokens) per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def decode_tiles(problem: DecodeProblem, traits) -> DecodeTiles:
    """Row tile: the whole GQA group x new tokens (padded to the 16 rows of an MMA), at most 64 rows. Key tile and
    pipeline measured on the H200 (benchmarks/tools/sweep_attention_decode.py, docs/perf-notes.md): 64 keys, 4 warps, 3
    stages led at B=1 128k for both layouts (3.80 / 3.46 TB/s before the paged prefetch; 32-key and 8-warp tiles
    down to 2.4)."""
    rows = problem.group * problem.seqlen_q
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    if traits.capability == (0, 0):  # the interpreter: small tiles exercise the tile boundaries
        return DecodeTiles(block_m, 16, 1, 1)
    block_n = 64 if problem.head_dim <= 128 else 32
    return DecodeTiles(block_m, block_n, 4, 3)


def choose_num_splits(problem: DecodeProblem, tiles: DecodeTiles, sm_count: int) -> int:
    """Splits of each sequence's keys, from shapes only (CUDA-graph safe), measured on the H200
    (benchmarks/tools/sweep_attention_decode.py, docs/perf-notes.md). batch x KV heads x row tiles programs exist already;
    splits fill the GPU up to a whole number of CTAs per SM and never past it (a few CTAs over a full wave cost a
    whole extra round: at B=2, 128k, 17 splits ran at 3.6 TB/s, 16 at 4.1). Two CTAs per SM where each split still
    gets >= LONG_SPLIT_KEYS keys of the cache's capacity (B=1 1M: 33 splits 4.45, 16 splits 4.28; B=1 128k paged:
    33 splits 3.77, 16 splits 3.34), else one (B=1 32k contiguous: 16 splits 2.67, 33 splits 2.59); never fewer
    than MIN_KEYS_PER_SPLIT keys per split."""
    programs = problem.batch * problem.num_kv_heads * math.ceil(problem.group * problem.seqlen_q / tiles.block_m)
    splits = max(1, 2 * sm_count // programs)
    if problem.capacity < splits * LONG_SPLIT_KEYS:
        splits = max(1, sm_count // programs)
    return max(1, min(splits, problem.capacity // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


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


def rotate_new_tokens(q, k_new, cos, sin, cache_seqlens, problem: DecodeProblem, interleaved: bool):
    """(q, k_new) rotated at their positions: k_new's token t at cache_seqlens + t; q's token i there too when the
    mask is causal or windowed, else at cache_seqlens (flash_attn_with_kvcache's convention)."""
    starts = cache_seqlens.long().unsqueeze(1)
    k_new = apply_rotary(k_new, cos, sin, starts + torch.arange(problem.num_new, device=q.device), interleaved)
    per_token = problem.mask.causal or problem.mask.bounded_left or problem.mask.bounded_right
    q_pos = starts + torch.arange(problem.seqlen_q, device=q.device) * int(per_token)
    return apply_rotary(q, cos, sin, q_pos, interleaved), k_new


def cache_positions(problem: DecodeProblem, block_table, batch: int, positions: torch.Tensor):
    """(block index, row in block) of the cache rows at `positions` of sequence `batch` (contiguous: (batch, pos))."""
    if not problem.paged:
        return torch.full_like(positions, batch), positions
    return block_table[batch, positions // problem.block_size].long(), positions % problem.block_size


def decode_reference(q, k_cache, v_cache, cache_seqlens, problem: DecodeProblem, block_table=None, k_new=None,
                     v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False, alibi_slopes=None):
    """Append (in place), gather each sequence's keys, attend: (out (B, Lq, Hq, D) in q's dtype, lse (B, Hq, Lq)),
    computed in float32 (float64 for float64). Values must have been checked (`check_decode_values`)."""
    batch, lq = problem.batch, problem.seqlen_q
    seqlens = torch.as_tensor(cache_seqlens).expand(batch).to("cpu", torch.int64)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    if rotary_cos is not None:
        q, k_new = rotate_new_tokens(q, k_new, rotary_cos, rotary_sin, seqlens.to(q.device), problem,
                                     rotary_interleaved)
    out = torch.zeros(q.shape, dtype=compute, device=q.device)
    lse = torch.full((batch, problem.num_q_heads, lq), float("-inf"), dtype=compute, device=q.device)
    for b in range(batch):
        start = int(seqlens[b])
        if k_new is not None:
            blocks, rows = cache_positions(problem, block_table, b, torch.arange(start, start + problem.num_new,
                                                                                 device=q.device))
            k_cache[blocks, rows] = k_new[b]
            v_cache[blocks, rows] = v_new[b]
        lk = start + problem.num_new
        blocks, rows = cache_positions(problem, block_table, b, torch.arange(lk, device=q.device))
        # One KV head's keys against its group's query heads x tokens (no repeated K/V: the 1M-token oracle fits).
        keys = k_cache[blocks, rows].permute(1, 2, 0).to(compute)  # (Hkv, D, Lk)
        values = v_cache[blocks, rows].transpose(0, 1).to(compute)  # (Hkv, Lk, D)
        queries = q[b].transpose(0, 1).to(compute).reshape(problem.num_kv_heads, problem.group * lq, -1)
        scores = (queries @ keys * problem.softmax_scale).view(1, problem.num_q_heads, lq, lk)
        slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, -1)[b : b + 1]
        scores = score_mods(scores, problem.mask, lq, lk, slopes)[0]
        row_lse = torch.logsumexp(scores, dim=-1) if lk else lse[b]
        seen = torch.isfinite(row_lse)
        weights = torch.exp(scores - torch.where(seen, row_lse, 0.0).unsqueeze(-1))
        weighted = (weights.view(problem.num_kv_heads, problem.group * lq, lk) @ values).view(-1, lq, q.shape[-1])
        out[b] = weighted.masked_fill(~seen.unsqueeze(-1), 0.0).transpose(0, 1)
        lse[b] = row_lse
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


# ----------------------------------------------------------------------------------------------------------------
# The front door
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TritonDecode:
    """The Triton decode kernels (triton_decode): the append (with rotary) where new keys come, the split-KV
    attention with `splits` key splits per sequence, and the LSE combine where splits > 1."""

    tiles: DecodeTiles
    splits: int
    backend = "triton"
    kernel = "triton_decode._decode_kernel"

    def run(self, q, k_cache, v_cache, seqlens, problem: DecodeProblem, block_table, k_new, v_new, rotary_cos,
            rotary_sin, rotary_interleaved, alibi_slopes):
        # Triton launches on the current device: make it q's
        with torch.cuda.device(q.device) if on_another_cuda_device(q) else contextlib.nullcontext():
            ran("forward", self.backend, self.kernel)
            return _launch(q, k_cache, v_cache, seqlens, problem, block_table, k_new, v_new, rotary_cos, rotary_sin,
                           rotary_interleaved, alibi_slopes, self.tiles, self.splits)


def _launch(q, k_cache, v_cache, seqlens, problem: DecodeProblem, block_table, k_new, v_new, rotary_cos, rotary_sin,
            rotary_interleaved, alibi_slopes, tiles: DecodeTiles, splits: int):
    from flashmoe_science.attention import triton_decode as kernels

    batch, lq, hq, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, lq, dtype=torch.float32, device=q.device)
    table = block_table if block_table is not None else seqlens  # a placeholder pointer when contiguous
    page_size = problem.block_size if problem.paged else 1
    num_blocks = k_cache.shape[0]
    max_blocks = block_table.shape[1] if block_table is not None else 1
    block_d = max(16, 1 << (d - 1).bit_length())

    if k_new is not None:
        q_att = torch.empty_like(out) if rotary_cos is not None else q
        cos, sin = (rotary_cos, rotary_sin) if rotary_cos is not None else (q, q)
        rotary = rotary_cos is not None
        kernels._append_kernel[(max(lq, problem.num_new), batch, hq + problem.num_kv_heads)](
            q, q_att, k_new, v_new, k_cache, v_cache, table, seqlens, cos, sin,
            *q.stride()[:3], *q_att.stride()[:3], *k_new.stride()[:3], *v_new.stride()[:3],
            *k_cache.stride()[:3], *v_cache.stride()[:3], table.stride(0), cos.stride(0),
            lq, problem.num_new, hq, problem.capacity, num_blocks, max_blocks, cos.shape[0],
            HEAD_DIM=d, BLOCK_D=block_d, PAGED=problem.paged, PAGE_SIZE=page_size, ROTARY=rotary,
            ROTARY_DIM=2 * rotary_cos.shape[1] if rotary else 16, INTERLEAVED=bool(rotary_interleaved),
            Q_POSITIONS_PER_TOKEN=problem.mask.causal or problem.mask.bounded_left or problem.mask.bounded_right,
            num_warps=1)
    else:
        q_att = q

    slopes = alibi_slopes if alibi_slopes is not None else lse
    slope_batch_stride = alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0
    rows = batch * problem.num_kv_heads * problem.group * lq
    if splits > 1:
        o_part = torch.empty(splits * rows * d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(splits * rows, dtype=torch.float32, device=q.device)
    else:
        o_part, lse_part = lse, lse
    grid = (splits, batch * problem.num_kv_heads, math.ceil(problem.group * lq / tiles.block_m))
    kernels._decode_kernel[grid](
        q_att, k_cache, v_cache, table, seqlens, slopes, out, lse, o_part, lse_part,
        *q_att.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        table.stride(0), slope_batch_stride, *out.stride()[:3],
        problem.num_kv_heads, problem.group, problem.num_new, problem.capacity, num_blocks, max_blocks, splits,
        **_mask_args(problem),
        SEQLEN_Q=lq, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        PAGED=problem.paged, PAGE_SIZE=page_size, ALIBI=alibi_slopes is not None, SPLIT=splits > 1,
        **dot_precision(q), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if splits > 1:
        kernels._combine_kernel[(rows,)](
            o_part, lse_part, out, lse, rows, splits, hq, *out.stride()[:3],
            SEQLEN_Q=lq, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=min(32, 1 << (splits - 1).bit_length()), num_warps=4)
    return out, lse


def _mask_args(problem: DecodeProblem) -> dict:
    args = problem.mask.kernel_args(problem.softmax_scale)
    return {name: args[name] for name in ("window_left", "window_right", "qk_scale", "softcap_scale",
                                          "MASK_LEFT", "MASK_RIGHT", "SOFTCAP")}


class ReferenceDecode:
    """`decode_reference`: the CPU path, float64, and backend="reference"."""

    backend = "reference"
    kernel = "decode.decode_reference"

    def run(self, q, k_cache, v_cache, seqlens, problem: DecodeProblem, block_table, k_new, v_new, rotary_cos,
            rotary_sin, rotary_interleaved, alibi_slopes):
        ran("forward", self.backend, self.kernel)
        return decode_reference(q, k_cache, v_cache, seqlens, problem, block_table, k_new, v_new, rotary_cos,
                                rotary_sin, rotary_interleaved, alibi_slopes)


@dataclass(frozen=True, eq=False)
class DecodeCall:
    """What the decode backends decide on: the checked problem, q (device and dtype) and num_splits."""

    problem: DecodeProblem
    q: torch.Tensor
    num_splits: int | str


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
DECODE_BACKENDS = (_TritonDecodeBackend(), _ReferenceDecodeBackend())
BACKENDS = ("auto", *(b.name for b in DECODE_BACKENDS))


def plan_decode(problem: DecodeProblem, q, num_splits="auto", backend: str = "auto") -> Choice:
    """The decode backend that runs a checked call, its plan (tiles, splits) and why the ones before declined."""
    return choose(DECODE_BACKENDS, DecodeCall(problem, q, num_splits), backend)


def decode_call(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None, v_new=None, rotary_cos=None,
                rotary_sin=None, rotary_interleaved=False, causal=True, softmax_scale=None, window=None,
                softcap=None, alibi_slopes=None, return_lse=False, num_splits="auto", backend="auto",
                check_values=None):
    """(out, lse) of `flash_attention_decode` (its arguments): the checks, the plan and the kernels, once. The
    custom ops (torch.compile) call this too."""
    problem = check_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, rotary_cos, rotary_sin,
                           causal, softmax_scale, window, softcap, alibi_slopes)
    if not isinstance(rotary_interleaved, bool) or not isinstance(return_lse, bool):
        raise TypeError("rotary_interleaved and return_lse must be bools")
    if num_splits != "auto" and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
                                 or num_splits < 1):
        raise ValueError(f"num_splits must be 'auto' or an int >= 1, got {num_splits!r}")
    check_backend(backend, BACKENDS)
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((problem.batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if check_values is None:
        check_values = not q.is_cuda
    if check_values:
        check_decode_values(problem, k_cache, cache_seqlens, block_table, rotary_cos)
    step = plan_decode(problem, q, num_splits, backend).plan
    return step.run(q, k_cache, v_cache, cache_seqlens, problem, block_table, k_new, v_new, rotary_cos, rotary_sin,
                    rotary_interleaved, alibi_slopes)


def flash_attention_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None, v_new=None,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=False, causal=True,
                           softmax_scale=None, window=None, softcap=None, alibi_slopes=None, return_lse=False,
                           num_splits="auto", backend="auto", check_values=None):
    """Attention of a few new tokens against a KV cache (see the module docstring for the conventions).

    Args:
        q: (B, Lq, Hq, D), Lq in 1..16, bf16/fp16/fp32 (float64 on the reference).
        k_cache, v_cache: contiguous (B, Lmax, Hkv, D), or paged (num_blocks, block_size, Hkv, D) with
            ``block_table`` (B, max_blocks) int32, block_size in 16..256. Written in place when k_new is given.
        cache_seqlens: int32 (B,) (or an int for every row): keys in the cache before the call.
        k_new, v_new: (B, L_new, Hkv, D) appended at cache_seqlens before attending.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), applied to q and k_new (needs k_new);
            ``rotary_interleaved`` picks GPT-J pairs (2j, 2j+1) over GPT-NeoX halves.
        causal, window (left, right), softcap, alibi_slopes ((Hq,) or (B, Hq) float32): `attention.mask`'s rules
            with diagonal = Lk - Lq.
        return_lse: also return the natural-log LSE, float32 (B, Hq, Lq) (-inf for a row that sees no key).
        num_splits: "auto" (a heuristic on B, Hkv, the cache's capacity and the SM count) or an int >= 1.
        backend: "auto" (CUDA: the Triton kernels; CPU: the reference), "triton", "reference".
        check_values: check cache_seqlens, block_table and the rotary table's length on the host (a
            synchronisation; not allowed while capturing a CUDA graph). Default: on for CPU tensors, off on GPUs,
            where the kernels clamp every index into the cache instead.

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
                      softcap, alibi_slopes, 0 if num_splits == "auto" else num_splits, backend, check_values)
    else:
        out, lse = decode_call(q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k_new, v_new=v_new,
                               rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                               causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                               alibi_slopes=alibi_slopes, return_lse=return_lse, num_splits=num_splits,
                               backend=backend, check_values=check_values)
    return (out, lse) if return_lse else out
