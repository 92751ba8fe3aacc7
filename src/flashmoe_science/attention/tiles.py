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

from flashmoe_science.device import INTERPRETER_TRAITS, DeviceTraits


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
    if traits.measured_tiles:
        # Measured on an H200 (docs/perf-notes.md): 128-row query tiles over two warpgroups, and key tiles as
        # wide as registers allow (the score tile and the output accumulator both live in registers).
        if block_d <= 64:
            tiles = AttentionTiles(64, 128, 4, 2, use_tma=True)
        elif block_d <= 128:
            tiles = AttentionTiles(64, 64, 4, 3, use_tma=True)
        else:
            tiles = AttentionTiles(128, 64, 8, 2, use_tma=True)
    elif traits.tensor_cores:
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
    candidates = [AttentionTiles(*c, use_tma=traits.measured_tiles) for c in _FORWARD_CANDIDATES]
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


def backward_smem_bytes(tiles: AttentionTiles, head_dim: int, elem_bytes: int, kernel: str,
                        bias_bytes: int = 0) -> int:
    """Shared memory of one backward kernel ("dkdv", "dq" or "fused"), an estimate for fitting tiles to the budget.

    The resident tiles (K and V for "dkdv"/"fused", q and dO for "dq") plus `num_stages` buffered pairs of streamed
    tiles; "fused" also stages dS (twice, for dK and for dQ = dS k) and may keep a transposed copy of K. Against
    Triton 3.6's compute-capability-9.0 builds of the candidates in
    benchmarks/tools/sweep_attention_backward_tiles.py: within 1 KiB for "dkdv" and "dq", and from 1 KiB under to
    twice the real size for "fused" (an upper bound errs towards tiles that fit), wherever the products run on
    warpgroup MMAs; narrow tiles that fall back to mma.sync differ by up to 16 KiB either way."""
    block_d = padded_head_dim(head_dim)
    if kernel == "dq":
        resident, streamed = tiles.block_m, tiles.block_n
    else:
        resident, streamed = tiles.block_n, tiles.block_m
    if elem_bytes == 4:
        # float32 operands: the resident tiles are staged twice (converted for the tf32 products), as an H100 build
        # of the dq kernel showed (Triton 3.6; docs/perf-notes.md)
        resident *= 2
    total = 2 * (resident + max(tiles.num_stages, 1) * streamed) * block_d * elem_bytes
    total += max(tiles.num_stages, 1) * tiles.block_m * tiles.block_n * bias_bytes
    if kernel == "fused":
        total += (2 * tiles.block_m + block_d) * tiles.block_n * elem_bytes
    return total


@functools.lru_cache(maxsize=None)
def backward_tiles(head_dim: int, dtype: torch.dtype, causal: bool, traits: DeviceTraits,
                   bias_bytes: int = 0) -> BackwardTiles:
    """The backward kernels' tiles for one call.

    ``dkdv`` and ``fused``: each program keeps a ``block_n``-key tile of K, V and their fp32 gradients resident and
    streams ``block_m``-row tiles of q and dO (``num_stages`` deep); ``fused`` also holds a (block_m, D) fp32 dQ
    share per step. ``dq``: each program keeps ``block_m`` rows of q, dO and the fp32 dQ resident and streams
    ``block_n``-key tiles of K and V. `bias_bytes`: an attn_bias's element size (its tiles share the budget).
    """
    if traits is INTERPRETER_TRAITS:
        # Small tiles keep the interpreter fast and put diagonal, full and ragged tiles into tiny tests (both paths).
        small = AttentionTiles(block_m=16, block_n=16, num_warps=1, num_stages=1)
        return BackwardTiles(small, small, small)

    block_d = padded_head_dim(head_dim)
    elem_bytes = torch.finfo(dtype).bits // 8
    if traits.measured_tiles:  # as the forward: the measured tables on their generation only
        # Measured on an H200 (benchmarks/tools/sweep_attention_backward_tiles.py; docs/perf-notes.md). Narrow
        # 4-warp dK/dV programs won although they spill: the 8-warp tiles the offline builds preferred for their
        # spill-free registers ran slower. The fused single pass (dQ by atomics) lost to the two passes at every
        # head dim, so it is not used here.
        if block_d <= 64:
            dkdv, dq = AttentionTiles(64, 64, 4, 2), AttentionTiles(128, 64, 8, 3)
        elif block_d <= 128:
            dkdv = AttentionTiles(32, 64, 4, 3) if causal else AttentionTiles(64, 64, 4, 2)
            dq = AttentionTiles(128, 64, 8, 3)
        else:
            dkdv = AttentionTiles(32, 64, 8, 2) if causal else AttentionTiles(64, 32, 4, 2)
            dq = AttentionTiles(128, 64, 8, 1)
    elif traits.tensor_cores:
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
        dkdv=_fit_backward_smem(dkdv, head_dim, elem_bytes, "dkdv", traits, bias_bytes),
        dq=_fit_backward_smem(dq, head_dim, elem_bytes, "dq", traits, bias_bytes),
        fused=None,
    )


def _fit_backward_smem(tiles: AttentionTiles, head_dim: int, elem_bytes: int, kernel: str,
                       traits: DeviceTraits, bias_bytes: int = 0) -> AttentionTiles:
    """Fewer stages, then a smaller resident tile, until `kernel` fits the shared-memory budget."""
    budget = smem_budget(traits)
    resident = "block_m" if kernel == "dq" else "block_n"
    while backward_smem_bytes(tiles, head_dim, elem_bytes, kernel, bias_bytes) > budget:
        if tiles.num_stages > 1:
            tiles = replace(tiles, num_stages=tiles.num_stages - 1)
        elif getattr(tiles, resident) > 16:
            tiles = replace(tiles, **{resident: getattr(tiles, resident) // 2})
        else:
            break
    return tiles
