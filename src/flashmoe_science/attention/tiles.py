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


def backward_tiles(
    head_dim: int, dtype: torch.dtype, causal: bool, traits: DeviceTraits
) -> tuple[AttentionTiles, AttentionTiles]:
    """The backward kernels' tiles for one call: ``(dkdv, dq)``.

    ``dkdv``: each program keeps a ``block_n``-key tile of K, V and their fp32 gradients resident and streams
    ``block_m``-row tiles of q and dO (``num_stages`` deep). ``dq``: each program keeps ``block_m`` rows of q, dO and
    the fp32 dQ resident and streams ``block_n``-key tiles of K and V. The resident tile is the wide one; the
    streamed one is narrower, since four products per tile pair keep more operands live than the forward's two.
    Correct on the H200 (GPU tests) but not tuned: timed once at commit e93d2dc at ~0.6x cuDNN for D<=128 and
    ~0.3x at D=256 (benchmarks/results). ``causal`` is accepted for the tuning to come.
    """
    if traits is INTERPRETER_TRAITS:
        # Small tiles keep the interpreter fast and put diagonal, full and ragged tiles into tiny tests.
        small = AttentionTiles(block_m=16, block_n=16, num_warps=1, num_stages=1)
        return small, small

    block_d = padded_head_dim(head_dim)
    elem_bytes = torch.finfo(dtype).bits // 8
    if traits.is_hopper:  # as the forward: Hopper-tuned tiles on Hopper only
        # Chosen offline (sm_90 cubins from triton 3.6, before any GPU run) as the largest tiles whose registers fit
        # 255/thread with no or little spilling (dK/dV at D=128: ~120 B/thread, D=256: ~144 B/thread).
        if block_d <= 64:
            dkdv, dq = AttentionTiles(32, 128, 8, 2), AttentionTiles(128, 64, 8, 3)
        elif block_d <= 128:
            dkdv, dq = AttentionTiles(32, 128, 8, 2), AttentionTiles(128, 64, 8, 2)
        else:
            dkdv, dq = AttentionTiles(16, 64, 8, 2), AttentionTiles(64, 32, 8, 2)
    elif traits.capability[0] >= 8:
        if block_d <= 128:
            dkdv, dq = AttentionTiles(32, 64, 4, 2), AttentionTiles(64, 32, 4, 2)
        else:
            dkdv, dq = AttentionTiles(16, 32, 4, 1), AttentionTiles(32, 32, 4, 1)
    else:
        dkdv, dq = AttentionTiles(16, 32, 4, 1), AttentionTiles(32, 16, 4, 1)
    if elem_bytes == 4:
        # fp32 operands take twice the registers and shared memory: halve the resident tile.
        dkdv = AttentionTiles(dkdv.block_m, max(16, dkdv.block_n // 2), dkdv.num_warps, dkdv.num_stages)
        dq = AttentionTiles(max(16, dq.block_m // 2), dq.block_n, dq.num_warps, dq.num_stages)

    def smem(resident_rows: int, streamed_rows: int, stages: int) -> int:
        # two resident tiles (K and V, or q and dO) plus `stages` buffered pairs of streamed tiles
        return 2 * (resident_rows + max(stages, 1) * streamed_rows) * block_d * elem_bytes

    budget = smem_budget(traits)
    while smem(dkdv.block_n, dkdv.block_m, dkdv.num_stages) > budget and (dkdv.num_stages > 1 or dkdv.block_n > 16):
        if dkdv.num_stages > 1:
            dkdv = AttentionTiles(dkdv.block_m, dkdv.block_n, dkdv.num_warps, dkdv.num_stages - 1)
        else:
            dkdv = AttentionTiles(dkdv.block_m, dkdv.block_n // 2, dkdv.num_warps, dkdv.num_stages)
    while smem(dq.block_m, dq.block_n, dq.num_stages) > budget and (dq.num_stages > 1 or dq.block_m > 16):
        if dq.num_stages > 1:
            dq = AttentionTiles(dq.block_m, dq.block_n, dq.num_warps, dq.num_stages - 1)
        else:
            dq = AttentionTiles(dq.block_m // 2, dq.block_n, dq.num_warps, dq.num_stages)
    return dkdv, dq


# --- Hopper (sm_90) Gluon forward -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardPlan:
    """Which forward kernel runs and with which tiles: "triton" (triton_fwd) or "sm90" (hopper/fwd_sm90)."""

    kernel: str
    tiles: AttentionTiles


def sm90_preferred(head_dim: int) -> bool:
    """Whether `backend="auto"` should run the Gluon sm_90 kernel rather than the Triton one on Hopper.

    Measured on an H200 (docs/perf-notes.md, 2026-11-21 sweep): at D <= 64 the exp2 work equals the tensor-core
    work and the Triton kernel is level (non-causal) or 6% ahead (causal); above, the sm_90 kernel leads by 15-25%.
    """
    return padded_head_dim(head_dim) > 64


@functools.lru_cache(maxsize=None)
def sm90_forward_tiles(head_dim: int, causal: bool) -> AttentionTiles:
    """Tiles of the Gluon sm_90 kernel: always 128 query rows on two consumer warpgroups (8 warps) plus a producer
    warp; the key tile and the ring depth vary. Registers bound the key tile (score tile, bf16 P and the fp32
    output accumulator live in registers: ~240 per thread at D=128 with 128-key tiles), shared memory the depth.
    """
    if padded_head_dim(head_dim) <= 128:
        return AttentionTiles(128, 128, 8, 2 if causal else 3, use_tma=True)
    return AttentionTiles(128, 64, 8, 2, use_tma=True)
