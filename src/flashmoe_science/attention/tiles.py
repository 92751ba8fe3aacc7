"""Tile shapes for the attention kernels: one heuristic, one autotune search space.

Every kernel asks here for its block sizes, warps and pipeline depth; nothing else in the package picks them.
The heuristics are keyed by head dim, dtype, causality (where it changed the best tile) and the GPU (compute
capability, shared memory per block); the forward values were measured on an H200 (docs/perf-notes.md).
``FLASHMOE_AUTOTUNE=1`` makes the Triton forward search `forward_search_space` instead, per shape.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, replace

import torch

from flashmoe_science.device import INTERPRETER_TRAITS, DeviceTraits, device_traits  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class AttentionTiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def padded_head_dim(head_dim: int) -> int:
    """Head dims are padded to a power of two inside the kernels (Triton block shapes must be powers of 2)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def autotune_enabled() -> bool:
    return os.environ.get("FLASHMOE_AUTOTUNE", "0") == "1"


# Shared memory Triton needs beyond the tiles (layout conversions, barriers), kept free in every Triton budget.
# (The Gluon kernel allocates all of its shared memory explicitly: its tiles are checked against the raw limit.)
SMEM_SCRATCH_BYTES = 8192


def smem_budget(traits: DeviceTraits) -> int:
    return traits.smem_per_block - SMEM_SCRATCH_BYTES


def forward_smem_bytes(tiles: AttentionTiles, head_dim: int, elem_bytes: int) -> int:
    """Shared memory of the forward kernel: the Q tile plus `num_stages` buffered K and V tiles."""
    block_d = padded_head_dim(head_dim)
    q_tile = tiles.block_m * block_d * elem_bytes
    kv_stage = 2 * tiles.block_n * block_d * elem_bytes
    return q_tile + max(tiles.num_stages, 1) * kv_stage


@functools.lru_cache(maxsize=None)
def forward_tiles(head_dim: int, dtype: torch.dtype, causal: bool, traits: DeviceTraits) -> AttentionTiles:
    """The Triton forward kernel's tile shape for one call. (On the H200 the best tile did not depend on
    ``causal``; the argument stays so the heuristic can use it on GPUs where it does.)"""
    if traits is INTERPRETER_TRAITS:
        # The interpreter runs tiles as numpy arrays: small tiles keep the CPU tests fast and exercise tails.
        return AttentionTiles(block_m=16, block_n=16, num_warps=1, num_stages=1, use_tma=False)

    block_d = padded_head_dim(head_dim)
    elem_bytes = torch.finfo(dtype).bits // 8
    if traits.is_hopper:
        # Measured on an H200 (docs/perf-notes.md): 128-row query tiles over two warpgroups, and key tiles as
        # wide as registers allow (the score tile and the output accumulator both live in registers).
        if block_d <= 64:
            tiles = AttentionTiles(64, 128, 4, 2, use_tma=True)
        elif block_d <= 128:
            tiles = AttentionTiles(64, 64, 4, 3, use_tma=True)
        else:
            tiles = AttentionTiles(128, 64, 8, 2, use_tma=True)
    elif traits.capability[0] >= 8:
        tiles = AttentionTiles(128, 64 if block_d <= 128 else 32, 8 if block_d > 64 else 4, 3)
    else:
        tiles = AttentionTiles(64, 32, 4, 2)

    if elem_bytes == 4:
        # fp32 tiles take twice the registers and shared memory.
        tiles = replace(tiles, block_m=min(tiles.block_m, 64), block_n=min(tiles.block_n, 64), num_stages=2)
    return _fit_shared_memory(tiles, head_dim, elem_bytes, traits)


def _fit_shared_memory(tiles: AttentionTiles, head_dim: int, elem_bytes: int, traits: DeviceTraits) -> AttentionTiles:
    budget = smem_budget(traits)
    while forward_smem_bytes(tiles, head_dim, elem_bytes) > budget:
        if tiles.num_stages > 1:
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        elif tiles.block_n > 16:
            tiles = replace(tiles, block_n=tiles.block_n // 2)
        elif tiles.block_m > 16:
            tiles = replace(tiles, block_m=tiles.block_m // 2)
        else:
            break
    return tiles


# (block_m, block_n, num_warps, num_stages): the shapes that competed in the H200 sweeps (docs/perf-notes.md).
# A short list keeps an autotuned call to seconds of compilation per shape.
_FORWARD_CANDIDATES = (
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 4, 3), (128, 32, 8, 3),
    (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
)


def forward_search_space(head_dim: int, dtype: torch.dtype, traits: DeviceTraits) -> list[AttentionTiles]:
    """Candidate tiles for ``FLASHMOE_AUTOTUNE=1``: the measured contenders that fit this GPU's shared memory."""
    elem_bytes = torch.finfo(dtype).bits // 8
    candidates = [AttentionTiles(*c, use_tma=traits.is_hopper) for c in _FORWARD_CANDIDATES]
    return [t for t in candidates if forward_smem_bytes(t, head_dim, elem_bytes) <= smem_budget(traits)]


@dataclass(frozen=True)
class BackwardTiles:
    """The backward kernels' tiles, one set per kernel: `dkdv` and `dq` for the two passes (each also runs alone
    when only dK/dV or only dQ is wanted), `fused` for the dK/dV kernel that also adds dQ with atomics. `fused` is
    None where the two passes measured faster (so `deterministic=False` runs them too)."""

    dkdv: AttentionTiles
    dq: AttentionTiles
    fused: AttentionTiles | None

    def as_dict(self) -> dict:
        return {"dkdv": self.dkdv.as_dict(), "dq": self.dq.as_dict(),
                "fused": self.fused.as_dict() if self.fused is not None else None}


def backward_smem_bytes(tiles: AttentionTiles, head_dim: int, elem_bytes: int, kernel: str) -> int:
    """Shared memory of one backward kernel ("dkdv", "dq" or "fused"), an estimate for fitting tiles to the budget.

    The resident tiles (K and V for "dkdv"/"fused", q and dO for "dq") plus `num_stages` buffered pairs of streamed
    tiles; "fused" also stages dS (twice, for dK and for dQ = dS k) and may keep a transposed copy of K. Against
    Triton 3.6's sm_90 builds of the candidates in benchmarks/tools/sweep_attention_backward_tiles.py: within 1 KiB for "dkdv" and "dq", and
    from 1 KiB under to twice the real size for "fused" (an upper bound errs towards tiles that fit), wherever the
    products run on warpgroup MMAs; narrow tiles that fall back to mma.sync differ by up to 16 KiB either way."""
    block_d = padded_head_dim(head_dim)
    if kernel == "dq":
        resident, streamed = tiles.block_m, tiles.block_n
    else:
        resident, streamed = tiles.block_n, tiles.block_m
    total = 2 * (resident + max(tiles.num_stages, 1) * streamed) * block_d * elem_bytes
    if kernel == "fused":
        total += (2 * tiles.block_m + block_d) * tiles.block_n * elem_bytes
    return total


@functools.lru_cache(maxsize=None)
def backward_tiles(head_dim: int, dtype: torch.dtype, causal: bool, traits: DeviceTraits) -> BackwardTiles:
    """The backward kernels' tiles for one call.

    ``dkdv`` and ``fused``: each program keeps a ``block_n``-key tile of K, V and their fp32 gradients resident and
    streams ``block_m``-row tiles of q and dO (``num_stages`` deep); ``fused`` also holds a (block_m, D) fp32 dQ
    share per step. ``dq``: each program keeps ``block_m`` rows of q, dO and the fp32 dQ resident and streams
    ``block_n``-key tiles of K and V.
    """
    if traits is INTERPRETER_TRAITS:
        # Small tiles keep the interpreter fast and put diagonal, full and ragged tiles into tiny tests (both paths).
        small = AttentionTiles(block_m=16, block_n=16, num_warps=1, num_stages=1)
        return BackwardTiles(small, small, small)

    block_d = padded_head_dim(head_dim)
    elem_bytes = torch.finfo(dtype).bits // 8
    if traits.is_hopper:  # as the forward: Hopper-tuned tiles on Hopper only
        # Measured on an H200 (benchmarks/tools/sweep_attention_backward_tiles.py, bf16, B4 L4096 and B16 L1024; docs/perf-notes.md). Narrow
        # 4-warp dK/dV programs won although they spill (64x64 w4 at D=128: ~116 B/thread): the 8-warp tiles the
        # offline builds preferred for their spill-free registers ran 20-30% slower. The fused single pass (dQ by
        # atomics) lost to the two passes at every head dim (best fused vs best pair, D=64/128/256: 278/288/184
        # vs 329/383/208 TFLOP/s), so it is not used here.
        if block_d <= 64:
            dkdv, dq = AttentionTiles(64, 64, 4, 2), AttentionTiles(128, 64, 8, 3)
        elif block_d <= 128:
            dkdv = AttentionTiles(32, 64, 4, 3) if causal else AttentionTiles(64, 64, 4, 2)
            dq = AttentionTiles(128, 64, 8, 3)
        else:
            dkdv = AttentionTiles(32, 64, 8, 2) if causal else AttentionTiles(64, 32, 4, 2)
            dq = AttentionTiles(128, 64, 8, 1)
    elif traits.capability[0] >= 8:
        if block_d <= 128:
            dkdv, dq = AttentionTiles(32, 64, 4, 2), AttentionTiles(64, 32, 4, 2)
        else:
            dkdv, dq = AttentionTiles(16, 32, 4, 1), AttentionTiles(32, 32, 4, 1)
    else:
        dkdv, dq = AttentionTiles(16, 32, 4, 1), AttentionTiles(32, 16, 4, 1)
    if elem_bytes == 4:
        # fp32 operands take twice the registers and shared memory: halve the resident tile.
        dkdv = replace(dkdv, block_n=max(16, dkdv.block_n // 2))
        dq = replace(dq, block_m=max(16, dq.block_m // 2))
    # No GPU has measured the fused path faster yet (it is exercised by the interpreter tests and direct launches).
    return BackwardTiles(
        dkdv=_fit_backward_smem(dkdv, head_dim, elem_bytes, "dkdv", traits),
        dq=_fit_backward_smem(dq, head_dim, elem_bytes, "dq", traits),
        fused=None,
    )


def _fit_backward_smem(tiles: AttentionTiles, head_dim: int, elem_bytes: int, kernel: str,
                       traits: DeviceTraits) -> AttentionTiles:
    """Fewer stages, then a smaller resident tile, until `kernel` fits the shared-memory budget."""
    budget = smem_budget(traits)
    resident = "block_m" if kernel == "dq" else "block_n"
    while backward_smem_bytes(tiles, head_dim, elem_bytes, kernel) > budget:
        if tiles.num_stages > 1:
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        elif getattr(tiles, resident) > 16:
            tiles = replace(tiles, **{resident: getattr(tiles, resident) // 2})
        else:
            break
    return tiles


# --- Hopper (sm_90) Gluon forward -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardPlan:
    """Which forward kernel runs and with which tiles: "triton" (triton_fwd) or "sm90" (hopper/fwd_sm90).
    ``persistent`` (sm90 only): one CTA per SM looping over query tiles, rather than one CTA per query tile."""

    kernel: str
    tiles: AttentionTiles
    persistent: bool = False
    q_buffers: int = 1  # sm90 only: Q buffers per consumer warpgroup (see sm90_q_buffers)
    cross_item: bool = False  # sm90 only: overlap consecutive work items (see sm90_cross_item)
    strict: bool = False  # sm90 only: backend="hopper": a Gluon build failure raises instead of falling back
    portable: bool = False  # triton only: backend="triton" asked for the portable kernels, the backward's too


# Measured on an H200 (docs/perf-notes.md, sweeps of 2026-11-21, second session): below these lengths the
# choices flip.
SM90_SHORT_CAUSAL_LEN = 1024  # causal, Lq <= this: 64-key tiles for sm_90
SM90_PERSISTENT_MAX_CAUSAL_LEN = 4096  # causal, Lq <= this: persistent CTAs
SM90_PERSISTENT_LONG_CAUSAL_LEN = 8192  # causal, Lq <= this: persistent CTAs where each runs enough items
SM90_PERSISTENT_MIN_ROUNDS = 12  # ... at least this many work items per CTA


def sm90_persistent(causal: bool, seqlen_q: int, num_work: int, sm_count: int) -> bool:
    """Persistent CTAs (one per SM, static snaking rounds over the num_work query tiles) hide each query tile's
    prologue (Q load, first K/V tiles) and epilogue behind the neighbouring tiles: +10-25% at L <= 2048. With
    causal masking their fixed shares of unequal items are balanced only roughly, the worse the fewer items a
    CTA runs and the longer the heaviest; where that costs more than the prologues, one CTA per tile, balanced
    by the hardware scheduler, wins. Measured on the H200 (git history: scripts/ab_persistent_sm90.py, docs/perf-notes.md,
    session 7), persistent vs one CTA per tile, causal: L=8192 with 31 and 15.5 items per CTA +4.5% and +6.6%
    (D=64), +2.8% (D=128, 15.5); with 7.8 items (D=256) -18%; L=16384 -2% (D=64, 31 items), -23% (D=128)."""
    if not causal or seqlen_q <= SM90_PERSISTENT_MAX_CAUSAL_LEN:
        return True
    return seqlen_q <= SM90_PERSISTENT_LONG_CAUSAL_LEN and num_work >= SM90_PERSISTENT_MIN_ROUNDS * sm_count


SM90_BACKWARD_MIN_LEN_D64 = 2048  # query rows from which the sm_90 backward beats the Triton two passes at D <= 64


def sm90_backward_wins(head_dim: int, seqlen_q: int) -> bool:
    """Whether the Gluon sm_90 backward (hopper/bwd_sm90.py) beats the Triton backward. At head dims padding to
    256 (its dK/dV and dQ kernels) it always did: 0.9-1.1x cuDNN against the Triton pass's 0.55-0.65x. For the
    one-pass kernel (64 or 128) vs the Triton two passes: a CTA of 128 keys runs Lq/64 query tiles; with few of
    them its set-up (K/V loads) and its dK/dV stores, which nothing overlaps, weigh most at D=64, where a tile is
    cheapest. Measured on the H200 in one
    process (git history: scripts/bench_bwd_sm90.py, `...-42f3611-bwd-sm90-short.log`), TFLOP/s sm_90 vs two-pass: D=64 L=512
    227 vs 243 (causal 149 vs 171), L=1024 287 vs 292 (217 vs 235), L=2048 337 vs 324 (281 vs 286); D=128 the
    sm_90 kernel is ahead from L=512 (283 vs 248, causal 171 vs 148)."""
    return padded_head_dim(head_dim) > 64 or seqlen_q >= SM90_BACKWARD_MIN_LEN_D64


def sm90_forward_tiles(head_dim: int, causal: bool, seqlen_q: int) -> AttentionTiles:
    """Tiles of the Gluon sm_90 kernel: always 128 query rows on two consumer warpgroups (8 warps) plus a producer
    warp; the key tile and the ring depth vary. Registers bound the key tile (score tile, bf16 P and the fp32
    output accumulator live in registers: ~240 per thread at D=128 with 128-key tiles), shared memory the depth.
    Short causal rows take 64-key tiles: less of the diagonal tile is masked work (L=512: 267 vs 242 TFLOP/s),
    in a three-stage ring where it fits (D <= 128), which lets consecutive items overlap (sm90_cross_item).
    """
    # cached on the length's class, not the length: ragged workloads would grow a per-length cache without bound
    return _sm90_tiles(padded_head_dim(head_dim), causal, causal and seqlen_q <= SM90_SHORT_CAUSAL_LEN)


def sm90_smem_bytes(tiles: AttentionTiles, head_dim: int, q_buffers: int, elem_bytes: int = 2) -> int:
    """Shared memory of one sm_90 CTA: `q_buffers` Q tiles of block_m rows, the K/V ring, and a kilobyte for the
    barriers and alignment (the Gluon kernel allocates everything explicitly: no compiler scratch)."""
    block_d = padded_head_dim(head_dim)
    q_bytes = q_buffers * tiles.block_m * block_d * elem_bytes
    kv_bytes = 2 * tiles.num_stages * tiles.block_n * block_d * elem_bytes
    return q_bytes + kv_bytes + 1024


def sm90_q_buffers(tiles: AttentionTiles, head_dim: int, persistent: bool, traits: DeviceTraits) -> int:
    """Two Q buffers per consumer when a persistent CTA has the shared memory for them: the producer then loads
    the next work item's Q (and, no longer blocked behind it, its first K/V tiles) while the current item runs.
    Measured on the H200 (docs/perf-notes.md): +3% at L=512 D=128, +1-2.5% at L<=2048, neutral beyond. Where it
    would cost a ring stage (D=128 causal, 3 stages) the trade measured even, so the plan's ring stays; D=256 has
    no room."""
    if persistent and sm90_smem_bytes(tiles, head_dim, 2) <= traits.smem_per_block:
        return 2
    return 1


def sm90_cross_item_safe(causal: bool, num_stages: int) -> bool:
    """Whether the sm_90 consumers may issue the next work item's first Q·Kᵀ before their last P·V completes: its K
    tile reuses a ring stage that, with causal masking (a consumer may skip one of the CTA's key tiles) and only two
    stages, is released by that very P·V, a deadlock (hopper/fwd_sm90._attention_consumer)."""
    return not causal or num_stages >= 3


def sm90_cross_item(tiles: AttentionTiles, head_dim: int, causal: bool, persistent: bool, q_buffers: int) -> bool:
    """Overlap consecutive work items of a persistent CTA (the next item's first Q·Kᵀ and softmax under the
    current item's last P·V). Measured on the H200: at D <= 64, where exp2 costs as much as the products, +2-3% at
    L=512-1024 and +2-4% causal at 2-4k; with short causal 64-key tiles in three stages +1-3% (D=64 and D=128).
    With two-stage 128-key rings at D=128/256 it measured 2-4% slower (the next item's first K tile is not
    loaded yet when the last P·V should start). Needs two Q buffers: the current item's output is staged in its
    own Q buffer while the next item's first Q·Kᵀ reads the other."""
    return (persistent and q_buffers == 2 and sm90_cross_item_safe(causal, tiles.num_stages)
            and (padded_head_dim(head_dim) <= 64 or tiles.num_stages >= 3))


@functools.lru_cache(maxsize=None)
def _sm90_tiles(block_d: int, causal: bool, short_causal: bool) -> AttentionTiles:
    if block_d > 128:
        return AttentionTiles(128, 64, 8, 2, use_tma=True)
    if short_causal:
        return AttentionTiles(128, 64, 8, 3, use_tma=True)
    return AttentionTiles(128, 128, 8, 3 if causal else 2, use_tma=True)
