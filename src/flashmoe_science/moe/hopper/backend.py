"""The Gluon sm_90 kernels as a family of the MoE layer's expert GEMMs: which products they take and why not, the
tile config each one runs (measured on the H200: dx_configs, wgrad_sm90.MEASURED_CONFIG), and the runners the layer
calls (``moe/gemms.py`` describes the interface).

They take a call on a Hopper GPU with the layer's 128-row tiles (``moe/tiles.py`` picks them from ~48 rows per
expert: there the 128-row tiles and these kernels win despite the padding, the layers being bound by the weights'
bytes) where the kernel's own ``unsupported_reason`` accepts the operands the layer will pass: 16-bit, contiguous,
TMA-aligned weights and dims that tile (decided once per call on meta stand-ins of the layer's fresh buffers, cached
per signature). Each runner carries the ``fallback`` the planner's walk chose for a failed build
(``backends.choose``: the Triton runner of the same product; ``plan.describe`` shows it); a failure is remembered
(``gluon.availability.run_gluon``) and every later call plans the Triton family.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from flashmoe_science.device import device_traits
from flashmoe_science.gluon.availability import plan_time_reason, run_gluon
from flashmoe_science.gluon.target import ARCH
from flashmoe_science.moe.dispatch import ExpertSort, sort_buffers
from flashmoe_science.moe.gemms import GemmProblem, sorted_rows
from flashmoe_science.moe.tiles import MoETiles
from flashmoe_science.prepared_launch import PreparedLaunch

TILE_ROWS = 128  # the sort's row tile every kernel here runs (dx_configs.BLOCK_M, the weight gradient's K step)
_META = torch.device("meta")


# ----------------------------------------------------------------------------------------------------- runners
class HopperDownLaunch(NamedTuple):
    """GEMM2 of the forward in dx_sm90's Gluon kernel (``down_sm90``), kept as data as a ``Launch`` is: run it, or
    prepare it for repeats."""

    h: torch.Tensor
    w2: torch.Tensor
    out: torch.Tensor  # gemms.combine_buffer's, for tiles.combine
    weights32: torch.Tensor
    sort: ExpertSort
    tiles: MoETiles  # the combine, and the Triton launch's tiles where the Gluon kernel does not build
    config: object  # dx_configs.DxConfig
    fallback: object = None  # HopperDown.fallback

    def __call__(self) -> None:
        from flashmoe_science.moe.hopper import dx_sm90

        rows = self.tiles.combine == "rows"
        if not run_gluon("MoE down", lambda: dx_sm90.down_sm90(self.h, self.w2, self.out, self.weights32, self.sort,
                                                                self.sort.block_m, self.config, store_rows=rows),
                         self.fallback is None):
            self.fallback.launch(self.h, self.w2, self.out, self.weights32, self.sort, self.tiles)()

    def prepare(self) -> PreparedLaunch:
        from flashmoe_science.moe.hopper import dx_sm90

        return dx_sm90.prepare_down(self.h, self.w2, self.out, self.weights32, self.sort, self.config,
                                    store_rows=self.tiles.combine == "rows")


@dataclass(frozen=True)
class HopperDown:
    """The forward's down GEMM in ``dx_sm90.down_sm90`` (TMA loads of h and of w2 read K-major)."""

    config: object
    fallback: object = None  # the planner's runner for a failed build

    @property
    def sort_tensors(self) -> tuple[str, ...]:
        from flashmoe_science.moe.hopper import dx_sm90

        return dx_sm90.DOWN_SORT_TENSORS

    def launch(self, h, w2, out, weights32, sort: ExpertSort, tiles: MoETiles):
        return HopperDownLaunch(h, w2, out, weights32, sort, tiles, self.config, self.fallback)

    def describe(self, tiles: MoETiles) -> str:
        return f"dx_sm90.down_sm90, {self.config.label()}, {tiles.combine} combine"


@dataclass(frozen=True)
class HopperDhSwiglu:
    """dh with the SwiGLU backward in its epilogue (``dx_sm90.dh_swiglu_sm90``: dh never reaches memory), over dout
    gathered to the sorted rows first (TMA loads dense boxes)."""

    config: object
    fallback: object = None  # the planner's runner for a failed build

    def __call__(self, grad_out, w2, gate_up, h, weights32, dgu, dweights, sort: ExpertSort, tiles: MoETiles):
        from flashmoe_science.moe.hopper import dx_sm90

        swiglu = dx_sm90.SwigluOperands(gate_up, h, weights32, dweights)
        dout_sorted = sorted_rows(grad_out, None, sort, dgu.shape[0])
        if not run_gluon("MoE dh", lambda: dx_sm90.dh_swiglu_sm90(dout_sorted, w2, dgu, swiglu, sort, tiles.block_m,
                                                                  self.config), self.fallback is None):
            self.fallback(grad_out, w2, gate_up, h, weights32, dgu, dweights, sort, tiles)

    def describe(self, tiles: MoETiles) -> str:
        return f"dx_sm90.dh_swiglu_sm90, {self.config.swiglu_label()}"


@dataclass(frozen=True)
class HopperDx:
    """``dx[token] += d(gate, up)[row] @ w1[e]`` in ``dx_sm90.dx_sm90`` (TMA, warp-specialised), into
    ``gemms.combine_buffer``'s tensor for tiles.combine."""

    config: object
    fallback: object = None  # the planner's runner for a failed build

    def __call__(self, dgu, w1, dx_out, sort: ExpertSort, tiles: MoETiles):
        from flashmoe_science.moe.hopper import dx_sm90

        rows = tiles.combine == "rows"
        if not run_gluon("MoE dx", lambda: dx_sm90.dx_sm90(dgu, w1, dx_out, sort, tiles.block_m, self.config,
                                                            store_rows=rows), self.fallback is None):
            self.fallback(dgu, w1, dx_out, sort, tiles)

    def describe(self, tiles: MoETiles) -> str:
        return f"dx_sm90.dx_sm90, {self.config.label()}, {tiles.combine} combine"


@dataclass(frozen=True)
class HopperWeightGradient:
    """``out[e] = A_e^T B_e`` in ``wgrad_sm90.wgrad_sm90`` (it needs the padding rows of A and B zeroed, which
    their producers in the layer do)."""

    gemm: str  # "dw1" or "dw2"
    config: object
    fallback: object = None  # the planner's runner for a failed build

    def __call__(self, a, b, out, sort: ExpertSort, tiles: MoETiles):
        from flashmoe_science.moe.hopper import wgrad_sm90

        if not run_gluon("MoE weight-gradient", lambda: wgrad_sm90.wgrad_sm90(a, b, out, sort, self.config),
                         self.fallback is None):
            self.fallback(a, b, out, sort, tiles)

    def describe(self, tiles: MoETiles) -> str:
        return f"wgrad_sm90.wgrad_sm90, {self.config.label()}"


# ------------------------------------------------------------------------------------------------------ family
def _config(gemm: str, d_ff: int):
    """The measured tile config of ``gemm`` (dx_configs' rules by K; the weight gradients' one config); ``gemm``
    may be a rows-combine product (``_kernel_gemm``)."""
    if gemm in ("dw1", "dw2"):
        from flashmoe_science.moe.hopper.wgrad_sm90 import MEASURED_CONFIG

        return MEASURED_CONFIG
    from flashmoe_science.moe.hopper import dx_configs

    if gemm in ("down", "down_rows"):
        return dx_configs.down_config(d_ff, rows=gemm == "down_rows")
    if gemm in ("dx", "dx_rows"):
        return dx_configs.dx_config(2 * d_ff, rows=gemm == "dx_rows")
    return dx_configs.DH_SWIGLU_CONFIG


def _kernel_gemm(gemm: str, tiles: MoETiles) -> str:
    """dx_sm90's product for the layer's ``gemm`` under ``tiles.combine``: down and dx have a rows variant."""
    return f"{gemm}_rows" if gemm in ("down", "dx") and tiles.combine == "rows" else gemm


def _layout(t: torch.Tensor) -> tuple:
    """What the kernels' checks read of a weight: shape, strides and base-address alignment (in elements)."""
    return tuple(t.shape), t.stride(), (t.data_ptr() % 16) // t.element_size()


def _meta_like(layout: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor with ``layout`` (``_layout``'s), whose data_ptr has the real one's alignment."""
    shape, stride, offset = layout
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    return torch.empty(offset + extent, dtype=dtype, device=_META).as_strided(shape, stride, offset)


@functools.lru_cache(maxsize=1024)
def _kernel_reason(gemm: str, num_tokens: int, top_k: int, dtype: torch.dtype, w1_layout: tuple,
                   w2_layout: tuple) -> str | None:
    """The kernel's ``unsupported_reason`` for the operands the layer passes it: the weights as given (their
    layouts), the layer's fresh buffers (contiguous, aligned) as meta stand-ins of their shapes and dtypes."""
    from flashmoe_science.moe.hopper import dx_sm90, wgrad_sm90

    w1, w2 = _meta_like(w1_layout, dtype), _meta_like(w2_layout, dtype)
    num_experts, two_d_ff, d_model = w1.shape
    d_ff = two_d_ff // 2
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, TILE_ROWS, _META)
    rows = sort.tile_expert.numel() * TILE_ROWS

    def buffer(*shape, dtype=dtype):
        return torch.empty(shape, dtype=dtype, device=_META)

    weights32 = buffer(num_tokens, top_k, dtype=torch.float32)
    config = _config(gemm, d_ff)
    if gemm == "down":
        return dx_sm90.unsupported_reason(buffer(rows, d_ff), w2, buffer(num_tokens, d_model, dtype=torch.float32),
                                          sort, TILE_ROWS, config, "down", row_scale=weights32)
    if gemm == "down_rows":
        return dx_sm90.unsupported_reason(buffer(rows, d_ff), w2, buffer(rows, d_model), sort, TILE_ROWS, config,
                                          "down_rows", row_scale=weights32)
    if gemm == "dx_rows":
        return dx_sm90.unsupported_reason(buffer(rows, two_d_ff), w1, buffer(rows, d_model), sort, TILE_ROWS,
                                          config, "dx_rows")
    if gemm == "dh_swiglu":
        dgu = buffer(rows, two_d_ff)
        swiglu = dx_sm90.SwigluOperands(buffer(rows, two_d_ff), buffer(rows, d_ff), weights32,
                                        buffer(num_tokens, top_k, dtype=torch.float32))
        return dx_sm90.unsupported_reason(buffer(rows, d_model), w2, dgu, sort, TILE_ROWS, config, "dh_swiglu",
                                          swiglu)
    if gemm == "dx":
        return dx_sm90.unsupported_reason(buffer(rows, two_d_ff), w1, buffer(num_tokens, d_model,
                                                                             dtype=torch.float32),
                                          sort, TILE_ROWS, config)
    if gemm == "dw1":  # d(gate, up) and x, both sorted: (rows, 2F), (rows, d) -> (E, 2F, d)
        return wgrad_sm90.unsupported_reason(buffer(rows, two_d_ff), buffer(rows, d_model),
                                             buffer(num_experts, two_d_ff, d_model), sort, config)
    # dw2: the weighted dout and h, both sorted: (rows, d), (rows, F) -> (E, d, F)
    return wgrad_sm90.unsupported_reason(buffer(rows, d_model), buffer(rows, d_ff),
                                         buffer(num_experts, d_model, d_ff), sort, config)


def _build_dx() -> None:
    """dx_sm90's dx kernel built offline (meta operands of 4096 tokens, top-2 of 8 experts, d 1024, F 2048): what
    gluon.availability.plan_time_reason builds on a triton outside the tested range."""
    from flashmoe_science.moe.hopper import dx_sm90

    sort, _, _ = sort_buffers(4096, 2, 8, TILE_ROWS, _META)
    rows = sort.tile_expert.numel() * TILE_ROWS
    dx_sm90.compile_offline(torch.empty(rows, 4096, dtype=torch.bfloat16, device=_META),
                            torch.empty(8, 4096, 1024, dtype=torch.bfloat16, device=_META),
                            torch.empty(4096, 1024, dtype=torch.float32, device=_META), sort, dx_sm90.DxConfig())


_RUNNERS = {"down": HopperDown, "dh_swiglu": HopperDhSwiglu, "dx": HopperDx}


class HopperGemms:
    """The Gluon sm_90 family of the expert GEMMs (every product but the forward's up GEMM)."""

    name = "hopper"

    def decline(self, problem: GemmProblem) -> str | None:
        if problem.gemm == "up":
            return "no Gluon kernel for the forward's up GEMM (the Triton one fuses the SwiGLU)"
        x = problem.x
        if not x.is_cuda:
            return f"x is on {x.device.type}: the Gluon kernels need a CUDA GPU"
        if problem.tiles.block_m != TILE_ROWS:
            return f"the layer's tiles have {problem.tiles.block_m} rows; the Gluon kernels run {TILE_ROWS}-row tiles"
        arch = device_traits(x.device).arch
        if arch != ARCH:
            return f"the GPU is {arch}; these kernels are {ARCH}'s"
        reason = plan_time_reason("MoE dx", _build_dx)
        if reason is not None:
            return reason
        return _kernel_reason(_kernel_gemm(problem.gemm, problem.tiles), x.shape[0], problem.top_k, x.dtype,
                              _layout(problem.w1), _layout(problem.w2))

    def plan(self, problem: GemmProblem):
        config = _config(_kernel_gemm(problem.gemm, problem.tiles), problem.w2.shape[2])
        if problem.gemm in ("dw1", "dw2"):
            return HopperWeightGradient(problem.gemm, config)
        return _RUNNERS[problem.gemm](config)


HOPPER_GEMMS = HopperGemms()
