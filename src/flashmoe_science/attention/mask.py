"""Which keys a query sees, and how its score is modified: written once, used by every attention kernel.

The rules (flash-attn's conventions), for a sequence of Lq queries and Lk keys, ``diagonal = Lk - Lq``:

* **window** ``(left, right)``, -1 meaning unbounded: query i sees key j iff
  ``i + diagonal - left <= j <= i + diagonal + right``. ``causal=True`` is the window ``(left, 0)``: bottom-right
  aligned, so it equals SDPA's ``is_causal`` when Lq == Lk. A query that sees no key gets zeros and lse -inf.
* **varlen**: each packed sequence has its own Lq, Lk and so its own diagonal; the rules above apply per sequence.
* **softcap** ``c > 0``: the scaled score ``t = scale · q·k`` becomes ``c · tanh(t / c)``.
* **ALiBi** slope ``m`` per (batch, head): adds ``-m · |i + diagonal - j|`` after the softcap.
* **bias**: an additive float tensor broadcast to (B, H, Lq, Lk), added last.

Three views of the same rules live here:

1. Host side: `MaskSpec` (normalised, checked arguments) and the PyTorch functions the reference uses
   (`visibility`, `score_mods`).
2. Tile bookkeeping for kernels: which key tiles a query tile must visit (`key_tile_range`), which query tiles a
   key tile must visit (`query_tile_range`, for the backward), and which of them need no elementwise mask.
3. Elementwise, for kernels (`visible`, `score_to_log2`): plain `@triton.jit` functions of broadcast tensors, so
   the Triton and the Gluon kernels call the same code (Gluon callers pass tensors that already carry layouts).

Kernels work in base 2: the softmax scale and log2(e) are folded into one multiplier ``qk_scale``, and the
log-sum-exp they keep in base 2 is turned back into natural log with ln(2). `LOG2_E` and `LN_2` are constexprs,
the form kernels can read (host code takes ``.value``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2_E = tl.constexpr(1.4426950408889634)
LN_2 = tl.constexpr(0.6931471805599453)
UNBOUNDED = -1  # a window side without a bound
HARDWARE_TANH = tl.constexpr(2)  # SOFTCAP = 2: softcap with the GPU's tanh instruction (see softcap_tanh)


@dataclass(frozen=True)
class MaskSpec:
    """The checked mask of one call. ``window_right == 0`` with ``causal`` set is the causal mask."""

    causal: bool = False
    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    softcap: float = 0.0

    @property
    def bounded_left(self) -> bool:
        return self.window_left != UNBOUNDED

    @property
    def bounded_right(self) -> bool:
        return self.window_right != UNBOUNDED

    @property
    def plain_causal(self) -> bool:
        """The causal window alone (left unbounded, right bound 0; a softcap may come with it): the kernels' CAUSAL
        path (mask.key_tile_bounds), where any other window takes the general bounds."""
        return not self.bounded_left and self.bounded_right and self.window_right == 0

    @property
    def is_plain(self) -> bool:
        """No window beyond causal and no softcap: what the kernels' dense causal/non-causal paths compute."""
        return not self.bounded_left and (not self.bounded_right or self.causal) and self.softcap == 0.0

    def kernel_args(self, softmax_scale: float) -> dict:
        """The scalars and constexprs every kernel takes for this mask (see `key_tile_range`, `score_to_log2`).

        Unbounded sides are passed as 0 with their flag off; the flags are constexprs so an unbounded side costs
        no arithmetic. ``softcap_scale = scale / c`` and ``qk_scale = c · log2(e)`` when softcapping, else
        ``qk_scale = scale · log2(e)``.
        """
        softcapped = self.softcap > 0.0
        return dict(
            window_left=max(self.window_left, 0), window_right=max(self.window_right, 0),
            MASK_LEFT=self.bounded_left, MASK_RIGHT=self.bounded_right,
            softcap_scale=softmax_scale / self.softcap if softcapped else 1.0,
            qk_scale=(self.softcap if softcapped else softmax_scale) * LOG2_E.value,
            SOFTCAP=softcapped,
        )


def make_mask(causal: bool, window=None, softcap=None) -> MaskSpec:
    """Check and normalise the user's mask arguments (names in errors are the public argument names)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    left, right = UNBOUNDED, UNBOUNDED
    if window is not None:
        if not (isinstance(window, (tuple, list)) and len(window) == 2):
            raise TypeError(f"window must be a (left, right) pair of ints (-1 = unbounded), got {window!r}")
        for side in window:
            if isinstance(side, bool) or not isinstance(side, numbers.Integral):
                raise TypeError(f"window must be a (left, right) pair of ints (-1 = unbounded), got {window!r}")
            if side < UNBOUNDED:
                raise ValueError(f"window values must be >= -1 (-1 = unbounded), got {tuple(window)}")
        left, right = int(window[0]), int(window[1])
    if causal:  # flash-attn: causal clips the right side of any window to 0
        right = 0
    cap = 0.0
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap must be a real number or None, got {type(softcap).__name__}")
        if softcap != 0 and not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be finite and > 0 (0 or None: off), got {softcap}")
        cap = float(softcap)
    return MaskSpec(causal=causal, window_left=left, window_right=right, softcap=cap)


# ----------------------------------------------------------------------------------------------------------------
# Host side: the reference's view (materialised masks and scores)
# ----------------------------------------------------------------------------------------------------------------


def visibility(lq: int, lk: int, mask: MaskSpec, device=None, key_start: int = 0,
               key_stop: int | None = None) -> torch.Tensor:
    """Boolean (Lq, keys) over keys [key_start, key_stop) (default: all Lk), True where query i sees key j."""
    rows = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)  # i + diagonal
    cols = torch.arange(key_start, lk if key_stop is None else min(key_stop, lk), device=device).unsqueeze(0)
    seen = torch.ones(lq, cols.shape[1], dtype=torch.bool, device=device)
    if mask.bounded_right:
        seen &= cols <= rows + mask.window_right
    if mask.bounded_left:
        seen &= cols >= rows - mask.window_left
    return seen


def alibi_distance(lq: int, lk: int, device=None, key_start: int = 0, key_stop: int | None = None) -> torch.Tensor:
    """|i + diagonal - j| as float, (Lq, keys): ALiBi's bias is -slope times this."""
    rows = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)
    cols = torch.arange(key_start, lk if key_stop is None else min(key_stop, lk), device=device).unsqueeze(0)
    return (rows - cols).abs()


def score_mods(scores: torch.Tensor, mask: MaskSpec, lq: int, lk: int, alibi_slopes: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, key_start: int = 0, key_stop: int | None = None) -> torch.Tensor:
    """Scaled scores (B, H, Lq, keys) -> softcapped, ALiBi- and bias-added, masked with -inf (differentiable).

    alibi_slopes: (B, H) float, or None. bias: broadcastable to scores, or None.
    """
    if mask.softcap > 0:
        scores = mask.softcap * torch.tanh(scores / mask.softcap)
    if alibi_slopes is not None:
        dist = alibi_distance(lq, lk, scores.device, key_start, key_stop).to(scores.dtype)
        scores = scores - alibi_slopes.to(scores.dtype)[:, :, None, None] * dist
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if mask.bounded_left or mask.bounded_right:
        scores = scores.masked_fill(~visibility(lq, lk, mask, scores.device, key_start, key_stop), float("-inf"))
    return scores


# ----------------------------------------------------------------------------------------------------------------
# Kernels: tile bookkeeping and elementwise rules (Triton and Gluon alike)
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def key_tile_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """For the query tile of rows [start_m, start_m + BLOCK_M): (key_start, full_start, full_end, key_end).

    The tile visits key tiles [key_start, key_end) (key_start a multiple of BLOCK_N; nothing outside is seen by
    any row). Tiles in [full_start, full_end) are seen whole by every row (no elementwise mask, no bounds check);
    [key_start, full_start) and [full_end, key_end) need `visible`. key_start <= full_start <= full_end <= key_end; the first three are multiples of BLOCK_N
    unless clipped to key_end. An empty range has key_start == key_end.
    """
    diagonal = seqlen_k - seqlen_q
    first_row = start_m + diagonal  # i + diagonal for the tile's first and last rows
    last_row = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1 + diagonal
    key_end = seqlen_k
    full_end = seqlen_k // BLOCK_N * BLOCK_N
    if MASK_RIGHT:
        key_end = tl.minimum(tl.maximum(last_row + window_right + 1, 0), seqlen_k)
        full_end = tl.minimum(tl.maximum(first_row + window_right + 1, 0) // BLOCK_N * BLOCK_N, full_end)
    key_start = 0
    full_start = 0
    if MASK_LEFT:
        key_start = tl.minimum(tl.maximum(first_row - window_left, 0) // BLOCK_N * BLOCK_N, key_end)
        full_start = tl.maximum(last_row - window_left, 0)
        full_start = (full_start + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_start = tl.minimum(tl.maximum(full_start, key_start), key_end)
        full_end = tl.minimum(tl.maximum(full_end, full_start), key_end)
    # Without a left bound key_start = full_start = 0 stay literal zeros (loops from a known 0 pipeline with fewer
    # registers: 156 vs 188 in the sm_90 forward at D=64), and 0 <= full_end <= key_end holds by construction.
    return key_start, full_start, full_end, key_end


@triton.jit
def masked_runs(start, full_start, full_end, LEFT_RUN: tl.constexpr):
    """(first tile, gap start) of one loop over both runs of masked tiles of `key_tile_range` ([key_start,
    full_start) and [full_end, key_end); LEFT_RUN = MASK_LEFT) or `query_tile_range` (LEFT_RUN = MASK_RIGHT): the
    loop skips the gap [gap start, full_end). Without a left run the loop starts at full_end with no gap (and the
    kernels' loops do no gap arithmetic: fewer registers)."""
    if LEFT_RUN:
        first, gap_start = start, full_start
    else:
        first, gap_start = full_end, full_end
    return first, gap_start


@triton.jit
def query_tile_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """The transpose of `key_tile_range`, for kernels that hold a key tile [start_n, start_n + BLOCK_N) and walk
    the queries (the backward's dK/dV): (q_start, full_start, full_end, q_end) in rows, q_start a multiple of
    BLOCK_M. Query tiles in [full_start, full_end) see every key of this tile (no mask); the rest need `visible`.
    A key tile that runs past Lk is never full."""
    diagonal = seqlen_k - seqlen_q
    first_key = start_n - diagonal  # j - diagonal for the tile's first and last keys
    last_key = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1 - diagonal
    q_start = 0
    full_start = 0
    if MASK_RIGHT:  # i >= j - diagonal - right
        q_start = tl.minimum(tl.maximum(first_key - window_right, 0) // BLOCK_M * BLOCK_M, seqlen_q)
        full_start = tl.maximum(last_key - window_right, 0)
        full_start = (full_start + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    q_end = seqlen_q
    full_end = seqlen_q // BLOCK_M * BLOCK_M
    if MASK_LEFT:  # i <= j - diagonal + left
        q_end = tl.minimum(tl.maximum(last_key + window_left + 1, 0), seqlen_q)
        full_end = tl.minimum(tl.maximum(first_key + window_left + 1, 0) // BLOCK_M * BLOCK_M, full_end)
    if start_n + BLOCK_N > seqlen_k:
        full_end = 0
    # Clip only what can be out of order (each clip kept costs registers in the dK/dV kernel: 280 vs 200 bytes of
    # spill at D=128 causal). Without a left bound q_end = Lq: full_end <= q_end, and q_start <= full_start (floor
    # vs ceiling of the same bound). Without a right bound q_start = full_start = 0 stay literal zeros.
    if MASK_LEFT:
        q_start = tl.minimum(q_start, q_end)
        full_start = tl.minimum(tl.maximum(full_start, q_start), q_end)
        full_end = tl.minimum(tl.maximum(full_end, full_start), q_end)
    elif MASK_RIGHT:
        full_start = tl.minimum(full_start, q_end)
        full_end = tl.maximum(full_end, full_start)
    return q_start, full_start, full_end, q_end


@triton.jit
def key_tile_bounds(start_m, seqlen_k, diagonal,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The causal-only special case of `key_tile_range`, for dense and causal calls: (full_end, key_end), with key
    tiles [0, full_end) unmasked and [full_end, key_end) masked (no left bound, rows not clipped to Lq). Fewer
    instructions than key_tile_range with a causal window (the sm_90 forward at D=128 causal: 9272 vs 9368)."""
    if CAUSAL:
        key_end = tl.minimum(tl.maximum(start_m + BLOCK_M + diagonal, 0), seqlen_k)
        full_end = tl.minimum(tl.maximum(start_m + 1 + diagonal, 0) // BLOCK_N * BLOCK_N,
                              seqlen_k // BLOCK_N * BLOCK_N)
    else:
        key_end = seqlen_k
        full_end = seqlen_k // BLOCK_N * BLOCK_N
    return full_end, key_end


@triton.jit
def visible(q_pos, k_pos, seqlen_k, diagonal, window_left, window_right,
            MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Whether query q_pos sees key k_pos (broadcast tensors, e.g. offs_m[:, None] and offs_n[None, :]): inside
    the sequence and inside the window. Positions are relative to the sequence's start."""
    seen = k_pos < seqlen_k
    if MASK_RIGHT:
        # this form, not q_pos + diagonal + window_right >= k_pos: the causal sm_90 builds are fingerprinted with it
        # (benchmarks/tools/sass_fingerprints.py), and the instruction order follows the expression's
        seen = seen & (k_pos - diagonal - window_right <= q_pos)
    if MASK_LEFT:
        seen = seen & (k_pos >= q_pos + diagonal - window_left)
    return seen


@triton.jit
def softcap_tanh(x, FAST: tl.constexpr = False):
    """tanh through exp2 (no libdevice, so the interpreter and every backend run it); saturates cleanly.

    FAST: NVIDIA's `tanh.approx.f32` instead (one SFU instruction, relative error below 2^-10.9; not under the
    interpreter). The exp2 form costs a second exp2 and an IEEE division per score, more SFU work than the softmax
    itself: the Hopper forward, SFU-bound, takes FAST (flash-attn's softcap uses the same instruction)."""
    if FAST:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        t = 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2.885... = 2·log2(e)
    return t


@triton.jit
def score_to_log2(s, q_pos, k_pos, diagonal, qk_scale, softcap_scale, alibi_slope_log2,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, FAST_TANH: tl.constexpr = False):
    """Raw products s = q·k -> scores in log2 units (before masking), following `MaskSpec.kernel_args`:
    plain: s·scale·log2e; softcap: c·log2e·tanh(s·scale/c); ALiBi adds -slope·log2e·|i + diagonal - j|.
    Returns (scores, t) where t is tanh(...) for the backward's softcap derivative (1 - t²), or s when not capped.
    Positions may be int or float32 tensors (float ones, with the diagonal already added to q_pos and 0 passed,
    spare the per-score integer-to-float conversion). FAST_TANH: see `softcap_tanh`."""
    if SOFTCAP:
        t = softcap_tanh(s * softcap_scale, FAST_TANH or SOFTCAP == HARDWARE_TANH)
        x = t * qk_scale
    else:
        t = s
        x = s * qk_scale
    if ALIBI:
        x = x - alibi_slope_log2 * tl.abs(q_pos + diagonal - k_pos).to(tl.float32)
    return x, t

