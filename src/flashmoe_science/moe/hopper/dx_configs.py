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


# dx's configs by K = 2F (``dx_config``). Long K: the cooperative 128x256 tile with the last, partial wave split
# along K, the split being most of its gain over ping-pong. Short K the other way: its items are short, and the
# cooperative consumers' atomic epilogue leaves the tensor cores idle, which ping-pong hides. A fit of the two (the idle
# epilogue a fixed cost per item) puts the break-even near K = 4200 (H200, Mixtral and Qwen3: docs/perf-notes.md).
LONG_K_CONFIG = DxConfig(block_n=256, num_stages=3, split_tail=True)
# short K: ping-pong 128x128 s4, within 5% of the best ping-pong depth at Qwen3's K; the tail split gained nothing
# there (H200: docs/perf-notes.md)
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


# dh: ping-pong 128x128 s4, ahead of the cooperative 128x256 s3 and Triton's dh (H200, Mixtral: docs/perf-notes.md)
DH_CONFIG = DxConfig(block_n=128, num_stages=4, pingpong=True)
# dh with the SwiGLU backward in its epilogue: dh's tile, 32-column epilogue chunks, the fastest measured at Mixtral
# and even at Qwen3 (H200: docs/perf-notes.md)
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
