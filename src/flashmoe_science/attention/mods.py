"""User masks and score modifiers: FlexAttention's `mask_mod` and `score_mod`, written as `@triton.jit` functions.

    mask_mod(b, h, q_idx, kv_idx, *captured) -> bool               query q_idx of (b, h) sees key kv_idx
    score_mod(score, b, h, q_idx, kv_idx, *captured) -> score      the scaled score s = q·k · scale, modified
    grad(score, b, h, q_idx, kv_idx, *captured) -> d score_mod / d score

The kernels call them on broadcast tiles (q_idx a column, kv_idx a row, or the transpose in the backward's dK/dV
pass), so a mod is elementwise code of `triton.language`. b is the batch index (a packed call: the sequence's),
h the query head, q_idx and kv_idx positions within the sequence; the kernels only pass positions inside it (a ragged
tile's rows past the end are clamped to the last one and their results discarded), so a mod may index its tensors
with them unguarded.

Design, and why:

* **Captured tensors** (document ids, prefix lengths, per-head tables, neighbour lists) are given with the function:
  `MaskMod(fn, *tensors)` / `ScoreMod(fn, *tensors, grad=dfn)`; the kernels forward them, as a tuple of pointers,
  after the four (five) indices. A bare `@triton.jit` function is a mod without tensors. Tensors are checked
  once per call (`check_mods`: on q's device, contiguous, a numeric dtype, no gradient asked of them), the function
  by its type and its number of parameters; each failure is one TypeError/ValueError naming the argument.
* **Backward of score_mod**: Triton has no autodiff, so the derivative with respect to the score is the user's
  second function (`ScoreMod(..., grad=)`); the kernels multiply dS by it, as they do softcap's 1 - tanh². Any
  elementwise score function differentiates this way, where a fixed list of differentiable mods would not.
  Without `grad` the score_mod is forward-only: a call that records gradients is refused before any work.
* **Block mask**: `block_mask` evaluates `mask_mod` (ANDed with the call's causal/window mask and the sequence
  bounds) once per (b, h, query tile, key tile) on the device (`_tile_states_kernel`) and classifies each tile
  empty, partial or full; per query tile the kernels then walk a list of its partial and of its full key tiles
  (per key tile, of query tiles, for the dK/dV pass), so empty tiles are never loaded and full tiles run without
  the elementwise mask (no mask_mod call). Remembered per mod, shape, tiles and mask while the captured tensors
  live unwritten (`prepared_cache.TensorMemo`).
* **The built-in masks beside a mod**: `mask_mod` ANDs with causal, window and the packed layout's bounds;
  `score_mod` applies to the scaled score. Either is refused beside softcap, alibi_slopes and attn_bias (for a
  score_mod their order relative to it would be one more rule to learn; the block-mask walk scores its tiles
  without them): write them into a score_mod.
* **The CPU reference** evaluates the same `@triton.jit` functions through Triton's interpreter in this process
  (`mask_values`, `score_values`; tensors are copied to the host), so the reference and the kernels run one
  definition; the tests compare both with a torch twin written in the test.
* **Inside the Gluon kernels** (sm_90) a tile carries its register layout: a mod builds new tiles from its
  arguments (`score * 0.0 + 1.0`, not `tl.full(score.shape, ...)`, which has no layout there). A mod that does not
  build in Gluon is remembered as such and runs on the Triton kernels (`gluon.availability.run_gluon`).
* **torch.compile**: a function is not a tensor, so the custom ops cannot take mods; a call with mods inside a
  compiled region graph-breaks (`torch.compiler.disable`) and runs eagerly, with its autograd.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from flashmoe_science.attention.mask import MaskSpec, visible
from flashmoe_science.attention.seqlen import launch_sizes, sequence_bounds
from flashmoe_science.prepared_cache import TensorMemo

# dtypes a mod may read from its captured tensors (by pointer)
CAPTURED_DTYPES = (torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16,
                   torch.bfloat16, torch.float32, torch.float64)
EMPTY, PARTIAL, FULL = 0, 1, 2  # a tile's state in the block mask


@dataclass(frozen=True, eq=False)
class MaskMod:
    """`fn(b, h, q_idx, kv_idx, *tensors) -> bool`, a `@triton.jit` function, and the tensors it reads."""

    fn: object
    tensors: tuple = ()

    def __init__(self, fn, *tensors):
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "tensors", tuple(tensors))


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """`fn(score, b, h, q_idx, kv_idx, *tensors) -> score` and its derivative `grad` (same arguments, d fn / d
    score; None: forward only), `@triton.jit` functions, and the tensors both read."""

    fn: object
    tensors: tuple = ()
    grad: object = None

    def __init__(self, fn, *tensors, grad=None):
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "tensors", tuple(tensors))
        object.__setattr__(self, "grad", grad)


@dataclass(frozen=True, eq=False)
class Mods:
    """The checked mods of one call (either may be None, not both)."""

    mask: MaskMod | None = None
    score: ScoreMod | None = None

    @property
    def functions(self) -> tuple:
        """The user's functions a kernel build carries (mask_mod, score_mod and its grad, those given): the key a
        failed Gluon build is remembered under (`gluon.availability.function_refusal`)."""
        score = () if self.score is None else (self.score.fn,) + (() if self.score.grad is None else (self.score.grad,))
        return (() if self.mask is None else (self.mask.fn,)) + score


def _is_jit(fn) -> bool:
    return isinstance(fn, (JITFunction, InterpretedFunction))


def _check_function(name: str, fn, indices: tuple[str, ...], captured: int) -> None:
    if not _is_jit(fn):
        raise TypeError(f"{name} must be a @triton.jit function (or {'MaskMod' if name == 'mask_mod' else 'ScoreMod'}"
                        f"(fn, *tensors)), got {type(fn).__name__}")
    params = list(inspect.signature(fn.fn).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) or len(params) != len(indices) + captured:
        raise TypeError(f"{name} must take ({', '.join(indices)}) and its {captured} captured tensor(s): "
                        f"{len(indices) + captured} parameters, got {fn.fn.__name__}"
                        f"({', '.join(p.name for p in params)})")


def _check_tensors(name: str, tensors: tuple, device) -> None:
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}'s captured argument {i} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name}'s captured tensor {i} must be on q's device {device}, got {t.device}")
        if t.dtype not in CAPTURED_DTYPES:
            raise ValueError(f"{name}'s captured tensor {i} must be bool, an integer or a float dtype, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}'s captured tensor {i} must be contiguous (the mod indexes it as a flat "
                             f"pointer), got strides {tuple(t.stride())}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name}'s captured tensor {i} requires grad: captured tensors get no gradient "
                             "(detach it)")


def check_mods(mask_mod, score_mod, q: torch.Tensor, *, softcap=None, alibi_slopes=None, attn_bias=None,
               records_grad: bool = False) -> Mods | None:
    """The call's mods, checked before any work (None without mods): TypeError/ValueError naming the argument."""
    if mask_mod is None and score_mod is None:
        return None
    mask = score = None
    if (softcap is not None and softcap != 0) or alibi_slopes is not None or attn_bias is not None:
        # the kernels' block-mask walk scores its tiles without them
        named = "mask_mod" if score_mod is None else "mask_mod / score_mod"
        raise ValueError(f"{named} does not combine with softcap, alibi_slopes or attn_bias: write them into a "
                         "score_mod (ScoreMod(fn, *tensors, grad=dfn)) beside the mask_mod")
    if mask_mod is not None:
        mask = mask_mod if isinstance(mask_mod, MaskMod) else MaskMod(mask_mod)
        _check_function("mask_mod", mask.fn, ("b", "h", "q_idx", "kv_idx"), len(mask.tensors))
        _check_tensors("mask_mod", mask.tensors, q.device)
    if score_mod is not None:
        score = score_mod if isinstance(score_mod, ScoreMod) else ScoreMod(score_mod)
        indices = ("score", "b", "h", "q_idx", "kv_idx")
        _check_function("score_mod", score.fn, indices, len(score.tensors))
        if score.grad is not None:
            _check_function("score_mod's grad", score.grad, indices, len(score.tensors))
        elif records_grad:
            raise ValueError("score_mod has no derivative for the backward: pass ScoreMod(fn, *tensors, grad=dfn) "
                             "with dfn(score, b, h, q_idx, kv_idx, *tensors) = d fn / d score, or call without "
                             "gradients")
        _check_tensors("score_mod", score.tensors, q.device)
    return Mods(mask, score)


# ----------------------------------------------------------------------------------------------------------------
# Kernels' arguments
# ----------------------------------------------------------------------------------------------------------------


def kernel_args(mods: Mods | None) -> dict:
    """The mods' kernel arguments by name: the functions (constexprs: each mod compiles its own kernel; None when
    absent), their captured tensors as tuples, and the flags."""
    mask = mods.mask if mods is not None else None
    score = mods.score if mods is not None else None
    return dict(mask_mod=mask.fn if mask is not None else None, mask_args=mask.tensors if mask is not None else None,
                score_mod=score.fn if score is not None else None,
                score_grad=score.grad if score is not None else None,
                score_args=score.tensors if score is not None else None,
                MASK_MOD=mask is not None, SCORE_MOD=score is not None)


@triton.jit
def clamp_index(idx, length):
    """Positions past a sequence's end (a ragged tile's) clamped to its last one: the mods see valid indices."""
    return tl.maximum(tl.minimum(idx, length - 1), 0)


# ----------------------------------------------------------------------------------------------------------------
# The block mask
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_states_kernel(STATES, CU_SEQLENS_Q, CU_SEQLENS_K, mask_mod, mask_args,
                        num_heads, seqlen_q, seqlen_k, n_q_tiles, n_k_tiles, window_left, window_right,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, MASK_LEFT: tl.constexpr,
                        MASK_RIGHT: tl.constexpr, VARLEN: tl.constexpr):
    """One query tile of one (b, h): each key tile's state (EMPTY 0, PARTIAL 1, FULL 2) into STATES
    (B, H, n_q_tiles, n_k_tiles), zeroed beforehand. A tile is FULL when every pair of it lies inside the sequence
    and is seen (the kernels then load it without bounds and mask nothing); tiles past the sequence stay EMPTY.
    ROWS: BLOCK_M rounded up to a power of two (a tile of three 64-row warpgroups is 192 rows), the rows past
    BLOCK_M counted as unseen."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    _, seqlen_q = sequence_bounds(CU_SEQLENS_Q, batch, seqlen_q, VARLEN)
    _, seqlen_k = sequence_bounds(CU_SEQLENS_K, batch, seqlen_k, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m < seqlen_q:
        rows = start_m + tl.arange(0, ROWS)
        in_tile = (tl.arange(0, ROWS) < BLOCK_M) & (rows < seqlen_q)
        q_idx = clamp_index(rows, seqlen_q)[:, None]
        diagonal = seqlen_k - seqlen_q
        row0 = (pid_bh.to(tl.int64) * n_q_tiles + pid_m) * n_k_tiles
        for tile in range(0, tl.cdiv(seqlen_k, BLOCK_N)):
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            seen = visible(rows[:, None], cols[None, :], seqlen_k, diagonal, window_left, window_right,
                           MASK_LEFT, MASK_RIGHT) & in_tile[:, None]
            seen = seen & mask_mod(batch, head, q_idx, clamp_index(cols, seqlen_k)[None, :], *mask_args)
            count = tl.sum(seen.to(tl.int32))
            state = tl.where(count == BLOCK_M * BLOCK_N, 2, tl.where(count > 0, 1, 0))
            tl.store(STATES + row0 + tile, state.to(tl.int8))


@dataclass(frozen=True, eq=False)
class TileLists:
    """Per row of a tile grid (a query tile's key tiles, or a key tile's query tiles): how many partial and full
    tiles it visits and their indices, partial ones first in `partial`, full ones first in `full`
    ((..., rows) int32 counts, (..., rows, cols) int32 indices)."""

    partial_counts: torch.Tensor
    partial: torch.Tensor
    full_counts: torch.Tensor
    full: torch.Tensor

    @staticmethod
    def of(states: torch.Tensor) -> TileLists:
        partial, full = states == PARTIAL, states == FULL
        # a stable sort on "not this kind" puts the kind's tiles first, in ascending order
        order = lambda kind: torch.argsort((~kind).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # noqa: E731
        return TileLists(partial.sum(-1, dtype=torch.int32), order(partial), full.sum(-1, dtype=torch.int32),
                         order(full))


@dataclass(frozen=True, eq=False)
class BlockMask:
    """The block mask of one call at one tile shape: `states` (B, H, n_q_tiles, n_k_tiles) int8, `by_query` (each
    query tile's key tiles: the forward and the dQ pass) and `by_key` (each key tile's query tiles: the dK/dV pass)."""

    block_m: int
    block_n: int
    states: torch.Tensor
    by_query: TileLists
    by_key: TileLists

    @property
    def n_q_tiles(self) -> int:
        return self.states.shape[2]

    @functools.cached_property
    def walk(self) -> torch.Tensor:
        """(B, H, n_q_tiles, n_k_tiles) int32: each query tile's key tiles, its full ones first, then its partial
        ones, then its empty ones (each kind ascending): one list the sm_90 forward's producer and consumers walk."""
        kind = torch.where(self.states == FULL, 0, torch.where(self.states == PARTIAL, 1, 2)).to(torch.int8)
        return torch.argsort(kind, dim=-1, stable=True).to(torch.int32)

    @property
    def n_k_tiles(self) -> int:
        return self.states.shape[3]

    def partial_share(self) -> float:
        """The share of partial tiles among the visited ones (partial or full), read on the host (one
        synchronisation)."""
        partial, visited = torch.stack([(self.states == PARTIAL).sum(), (self.states != EMPTY).sum()]).tolist()
        return partial / max(visited, 1)


_BLOCK_MASKS = TensorMemo(max_entries=64)
_WITHOUT_TENSORS: dict = {}


def block_mask(mods: Mods, mask: MaskSpec, varlen, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
               block_m: int, block_n: int, device) -> BlockMask:
    """The block mask of `mods.mask` ANDed with `mask` over (batch, heads, seqlen_q, seqlen_k) (a packed call:
    sequences and their longest lengths) at tiles block_m x block_n, built on the device or remembered."""
    mod = mods.mask
    tensors = (*mod.tensors, *((varlen.cu_seqlens_q, varlen.cu_seqlens_k) if varlen is not None else ()))
    extra = (mod.fn, mask, batch, heads, seqlen_q, seqlen_k, block_m, block_n, str(device))
    found = _BLOCK_MASKS.get(tensors, extra) if tensors else _WITHOUT_TENSORS.get(extra)
    if found is not None:
        return found
    n_q, n_k = triton.cdiv(seqlen_q, block_m), triton.cdiv(seqlen_k, block_n)
    states = torch.zeros(batch, heads, n_q, n_k, dtype=torch.int8, device=device)
    if states.numel():
        # CPU tensors (the reference's tests, the interpreter's runs): the same kernel through Triton's interpreter
        kernel = _tile_states_kernel if states.is_cuda else _interpreted(_tile_states_kernel.fn)
        with contextlib.nullcontext() if states.is_cuda else _interpreter():
            kernel[(n_q, batch * heads)](
                states, varlen.cu_seqlens_q if varlen is not None else None,
                varlen.cu_seqlens_k if varlen is not None else None, mod.fn, mod.tensors, heads, seqlen_q, seqlen_k,
                n_q, n_k, max(mask.window_left, 0), max(mask.window_right, 0), BLOCK_M=block_m, BLOCK_N=block_n,
                ROWS=triton.next_power_of_2(block_m), MASK_LEFT=mask.bounded_left, MASK_RIGHT=mask.bounded_right, VARLEN=varlen is not None)
    # the kernels index the lists as contiguous arrays: transpose a contiguous copy (sort keeps its input's strides)
    by_key = TileLists.of(states.transpose(2, 3).contiguous())
    found = BlockMask(block_m, block_n, states, TileLists.of(states), by_key)
    if tensors:
        _BLOCK_MASKS.put(tensors, extra, found)
    else:
        if len(_WITHOUT_TENSORS) >= 64:
            _WITHOUT_TENSORS.clear()
        _WITHOUT_TENSORS[extra] = found
    return found


def call_block_mask(q: torch.Tensor, k: torch.Tensor, features, block_m: int, block_n: int) -> BlockMask | None:
    """The block mask of a call's mask_mod (`features.CallFeatures` over 4-D q, k) at a kernel's tiles, or None."""
    mods = features.mods
    if mods is None or mods.mask is None:
        return None
    num_seqs, seqlen_q, seqlen_k = launch_sizes(q, k, features.varlen)
    return block_mask(mods, features.mask, features.varlen, num_seqs, q.shape[1], seqlen_q, seqlen_k, block_m,
                      block_n, q.device)


def block_mask_args(blocks: BlockMask | None, by_key: bool = False) -> dict:
    """A kernel's block-mask arguments: the tile lists of its orientation (None without a mask_mod)."""
    lists = None if blocks is None else (blocks.by_key if by_key else blocks.by_query)
    return dict(PARTIAL_COUNTS=lists.partial_counts if lists else None, PARTIAL_TILES=lists.partial if lists else None,
                FULL_COUNTS=lists.full_counts if lists else None, FULL_TILES=lists.full if lists else None,
                list_len=(blocks.n_q_tiles if by_key else blocks.n_k_tiles) if blocks else 0)


# ----------------------------------------------------------------------------------------------------------------
# The reference: the same functions through Triton's interpreter, in this process
# ----------------------------------------------------------------------------------------------------------------

_INTERPRETING = threading.Lock()


@functools.lru_cache(maxsize=None)
def _interpreted(fn) -> InterpretedFunction:
    return InterpretedFunction(fn)


def _as_interpreted(fn) -> InterpretedFunction:
    return fn if isinstance(fn, InterpretedFunction) else _interpreted(fn.fn)


# what Triton's interpreter patches for a device function's call and leaves patched (InterpretedFunction.__call__)
_LANGUAGE = (tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base)


@contextlib.contextmanager
def _interpreter():
    """Compiled `@triton.jit` functions called from interpreted code run interpreted too (a mod may call helpers).
    triton.language is put back afterwards: a device function's interpreted call patches its operators for good,
    and a later compilation in this process would run the interpreter's."""
    with _INTERPRETING:
        call = JITFunction.__call__
        saved = [(obj, dict(vars(obj))) for obj in _LANGUAGE]
        JITFunction.__call__ = lambda self, *args, **kwargs: _interpreted(self.fn)(*args, **kwargs)
        try:
            yield
        finally:
            JITFunction.__call__ = call
            for obj, attrs in saved:
                for name, value in attrs.items():
                    if vars(obj).get(name) is not value:
                        setattr(obj, name, value)


def _mask_grid(OUT, mask_mod, mask_args, b0, seqlen_q, seqlen_k, LQ: tl.constexpr, LK: tl.constexpr):
    b = b0 + tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, LQ)[:, None]
    cols = tl.arange(0, LK)[None, :]
    seen = mask_mod(b, h, tl.minimum(rows, seqlen_q - 1), tl.minimum(cols, seqlen_k - 1), *mask_args)
    offsets = (tl.program_id(0) * tl.num_programs(1) + h) * LQ * LK + rows * LK + cols
    tl.store(OUT + offsets, (seen & (rows < seqlen_q) & (cols < seqlen_k)).to(tl.int8))


def _score_grid(OUT, GRAD, S, score_mod, score_grad, score_args, b0, seqlen_q, seqlen_k,
                LQ: tl.constexpr, LK: tl.constexpr, GRAD_TOO: tl.constexpr):
    b = b0 + tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, LQ)[:, None]
    cols = tl.arange(0, LK)[None, :]
    q_idx, kv_idx = tl.minimum(rows, seqlen_q - 1), tl.minimum(cols, seqlen_k - 1)
    offsets = (tl.program_id(0) * tl.num_programs(1) + h) * LQ * LK + rows * LK + cols
    score = tl.load(S + offsets)
    tl.store(OUT + offsets, score_mod(score, b, h, q_idx, kv_idx, *score_args))
    if GRAD_TOO:
        tl.store(GRAD + offsets, score_grad(score, b, h, q_idx, kv_idx, *score_args))


def _padded(n: int) -> int:
    return max(triton.next_power_of_2(max(n, 1)), 1)


def mask_values(mod: MaskMod, batch: int, heads: int, lq: int, lk: int, b0: int = 0) -> torch.Tensor:
    """Boolean (batch, heads, lq, lk): mask_mod at every index (b from b0), by Triton's interpreter on the host."""
    LQ, LK = _padded(lq), _padded(lk)
    out = torch.zeros(batch, heads, LQ, LK, dtype=torch.int8)
    if out.numel() and lq and lk:
        tensors = tuple(t.cpu() for t in mod.tensors)
        with _interpreter():
            _interpreted(_mask_grid)[(batch, heads)](out, _as_interpreted(mod.fn), tensors, b0, lq, lk, LQ, LK)
    return out[:, :, :lq, :lk].bool()


class _ScoreModFunction(torch.autograd.Function):
    """score_mod on (batch, heads, lq, lk) scores; its backward multiplies by the user's derivative."""

    @staticmethod
    def forward(ctx, scores, mod, b0):
        batch, heads, lq, lk = scores.shape
        LQ, LK = _padded(lq), _padded(lk)
        host = torch.zeros(batch, heads, LQ, LK, dtype=scores.dtype)
        host[:, :, :lq, :lk] = scores.detach().cpu()
        out, grad = torch.zeros_like(host), torch.zeros_like(host)
        grad_too = mod.grad is not None and ctx.needs_input_grad[0]
        if host.numel() and lq and lk:
            tensors = tuple(t.cpu() for t in mod.tensors)
            with _interpreter():
                _interpreted(_score_grid)[(batch, heads)](
                    out, grad, host, _as_interpreted(mod.fn), _as_interpreted(mod.grad) if grad_too else None,
                    tensors, b0, lq, lk, LQ, LK, grad_too)
        ctx.save_for_backward(grad[:, :, :lq, :lk].to(scores.device))
        ctx.has_grad = mod.grad is not None
        return out[:, :, :lq, :lk].to(scores.device)

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.has_grad:
            raise RuntimeError("score_mod has no derivative: pass ScoreMod(fn, *tensors, grad=dfn)")
        (derivative,) = ctx.saved_tensors
        return grad_out * derivative, None, None


def apply_mods(scores: torch.Tensor, mods: Mods | None, b0: int = 0) -> torch.Tensor:
    """The reference's view: scaled scores (batch, heads, lq, keys) -> score_mod applied, then -inf where mask_mod
    is False (differentiable through the score_mod's grad). Evaluated by Triton's interpreter (the same functions
    as the kernels run)."""
    if mods is None:
        return scores
    if mods.score is not None:
        scores = _ScoreModFunction.apply(scores, mods.score, b0)
    if mods.mask is not None:
        seen = mask_values(mods.mask, *scores.shape, b0=b0).to(scores.device)
        scores = scores.masked_fill(~seen, float("-inf"))
    return scores
