"""Tile choices for the MoE kernels, keyed by rows per expert, the problem dims and the GPU.

One ``block_m`` serves the sort's padding and every grouped GEMM over the sorted rows, so it is chosen first,
from the average number of rows an expert receives: small tiles when tokens are few (the layer then streams
expert weights and the GEMM shape barely matters), 128-row tiles when every expert has hundreds of rows
(tensor-core bound). Every GEMM then gets its own ``GemmTiles``; ``choose_tiles`` is only the default: the
launchers take any ``MoETiles`` (``triton_gemm.moe_forward(..., tiles=...)``), which is how scripts/sweep_moe.py
tries candidates.
"""

from dataclasses import dataclass, replace

import torch
import triton

from flashmoe_science.device import device_traits, triton_interpreter_on


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # down-combine GEMMs only: K cut into this many slices, summed by the atomic combine
    block_m: int = 0  # weight-gradient GEMMs only: output rows per tile (0: block_n); the others use MoETiles.block_m


@dataclass(frozen=True)
class MoETiles:
    block_m: int  # rows per tile of every GEMM over the sorted rows, and the sort's padding
    group_m: int  # row tiles that sweep a column block together (L2 reuse of the expert's weight block)
    up: GemmTiles  # forward GEMM1: gather x @ w1^T with the SwiGLU epilogue (block_n counts gate columns)
    down: GemmTiles  # forward GEMM2: h @ w2^T with the routing weight and the combine in the epilogue
    up_bwd: GemmTiles  # backward: gate, up and dout @ w2 recomputed over d, SwiGLU backward in the epilogue
    dx: GemmTiles  # backward: d(gate, up) @ w1 combined into dx (the down-combine kernel with K = 2F)
    dw1: GemmTiles  # backward: dw1[e] = d(gate, up)_e^T x_e, block_k sorted rows per step
    dw2: GemmTiles  # backward: dw2[e] = (weight * dout)_e^T h_e, block_k sorted rows per step


# shared-memory bytes per pipeline stage, in operand elements: (rows of A per tile) x BLOCK_K + B tiles
_OPERANDS = {
    "up": lambda bm, g: bm * g.block_k + 2 * g.block_k * g.block_n,
    "down": lambda bm, g: bm * g.block_k + g.block_k * g.block_n,
    "up_bwd": lambda bm, g: 2 * bm * g.block_k + 3 * g.block_k * g.block_n,
    "dx": lambda bm, g: bm * g.block_k + g.block_k * g.block_n,
    "dw1": lambda bm, g: ((g.block_m or g.block_n) + g.block_n) * g.block_k,
    "dw2": lambda bm, g: ((g.block_m or g.block_n) + g.block_n) * g.block_k,
}


def gemm_smem_bytes(gemm_name: str, block_m: int, gemm: GemmTiles, itemsize: int = 2) -> int:
    """Shared memory of the operand ring (num_stages buffers): an upper estimate of what Triton allocates for
    these kernels (the epilogue's layout conversions reuse the ring)."""
    return gemm.num_stages * _OPERANDS[gemm_name](block_m, gemm) * itemsize


def split_k_for(gemm: GemmTiles, row_tiles: int, K: int, N: int, sm_count: int) -> GemmTiles:
    """``gemm`` with split_k doubled until row_tiles x column blocks x splits covers the SMs four times over,
    while every split keeps at least one full BLOCK_K step. Free for the down-combine GEMMs: their epilogue
    accumulates with atomics anyway."""
    programs = max(1, row_tiles) * triton.cdiv(N, gemm.block_n)
    split_k = 1
    while programs * split_k < 4 * sm_count and K // (gemm.block_k * split_k * 2) >= 1:
        split_k *= 2
    return replace(gemm, split_k=split_k)


def choose_tiles(num_tokens: int, top_k: int, num_experts: int, d_model: int, d_ff: int, device) -> MoETiles:
    if triton_interpreter_on():
        # the interpreter runs each program in numpy: few, small programs keep CPU tests quick
        small = GemmTiles(block_n=32, block_k=32, num_warps=4, num_stages=1)
        return MoETiles(block_m=16, group_m=4, up=small, down=small, up_bwd=small, dx=small, dw1=small, dw2=small)

    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        block_m = 16
    elif rows_per_expert <= 32:
        block_m = 32
    elif rows_per_expert <= 96:
        block_m = 64
    else:
        block_m = 128

    if block_m <= 32:
        # weight-streaming regime: deep pipelines over wide K tiles, enough programs to cover every SM
        up = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
        # few rows leave the down-combine GEMMs with few programs (experts used x d/block_n): split K
        row_tiles = min(num_experts, num_tokens * top_k)
        sms = _sm_count(device)
        stream = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
        down = split_k_for(stream, row_tiles, d_ff, d_model, sms)
        dx = split_k_for(stream, row_tiles, 2 * d_ff, d_model, sms)
    elif block_m == 64:
        up = GemmTiles(block_n=64, block_k=64, num_warps=4, num_stages=4)
        down = dx = GemmTiles(block_n=128, block_k=64, num_warps=4, num_stages=4)
    else:
        # two 128x64 fp32 accumulators (gate, up) per program: 8 warps keep them in registers
        up = GemmTiles(block_n=64, block_k=64, num_warps=8, num_stages=4)
        down = dx = GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=4)
    # five operand tiles per stage: three stages stay inside Hopper's 227 KiB of shared memory
    up_bwd = replace(up, num_stages=min(up.num_stages, 3))
    wgrad = GemmTiles(block_n=128, block_k=min(block_m, 64), num_warps=8, num_stages=3)
    return MoETiles(block_m=block_m, group_m=8, up=up, down=down, up_bwd=up_bwd, dx=dx, dw1=wgrad, dw2=wgrad)


def _sm_count(device) -> int:
    # split-K sizing; CPU (interpreter) tensors size as an H200 would, so interpreter tests take the GPU's branches
    if isinstance(device, torch.device) and device.type == "cuda":
        return device_traits(device).sm_count
    return 132
