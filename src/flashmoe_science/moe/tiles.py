"""Tile choices for the MoE kernels, keyed by rows per expert, the problem dims and the GPU.

One ``block_m`` serves the sort's padding and every grouped GEMM, so it is chosen first, from the average
number of rows an expert receives: small tiles when tokens are few (the layer then streams expert weights and
the GEMM shape barely matters), 128-row tiles when every expert has hundreds of rows (tensor-core bound).
"""

from dataclasses import dataclass

import torch
import triton

from flashmoe_science.device import device_traits, triton_interpreter_on


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


@dataclass(frozen=True)
class MoETiles:
    block_m: int
    group_m: int
    up: GemmTiles  # gather x @ w1^T with the SwiGLU epilogue (block_n counts gate columns; up columns are as many)
    down: GemmTiles  # h @ w2^T with the routing weight and the combine in the epilogue
    wgrad: GemmTiles  # per-expert weight gradients: block_n x block_n output tiles, block_k sorted rows per step


def choose_tiles(num_tokens: int, top_k: int, num_experts: int, d_model: int, d_ff: int, device) -> MoETiles:
    if triton_interpreter_on():
        # the interpreter runs each program in numpy: few, small programs keep CPU tests quick
        small = GemmTiles(block_n=32, block_k=32, num_warps=4, num_stages=1)
        return MoETiles(block_m=16, group_m=4, up=small, down=small, wgrad=small)

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
        # few rows leave GEMM2 with few programs (E_used x d/block_n); split K (=F) to keep every SM streaming,
        # free because the combine already accumulates with atomics
        tiles_used = max(1, min(num_experts, num_tokens * top_k))
        programs = tiles_used * triton.cdiv(d_model, 64)
        split_k = 1
        while programs * split_k < 4 * _sm_count(device) and d_ff // (128 * split_k * 2) >= 1:
            split_k *= 2
        down = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=split_k)
    elif block_m == 64:
        up = GemmTiles(block_n=64, block_k=64, num_warps=4, num_stages=4)
        down = GemmTiles(block_n=128, block_k=64, num_warps=4, num_stages=4)
    else:
        # two 128x64 fp32 accumulators (gate, up) per program: 8 warps keep them in registers
        up = GemmTiles(block_n=64, block_k=64, num_warps=8, num_stages=4)
        down = GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=4)
    wgrad = GemmTiles(block_n=128, block_k=min(block_m, 64), num_warps=8, num_stages=3)
    return MoETiles(block_m=block_m, group_m=8, up=up, down=down, wgrad=wgrad)


def _sm_count(device) -> int:
    # split-K sizing; CPU (interpreter) tensors size as an H200 would, so interpreter tests take the GPU's branches
    if isinstance(device, torch.device) and device.type == "cuda":
        return device_traits(device).sm_count
    return 132
