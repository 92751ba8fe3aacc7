"""The six expert GEMMs as the layer calls them, and the portable Triton family that runs every one of them.

``moe/layer.py`` runs the products over the expert-sorted rows in order; which kernel family runs each one is
decided once per call by ``moe/plan.py`` (an ordered walk over ``plan.GEMM_BACKENDS``), whose plan for a product is
the runner the layer calls. A family's runners take the same operands as the Triton ones here:

- ``up.launch(x, w1, h, gate_up, sort, tiles)`` and ``down.launch(h, w2, out, weights32, sort, tiles)``: the
  forward's launches, kept as data (run it, or ``prepare()`` it for repeated call signatures); ``down.sort_tensors``
  names the sort's tensors its prepared launch takes after (h, w2, out, weights32);
- ``dh_swiglu(grad_out, w2, gate_up, h, weights32, dgu, dweights, sort, tiles)``: d(gate, up) and the
  routing-weight gradient from ``dh = dout @ w2``;
- ``dx(dgu, w1, dx_out, sort, tiles)``; ``dw1(dgu, x_sorted, dw1, sort, tiles)``, ``dw2(g_sorted, h, dw2, sort,
  tiles)``.

down and dx write ``combine_buffer``'s tensor as ``tiles.combine`` says (``tiles.COMBINES``: atomics into a (T, d)
float32 accumulator, or each sorted row to its own row); ``combined`` turns it into the (T, d) result. Each runner
also says what it runs (``describe(tiles)``) for ``moe.api.describe_moe``. The buffers the layer and the runners
share (``empty``, ``sorted_rows``, ``dh_buffer``, ``combine_buffer``) live here too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flashmoe_science.moe.dispatch import ExpertSort
from flashmoe_science.moe.tiles import GemmTiles, MoETiles
from flashmoe_science.moe.triton_gemm import (combine_rows_launch, down_forward_launch, dh_launch, dw1_launch,
                                              dw2_launch, dx_launch, gather_rows_launch, swiglu_backward_launch,
                                              up_swiglu_launch)

FORWARD_GEMMS = ("up", "down")
BACKWARD_GEMMS = ("dh_swiglu", "dx", "dw1", "dw2")
GEMMS = FORWARD_GEMMS + BACKWARD_GEMMS


def empty(shape, dtype, device):
    """``torch.empty``, or NaN-filled when FLASHMOE_SCIENCE_POISON=1 so tests catch any element a kernel skips."""
    if os.environ.get("FLASHMOE_SCIENCE_POISON", "0") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def sorted_rows(src, row_scale, sort: ExpertSort, num_rows: int):
    """``(row_scale *) src[token]`` for every sorted row, in src's dtype: the weight gradients' gathered operand."""
    dst = empty((num_rows, src.shape[1]), src.dtype, src.device)
    gather_rows_launch(src, dst, row_scale, sort)()
    return dst


def dh_buffer(dgu):
    """``dh = dout @ w2`` for the Triton path (float32, sorted rows x F)."""
    # float32: the routing-weight gradient sums F products of it (bf16 dh tripled that gradient's error in the
    # one-token GPU test); the extra traffic is ~1% of the backward at T=4096
    return empty((dgu.shape[0], dgu.shape[1] // 2), torch.float32, dgu.device)


def combine_buffer(x, num_rows: int, tiles: MoETiles):
    """What the down GEMM and dx write: the zeroed (T, d) float32 accumulator of their atomics, or with
    ``tiles.combine == "rows"`` the (num_rows = sort rows, d) buffer of their stored rows, in x's dtype."""
    if tiles.combine == "rows":
        return empty((num_rows, x.shape[1]), x.dtype, x.device)
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device)


def combine_launch(acc, out, sort: ExpertSort, tiles: MoETiles):
    """The launch that turns ``combine_buffer``'s rows into ``out`` (T, d), or None for the atomic combine (its
    accumulator only needs rounding to out's dtype)."""
    return combine_rows_launch(acc, out, sort) if tiles.combine == "rows" else None


def combined(acc, x, sort: ExpertSort, tiles: MoETiles):
    """The (T, d) result in x's dtype from what the down GEMM or dx wrote into ``combine_buffer(x, ...)``."""
    if tiles.combine != "rows":
        return acc.to(x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    combine_launch(acc, out, sort, tiles)()
    return out


def _tiles_label(gemm: GemmTiles, block_m: int) -> str:
    rows = gemm.block_m or block_m
    extras = "".join((f", split-K {gemm.split_k}" if gemm.split_k > 1 else "",
                      ", persistent" if gemm.persistent else ""))
    return f"{rows}x{gemm.block_n}x{gemm.block_k} tiles, {gemm.num_warps} warps, {gemm.num_stages} stages{extras}"


@dataclass(frozen=True)
class TritonUp:
    """Forward GEMM1 with the SwiGLU epilogue (``triton_gemm.up_swiglu_launch``)."""

    def launch(self, x, w1, h, gate_up, sort: ExpertSort, tiles: MoETiles):
        return up_swiglu_launch(x, w1, h, gate_up, sort, tiles)

    def describe(self, tiles: MoETiles) -> str:
        return f"triton_gemm.up_swiglu_launch, {_tiles_label(tiles.up, tiles.block_m)}"


@dataclass(frozen=True)
class TritonDown:
    """Forward GEMM2 with the routing weight and the combine in its epilogue (``triton_gemm.down_forward_launch``)."""

    sort_tensors = ("sorted_pair_ids", "tile_expert")  # down_combine_launch's

    def launch(self, h, w2, out, weights32, sort: ExpertSort, tiles: MoETiles):
        return down_forward_launch(h, w2, out, weights32, sort, tiles)

    def describe(self, tiles: MoETiles) -> str:
        return f"triton_gemm.down_forward_launch, {_tiles_label(tiles.down, tiles.block_m)}, {tiles.combine} combine"


@dataclass(frozen=True)
class TritonDhSwiglu:
    """``dh_launch`` (which gathers dout in its loads) into a float32 dh, then ``swiglu_backward_launch``."""

    def __call__(self, grad_out, w2, gate_up, h, weights32, dgu, dweights, sort: ExpertSort, tiles: MoETiles):
        dh = dh_buffer(dgu)
        dh_launch(grad_out, w2, dh, sort, tiles)()
        swiglu_backward_launch(gate_up, dh, h, weights32, dgu, dweights, sort)()

    def describe(self, tiles: MoETiles) -> str:
        return (f"triton_gemm.dh_launch ({_tiles_label(tiles.up_bwd, tiles.block_m)}) then "
                "triton_gemm.swiglu_backward_launch")


@dataclass(frozen=True)
class TritonDx:
    """``dx[token] += d(gate, up)[row] @ w1[e]`` (``triton_gemm.dx_launch``)."""

    def __call__(self, dgu, w1, dx_out, sort: ExpertSort, tiles: MoETiles):
        dx_launch(dgu, w1, dx_out, sort, tiles)()

    def describe(self, tiles: MoETiles) -> str:
        return f"triton_gemm.dx_launch, {_tiles_label(tiles.dx, tiles.block_m)}, {tiles.combine} combine"


@dataclass(frozen=True)
class TritonWeightGradient:
    """``out[e] = A_e^T B_e`` over expert e's sorted rows (``triton_gemm.dw1_launch`` / ``dw2_launch``)."""

    gemm: str  # "dw1" or "dw2"

    def __call__(self, a, b, out, sort: ExpertSort, tiles: MoETiles):
        (dw1_launch if self.gemm == "dw1" else dw2_launch)(a, b, out, sort, tiles)()

    def describe(self, tiles: MoETiles) -> str:
        return f"triton_gemm.{self.gemm}_launch, {_tiles_label(getattr(tiles, self.gemm), tiles.block_m)}"


TRITON_RUNNERS = {"up": TritonUp(), "down": TritonDown(), "dh_swiglu": TritonDhSwiglu(), "dx": TritonDx(),
                  "dw1": TritonWeightGradient("dw1"), "dw2": TritonWeightGradient("dw2")}


@dataclass(frozen=True)
class GemmProblem:
    """One expert GEMM of a checked call, as the families' ``decline``/``plan`` read it: the product's name, the
    call's tensors (x, w1, w2), top_k and the tiles the layer runs (their block_m pads the sort)."""

    gemm: str
    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    top_k: int
    tiles: MoETiles


class TritonGemms:
    """The portable family: every product, on any GPU Triton supports (and on the CPU through the interpreter)."""

    name = "triton"

    def decline(self, problem: GemmProblem) -> str | None:
        return None

    def plan(self, problem: GemmProblem):
        return TRITON_RUNNERS[problem.gemm]
