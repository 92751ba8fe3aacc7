"""Tile choices for the MoE kernels, keyed by rows per expert, the problem dims and the GPU.

One ``block_m`` serves the sort's padding and every grouped GEMM over the sorted rows, so it is chosen first,
from the average number of rows an expert receives: small tiles when tokens are few (the layer then streams
expert weights and the GEMM shape barely matters), 128-row tiles when every expert has hundreds of rows
(tensor-core bound). Every GEMM then gets its own ``GemmTiles``; ``choose_tiles`` is only the default: the
layer runs any ``MoETiles`` (``plan.plan_kernels(..., tiles=...)``), which is how
benchmarks/tools/sweep_moe_gemm_tiles.py tries candidates.

The rules are the winners of an H200 sweep (benchmarks/tools/sweep_moe_gemm_tiles.py at Mixtral-8x7B's and
Qwen3-30B-A3B's dims); docs/perf-notes.md ("MoE layer") has the per-GEMM numbers behind each rule and what they
gave the layer. Configs the sweep did not reach (the 64-row regime) are the earlier, unmeasured choices.
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
    # weight-gradient GEMMs only: 0 = one program per (output tile, expert); n > 0 = n programs per SM, each looping
    # over its share of the tiles in one flat loop of reduction steps, so the next tile's loads overlap this one's
    # epilogue (triton_gemm._expert_wgrad_persistent_kernel)
    persistent: int = 0


@dataclass(frozen=True)
class MoETiles:
    block_m: int  # rows per tile of every GEMM over the sorted rows, and the sort's padding
    group_m: int  # row tiles that sweep a column block together (L2 reuse of the expert's weight block)
    up: GemmTiles  # forward GEMM1: gather x @ w1^T with the SwiGLU epilogue (block_n counts gate columns)
    down: GemmTiles  # forward GEMM2: h @ w2^T with the routing weight and the combine in the epilogue
    up_bwd: GemmTiles  # backward: dh = dout @ w2 over d, gathered rows, plain store (SwiGLU backward apart)
    dx: GemmTiles  # backward: d(gate, up) @ w1 combined into dx (the down-combine kernel with K = 2F)
    dw1: GemmTiles  # backward: dw1[e] = d(gate, up)_e^T x_e, block_k sorted rows per step
    dw2: GemmTiles  # backward: dw2[e] = (weight * dout)_e^T h_e, block_k sorted rows per step
    # how the down GEMM's and dx's top_k rows per token meet (COMBINES): "atomic" or "rows" (``choose_combine``)
    combine: str = "atomic"


# The two ways the top_k rows of a token meet in the down-combine GEMMs (the forward's down GEMM, dx):
COMBINES = {
    # float32 atomic adds from the epilogue straight into a zeroed (T, d) accumulator, rounded to x's dtype after:
    # no extra pass, split-K for free; the order of the k additions is not fixed
    "atomic": "float32 atomics into a (T, d) accumulator",
    # each sorted row stored (weighted, in x's dtype) to its own row of a (sorted rows, d) buffer, then one pass
    # (``triton_gemm.combine_rows_launch``) sums each token's k rows in slot order in float32: no atomics, no
    # accumulator fill or conversion, deterministic
    "rows": "rows stored in sorted order, then a combine pass over each token's k rows (slot order, deterministic)",
}


# shared-memory bytes per pipeline stage, in operand elements: (rows of A per tile) x BLOCK_K + B tiles
_OPERANDS = {
    "up": lambda bm, g: bm * g.block_k + 2 * g.block_k * g.block_n,
    "down": lambda bm, g: bm * g.block_k + g.block_k * g.block_n,
    "up_bwd": lambda bm, g: bm * g.block_k + g.block_k * g.block_n,
    "dx": lambda bm, g: bm * g.block_k + g.block_k * g.block_n,
    "dw1": lambda bm, g: ((g.block_m or g.block_n) + g.block_n) * g.block_k,
    "dw2": lambda bm, g: ((g.block_m or g.block_n) + g.block_n) * g.block_k,
}


def gemm_smem_bytes(gemm_name: str, block_m: int, gemm: GemmTiles, itemsize: int = 2) -> int:
    """Shared memory of the operand ring (num_stages buffers) and, for the persistent weight-gradient kernel, of
    its epilogue's layout conversion, which cannot reuse the ring (the next tile's loads are in flight there): what
    Triton 3.6 allocates for these kernels on the H200 (checked against offline builds: docs/perf-notes.md)."""
    ring = gemm.num_stages * _OPERANDS[gemm_name](block_m, gemm) * itemsize
    if gemm.persistent:
        ring += (gemm.block_m or gemm.block_n) * gemm.block_n * itemsize // 2
    return ring


# what CPU (interpreter) tiles plan for: the opt-in shared memory per block of the H200 the tiles were measured on
CPU_SMEM_PER_BLOCK = 232448
SMEM_RESERVED = 2048  # what Triton allocates besides the operand ring (barriers, reduction scratch)


def smem_limit(device) -> int:
    """Bytes of shared memory a GEMM's tiles may plan for on ``device``."""
    if isinstance(device, torch.device) and device.type == "cuda":
        return device_traits(device).smem_per_block - SMEM_RESERVED
    return CPU_SMEM_PER_BLOCK - SMEM_RESERVED


def fit_shared_memory(gemm_name: str, block_m: int, gemm: GemmTiles, itemsize: int, limit: int) -> GemmTiles:
    """``gemm`` made to fit ``limit`` bytes with operands of ``itemsize`` bytes (the tiles are measured for 2-byte
    types; float32 doubles the ring): fewer stages down to 2, then narrower column blocks, then shorter K steps."""
    while gemm_smem_bytes(gemm_name, block_m, gemm, itemsize) > limit:
        if gemm.num_stages > 2:
            gemm = replace(gemm, num_stages=gemm.num_stages - 1)
        elif gemm.block_n > 32:
            gemm = replace(gemm, block_n=gemm.block_n // 2, block_m=min(gemm.block_m, gemm.block_n // 2))
        elif gemm.block_k > 16:
            gemm = replace(gemm, block_k=gemm.block_k // 2)
        else:
            break
    return gemm


# programs per SM that split-K aims for in the weight-streaming regime: at Mixtral T=16 (512 programs at block_n 64)
# split_k 4 beat the 2 that a target of 4 per SM gives, for down and dx; Qwen3 T=16 (thousands of programs) stays at
# split_k 1, measured best there (H200 sweep: docs/perf-notes.md)
SPLIT_K_PROGRAMS_PER_SM = 8


def split_k_for(gemm: GemmTiles, row_tiles: int, K: int, N: int, sm_count: int) -> GemmTiles:
    """``gemm`` with split_k doubled until row_tiles x column blocks x splits covers the SMs
    SPLIT_K_PROGRAMS_PER_SM times over, while every split keeps at least one full BLOCK_K step. Free for the
    down-combine GEMMs: their epilogue accumulates with atomics anyway."""
    programs = max(1, row_tiles) * triton.cdiv(N, gemm.block_n)
    split_k = 1
    while programs * split_k < SPLIT_K_PROGRAMS_PER_SM * sm_count and K // (gemm.block_k * split_k * 2) >= 1:
        split_k *= 2
    return replace(gemm, split_k=split_k)


# The (T, d) float32 accumulator of the atomic combine up to which its atomics are taken to resolve in L2 (H100
# 50 MB, H200 60 MB, shared with the GEMM's operands): past it every atomic is a DRAM read-modify-write of its
# sector, as the k rows of a token arrive from k experts far apart in time
ATOMIC_ACCUMULATOR_L2_BYTES = 32 << 20
# K (F for down, 2F for dx) per row from which the main loop outweighs any epilogue: the atomic combine measured
# best or within 2.5% of the GEMM alone at Mixtral's F = 14336 (dx_configs); the rows buffer would then only add
# traffic
ROWS_COMBINE_MAX_F = 4096


def choose_combine(num_tokens: int, top_k: int, d_model: int, d_ff: int, block_m: int) -> tuple[str, str]:
    """(COMBINES key, why) for the down GEMM and dx of a call.

    Per token the epilogues emit top_k rows of d values against a main loop of K = F (down) or 2F (dx) per row.
    The atomic combine moves T·d·4 bytes to zero the accumulator, top_k·T·d·4 of float32 atomics (a DRAM
    read-modify-write each once the accumulator outgrows L2) and T·d·6 to round it; the rows combine writes
    top_k·T·d·itemsize, reads it back once and writes T·d·itemsize. With bf16 at T = 16384, d = 1536, top_k = 8
    (the TorchTitan Qwen3-MoE job): 0.81 GB of atomics (each a DRAM read and write) plus 0.25 GB to zero and round
    the accumulator, against 0.86 GB of plain stores and loads; at top_k = 1 (expert-parallel rows) 0.10 + 0.25 GB
    against 0.15 GB. Rows where the epilogue
    matters (K small against it: F <= ROWS_COMBINE_MAX_F) and the atomics leave L2; atomics where the accumulator
    fits L2, where K is long, and in the few-row regime (block_m <= 32), whose split-K partial sums meet in them.
    A prediction from the traffic, not yet measured: ``benchmarks/tools/sweep_moe_gemm_tiles.py --combine`` times
    both."""
    accumulator = num_tokens * d_model * 4
    if block_m <= 32:
        return "atomic", f"{block_m}-row tiles (few rows per expert): split-K partial sums meet in the atomics"
    if d_ff > ROWS_COMBINE_MAX_F:
        return "atomic", f"F = {d_ff} > {ROWS_COMBINE_MAX_F}: the main loop outweighs the epilogue's atomics"
    if accumulator <= ATOMIC_ACCUMULATOR_L2_BYTES:
        return "atomic", (f"the (T, d) float32 accumulator ({accumulator / 2**20:.1f} MiB) fits in L2 "
                          f"(<= {ATOMIC_ACCUMULATOR_L2_BYTES >> 20} MiB): its atomics resolve there")
    return "rows", (f"{top_k}x{num_tokens} rows of d = {d_model} per GEMM and F = {d_ff} <= {ROWS_COMBINE_MAX_F}: "
                    f"the accumulator ({accumulator / 2**20:.0f} MiB) outgrows L2, atomics would be DRAM "
                    "read-modify-writes")


def choose_tiles(num_tokens: int, top_k: int, num_experts: int, d_model: int, d_ff: int, device,
                 itemsize: int = 2) -> MoETiles:
    """The launch configs of every MoE GEMM for these dims on ``device``, for operands of ``itemsize`` bytes, and
    the combine (``choose_combine``)."""
    tiles = _measured_tiles(num_tokens, top_k, num_experts, d_model, d_ff, device)
    limit = smem_limit(device)
    fitted = {name: fit_shared_memory(name, tiles.block_m, getattr(tiles, name), itemsize, limit)
              for name in _OPERANDS}
    combine, _ = choose_combine(num_tokens, top_k, d_model, d_ff, tiles.block_m)
    return replace(tiles, combine=combine, **fitted)


def check_combine(tiles: MoETiles) -> None:
    """ValueError unless ``tiles.combine`` is a COMBINES key that its down-combine tiles can run (the rows combine
    stores each row once: no split-K)."""
    if tiles.combine not in COMBINES:
        raise ValueError(f"tiles.combine must be one of {tuple(COMBINES)}, got {tiles.combine!r}")
    if tiles.combine == "rows" and (tiles.down.split_k > 1 or tiles.dx.split_k > 1):
        raise ValueError(f"tiles.combine='rows' stores each sorted row once: split_k must be 1 (down split_k="
                         f"{tiles.down.split_k}, dx split_k={tiles.dx.split_k})")


def _measured_tiles(num_tokens: int, top_k: int, num_experts: int, d_model: int, d_ff: int, device) -> MoETiles:
    """choose_tiles' choice for 2-byte operands: the H200 sweeps' winners (docs/perf-notes.md, "MoE layer")."""
    if triton_interpreter_on():
        # the interpreter runs each program in numpy: few, small programs keep CPU tests quick
        small = GemmTiles(block_n=32, block_k=32, num_warps=4, num_stages=1)
        return MoETiles(block_m=16, group_m=4, up=small, down=small, up_bwd=small, dx=small, dw1=small, dw2=small)

    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        block_m = 16
    elif rows_per_expert <= 32:
        block_m = 32
    elif rows_per_expert <= 48:
        # past ~48 rows per expert the 128-row tiles (and the GEMM families that need them) win despite the
        # padding: these layers are bound by the weights' bytes, not by the padded MMAs (H200, the backward at
        # 40-96 rows per expert with 64- and 128-row tiles: docs/perf-notes.md)
        block_m = 64
    else:
        block_m = 128

    if block_m <= 32:
        # weight-streaming regime: deep pipelines over wide K tiles, enough programs to cover every SM. up, down and
        # dx are the H200 sweep's best or near it at T=16 (GB/s of expert weights: docs/perf-notes.md).
        up = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
        # up_bwd (dh = dout @ w2, the pre-activations being saved): the stream tile, not yet swept
        up_bwd = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
        # few rows leave the down-combine GEMMs with few programs (experts used x d/block_n): split K
        row_tiles = min(num_experts, num_tokens * top_k)
        sms = sm_count(device)
        stream = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
        down = split_k_for(stream, row_tiles, d_ff, d_model, sms)
        dx = split_k_for(stream, row_tiles, 2 * d_ff, d_model, sms)
        # weight gradients: 64x128 output tiles, 4 warps, 2 stages over the expert's (few, block_m-padded) rows:
        # the sweep's best or near it at T=16, ahead of the old 128x128 w8 s3 (docs/perf-notes.md)
        dw1 = dw2 = GemmTiles(block_n=128, block_k=block_m, num_warps=4, num_stages=2, block_m=64)
    elif block_m == 64:
        # not swept at 33-48 rows per expert: the earlier choice
        up = GemmTiles(block_n=64, block_k=64, num_warps=4, num_stages=4)
        down = dx = GemmTiles(block_n=128, block_k=64, num_warps=4, num_stages=4)
        up_bwd = down
        # weight gradients: with <= 64 rows per expert the reduction is one step and the GEMM writes E x 3·d·F
        # outputs (Mixtral T=256: 2.8 GB): the persistent 128x256 tile, 8 warps, 3 stages, one program per SM, was
        # the best of 19 in an H200 sweep (Mixtral T=256, 64-row tiles: docs/perf-notes.md)
        dw1 = dw2 = GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=3, block_m=128, persistent=1)
    else:
        # tensor-core regime (> 48 rows per expert; measured at 256 to 4096 rows: Qwen3 T=4096, Mixtral T=4096 and
        # 16384). Each tile below is the H200 sweep's best or within 1.2% of it (docs/perf-notes.md).
        # up: 128x(2x128) tiles, 8 warps, 4 stages
        up = GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=4)
        # down and dx (the down-combine kernel, K = F and 2F): 128x256 tiles, 8 warps, 4 stages (238 registers,
        #     no spills)
        down = dx = GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=4)
        # up_bwd (dh = dout @ w2 over gathered rows, plain store): the down/dx tile (212 registers, no spills)
        up_bwd = down
        # dw1 / dw2: 128x256 output tiles, 64 sorted rows per step, 8 warps, 3 stages. The persistent kernel (one
        #     program per SM) pays where the reduction is short: dw2 takes it, and dw1, with twice dw2's outputs,
        #     keeps the tile grid from 1024 rows per expert
        wgrad = GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=3, block_m=128)
        dw2 = replace(wgrad, persistent=1)
        dw1 = dw2 if rows_per_expert <= 512 else wgrad
    return MoETiles(block_m=block_m, group_m=8, up=up, down=down, up_bwd=up_bwd, dx=dx, dw1=dw1, dw2=dw2)


def sm_count(device) -> int:
    """SMs of ``device``, for split-K sizing and persistent grids; CPU (interpreter) tensors size as an H200 would
    (132), so interpreter tests take the GPU's branches."""
    if isinstance(device, torch.device) and device.type == "cuda":
        return device_traits(device).sm_count
    return 132
