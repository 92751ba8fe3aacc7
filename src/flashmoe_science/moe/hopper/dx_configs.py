"""The tile configs of dx_sm90's kernel (dx, dh, the fused SwiGLU dh and the forward's down GEMM): the config type,
the configs measured on the H200 for each product, and the checks a config must pass (shared memory included)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashmoe_science.gluon.sm90 import BARRIER_BYTES
from flashmoe_science.moe.hopper.common import HOPPER_SMEM_PER_BLOCK, check_tile_config

BLOCK_M = 128  # rows per work item: the sort's row tile (one expert per tile)


@dataclass(frozen=True)
class DxConfig:
    """The kernel's tile config (constexprs), dx's or dh's. BLOCK_M is fixed at 128 (the sort's row tile)."""

    block_n: int = 256
    block_k: int = 64
    num_stages: int = 4
    pingpong: bool = False  # consumers alternate work items (block_n 128 only); else both share each item
    group_m: int = 8  # row tiles that sweep the column blocks together (MoETiles.group_m)
    # SWIGLU_BWD only: accumulator columns per epilogue pass (the passes' gate / up / h loads must fit beside the
    # accumulator in the consumer's registers)
    swiglu_cols: int = 16
    # dx (SCATTER_ADD) only: split the items of the last, partial wave along K (see _work_units)
    split_tail: bool = False

    def label(self) -> str:
        mode = "pingpong" if self.pingpong else "coop"
        tail = " split-tail" if self.split_tail else ""
        return f"{BLOCK_M}x{self.block_n}x{self.block_k} s{self.num_stages} {mode}{tail} g{self.group_m}"

    def swiglu_label(self) -> str:
        return f"{self.label()} c{self.swiglu_cols}"


# dx's configs by K = 2F (``dx_config``). H200, 5 interleaved runs, the kernel alone / the layer's backward, ms:
# Mixtral (K = 28672) T=4096 cooperative 128x256 s3 with the tail split 3.07 / 9.61 against ping-pong 128x128 s4
# 3.26 / 9.82 (1088 items of ~350 us are 8.24 waves: the split is most of the gain; without it the cooperative tile lost, 600 vs 644-684 TFLOP/s); T=16384 11.70 / 35.66 vs
# 12.13 / 35.96. Qwen3 (K = 1536) the other way: ping-pong 0.50 / 1.64 and 1.63 / 5.17 at T=4096 / 16384 against
# 0.55 / 1.65 and 1.82 / 5.37 (short items: the cooperative consumers' atomic epilogue leaves the tensor cores idle,
# which ping-pong hides). Fitting the two (cooperative +5% at K = 1536, -2.5% at 28672, the idle epilogue a fixed
# cost per item) puts the break-even near K = 4200.
LONG_K_CONFIG = DxConfig(block_n=256, num_stages=3, split_tail=True)
# H200 (T=4096, TFLOP/s): ping-pong 128x128 s4 Qwen3 432 (Triton 399, torch grouped_mm without the combine 426),
# within 5% of its best (5 stages, 454, but 591 at Mixtral); the tail split measured no gain here (0.52 / 1.63 at
# T=4096)
SHORT_K_CONFIG = DxConfig(block_n=128, num_stages=4, pingpong=True)
LONG_K = 4096  # K = 2F from which LONG_K_CONFIG runs


def dx_config(two_d_ff: int, rows: bool = False) -> DxConfig:
    """dx's measured tile config for K = 2F (see LONG_K_CONFIG). ``rows`` (the rows combine, tiles.COMBINES): the
    same tile without the tail split, whose K parts can only meet in atomics. At small K (2F = 512: 8 K steps of
    64 per 128-row item) the ping-pong tile is kept for the rows combine too: one consumer's row stores (32 KiB
    of bf16 per item) run under the other's main loop, where the cooperative tile's consumers would both stop the
    tensor cores for them. (Not yet measured against the cooperative tile with row stores.)"""
    config = LONG_K_CONFIG if two_d_ff >= LONG_K else SHORT_K_CONFIG
    return replace(config, split_tail=False) if rows else config


def down_config(d_ff: int, rows: bool = False) -> DxConfig:
    """The forward's down GEMM's tile config for K = F: the same product shape as dx's (sorted rows times one
    expert's weight, combined into token rows), so dx's rule by K (not yet measured for down on its own)."""
    return dx_config(d_ff, rows)


# dh: H200, Mixtral T=4096: ping-pong 128x128 s4 1.46 ms,
# cooperative 128x256 s3 1.58 ms, Triton dh_launch 1.54 ms
DH_CONFIG = DxConfig(block_n=128, num_stages=4, pingpong=True)
# dh with the SwiGLU backward in its epilogue: dh's tile, 32-column epilogue chunks (H200: Mixtral
# T=4096 1.73 ms vs 1.96 with 16-column chunks before the fast sigmoid, 1.83-1.95 with 3 stages; Qwen3 even)
DH_SWIGLU_CONFIG = DxConfig(block_n=128, num_stages=4, pingpong=True, swiglu_cols=32)


def smem_bytes(config: DxConfig, itemsize: int = 2, gemm: str = "dx") -> int:
    """Shared memory of the operand ring (A 128 x block_k and B block_k x block_n per stage) plus barriers, and for
    dh_swiglu the epilogue's gate, up and h buffers (3 x 128 x block_n)."""
    ring = config.num_stages * (BLOCK_M + config.block_n) * config.block_k * itemsize
    epilogue = 3 * BLOCK_M * config.block_n * itemsize if gemm == "dh_swiglu" else 0
    return ring + epilogue + BARRIER_BYTES


def check_config(config: DxConfig, itemsize: int = 2, smem_limit: int = HOPPER_SMEM_PER_BLOCK,
                 gemm: str = "dx") -> None:
    """ValueError unless the kernel can run ``config``."""
    if config.split_tail and gemm not in ("dx", "down"):
        # a split item's parts meet only where the epilogue adds (dx's and down's atomics); dh's epilogues store
        raise ValueError(f"{gemm}_sm90: split_tail needs dx's additive epilogue, got {config.label()}")
    if gemm == "dh_swiglu":
        if not config.pingpong:
            # one set of epilogue buffers, handed from item to item: the consumers must take whole items in turn
            raise ValueError(f"dh_swiglu_sm90: needs pingpong=True (the epilogue buffers hold one whole item), got "
                             f"{config.label()}")
        cols = config.swiglu_cols
        if not (8 <= cols <= config.block_n and cols & (cols - 1) == 0):
            # the epilogue halves the tile's columns until a chunk is swiglu_cols wide (a wgmma layout: N >= 8; a
            # TMA box: >= 16 bytes a row)
            raise ValueError(f"dh_swiglu_sm90: swiglu_cols must be a power of two from 8 to block_n = "
                             f"{config.block_n}, got {cols}")
    check_tile_config(f"{gemm}_sm90", config, smem_bytes(config, itemsize, gemm), smem_limit)
