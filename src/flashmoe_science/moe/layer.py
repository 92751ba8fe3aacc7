"""The MoE layer's expert computation as a sequence of launches over the expert-sorted rows: the buffers, the
sort, then the expert GEMMs, each run by the family its call's plan chose (``moe/plan.py``; the runners'
interface is in ``moe/gemms.py``): forward (``moe_forward``, and ``prepare_forward`` for repeated call signatures)
and backward (``moe_backward``, with the forward's plan). See ``triton_gemm``'s docstring for what each product
computes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashmoe_science.device import check_interpreter_operands
from flashmoe_science.moe.dispatch import (ExpertSort, flat_ids, sort_buffers, sort_launch_tensors, sort_launches,
                                           sort_pairs_by_expert)
from flashmoe_science.moe.gemms import combine_buffer, combine_launch, combined, empty, sorted_rows
from flashmoe_science.moe.plan import KernelPlan, plan_kernels
from flashmoe_science.moe.tiles import MoETiles
from flashmoe_science.prepared_launch import PreparedLaunch


class SavedForBackward(NamedTuple):
    sort: ExpertSort
    plan: KernelPlan  # the forward's, with the backward's GEMMs planned
    gate_up: torch.Tensor | None  # (sorted rows, 2F) pre-activations [gate | up] in x.dtype; None without tokens
    h: torch.Tensor | None  # (sorted rows, F) the forward's SwiGLU output, GEMM2's operand; None without tokens


def forward_buffers(x, w1, sort: ExpertSort, tiles: MoETiles, save_for_backward: bool = False):
    """``h`` (sorted rows, F), what the down GEMM writes (``gemms.combine_buffer``) and, when saving for the
    backward, the pre-activations ``gate_up`` (sorted rows, 2F; else None)."""
    num_rows = sort.tile_expert.numel() * tiles.block_m
    h = empty((num_rows, w1.shape[1] // 2), x.dtype, x.device)
    acc = combine_buffer(x, num_rows, tiles)
    gate_up = empty((num_rows, w1.shape[1]), x.dtype, x.device) if save_for_backward else None
    return h, acc, gate_up


def backward_buffers(x, w1, sort: ExpertSort, tiles: MoETiles):
    """``d(gate, up)`` (sorted rows, 2F) and the routing-weight gradient (T, k) float32 (zeros: dropped slots are
    never written, and a dh kernel with the SwiGLU epilogue may add per-column-block partial sums into it)."""
    num_rows = sort.tile_expert.numel() * tiles.block_m
    dgu = empty((num_rows, w1.shape[1]), x.dtype, x.device)
    dweights = torch.zeros((x.shape[0], sort.top_k), dtype=torch.float32, device=x.device)
    return dgu, dweights


def _forward_launches(x, w1, w2, weights32, topk_ids, plan: KernelPlan, save_for_backward: bool = False):
    """Fresh sort buffers, ``h``, the down GEMM's ``acc`` (``gemms.combine_buffer``), the output ``out`` of the
    rows combine (None for the atomic one), ``gate_up`` when saving for the backward, and the forward's launches
    over them, in order: the sort's (one, or count, scan and scatter), up, down, then the rows combine's pass.
    Returns ``(sort, acc, out, h, gate_up, launches)``."""
    tiles = plan.tiles
    sort, chunk_counts, chunk_row_base = sort_buffers(x.shape[0], topk_ids.shape[1], w1.shape[0], tiles.block_m,
                                                      x.device)
    h, acc, gate_up = forward_buffers(x, w1, sort, tiles, save_for_backward)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if tiles.combine == "rows" else None
    combine = combine_launch(acc, out, sort, tiles)
    launches = (*sort_launches(flat_ids(topk_ids), sort, chunk_counts, chunk_row_base),
                plan.runner("up").launch(x, w1, h, gate_up, sort, tiles),
                plan.runner("down").launch(h, w2, acc, weights32, sort, tiles),
                *((combine,) if combine is not None else ()))
    return sort, acc, out, h, gate_up, launches


def moe_forward(x, w1, w2, weights32, topk_ids, plan: KernelPlan | None = None, save_for_backward: bool = False):
    """Already-checked tensors: x (T, d), w1 (E, 2F, d), w2 (E, d, F), weights32 (T, k) contiguous float32,
    topk_ids (T, k) int. ``plan``: the call's ``KernelPlan`` (default: ``plan.plan_kernels``; the tile sweep plans
    its candidate tiles). Returns ``(out, SavedForBackward)``; the backward runs with the same plan. With
    ``save_for_backward`` (the plan must then be a training one) the forward also writes the SwiGLU pre-activations
    (sorted rows x 2F, in x.dtype) and keeps h (sorted rows x F, GEMM2's operand), which ``moe_backward`` needs:
    saving them costs one (T·k, 2F) write, recomputing them would cost the backward a third more GEMM work
    (docs/perf-notes.md)."""
    check_interpreter_operands("x", x)
    if plan is None:
        plan = plan_kernels(x, w1, w2, topk_ids.shape[1], training=save_for_backward)
    if save_for_backward and not plan.trains:
        raise ValueError("moe_forward(save_for_backward=True) needs a plan with the backward's GEMMs: "
                         "plan_kernels(..., training=True)")
    if x.shape[0] == 0:
        sort = sort_pairs_by_expert(topk_ids, w1.shape[0], plan.tiles.block_m)
        return x.new_empty((0, x.shape[1])), SavedForBackward(sort, plan, None, None)
    sort, acc, out, h, gate_up, launches = _forward_launches(x, w1, w2, weights32, topk_ids, plan,
                                                             save_for_backward)
    for launch in launches:
        launch()
    out = acc.to(x.dtype) if out is None else out
    return out, SavedForBackward(sort, plan, gate_up, h if save_for_backward else None)


class PreparedForward(NamedTuple):
    """``moe_forward``'s output for one call signature, without its JIT launches: per call, fresh buffers as
    ``_forward_launches`` makes them, then its launches as PreparedLaunches. Every grid and scalar they freeze
    follows from the shapes (T, k, E, d, F), strides, dtypes and device (the sort sizes its outputs for the worst
    case and never reads a count back to the host), so a cache of these is keyed on those and on the inputs'
    16-byte alignment (moe.execute.experts_key, moe_key)."""

    tiles: MoETiles
    sort: tuple[PreparedLaunch, ...]  # dispatch.sort_launches'
    up: PreparedLaunch
    down: PreparedLaunch
    down_sort_tensors: tuple[str, ...]  # the sort's tensors ``down`` takes after (h, w2, acc, weights32)
    combine: PreparedLaunch | None  # the rows combine's pass (triton_gemm.combine_rows_launch), or None

    def __call__(self, x, w1, w2, weights32, topk_ids) -> torch.Tensor:
        """``moe_forward(x, w1, w2, weights32, topk_ids)[0]`` for new tensors of the prepared signature."""
        ids = flat_ids(topk_ids)
        sort, chunk_counts, chunk_row_base = sort_buffers(x.shape[0], topk_ids.shape[1], w1.shape[0],
                                                          self.tiles.block_m, x.device)
        h, acc, _ = forward_buffers(x, w1, sort, self.tiles)
        # each kernel's tensor parameters, in order, as sort_launches / up_swiglu_launch / the down runner /
        # combine_rows_launch pass them
        for launch, tensors in zip(self.sort, sort_launch_tensors(ids, sort, chunk_counts, chunk_row_base)):
            launch(*tensors)
        self.up(x, w1, h, h, sort.sorted_pair_ids, sort.tile_expert)  # (h twice: no gate_up in inference)
        self.down(h, w2, acc, weights32, *(getattr(sort, name) for name in self.down_sort_tensors))
        if self.combine is None:
            return acc.to(x.dtype)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self.combine(acc, sort.pair_row, out)
        return out


def prepare_forward(x, w1, w2, weights32, topk_ids, plan: KernelPlan | None = None) -> PreparedForward:
    """``moe_forward`` for this call signature (arguments as moe_forward, at least one token) as a PreparedForward.
    Builds its launches over throwaway buffers; Triton compiles any kernel no call has compiled yet."""
    if plan is None:
        plan = plan_kernels(x, w1, w2, topk_ids.shape[1])
    _, _, out, _, _, launches = _forward_launches(x, w1, w2, weights32, topk_ids, plan)
    prepared = [launch.prepare() for launch in launches]
    combine = prepared.pop() if out is not None else None
    *sort, up, down = prepared
    return PreparedForward(plan.tiles, tuple(sort), up, down, plan.runner("down").sort_tensors, combine)


def moe_backward(grad_out, x, w1, w2, weights32, saved: SavedForBackward,
                 need_dx: bool = True, need_dw1: bool = True, need_dw2: bool = True):
    """Gradients ``(dx, dw1, dw2, dweights32)`` of ``moe_forward``'s output, reusing its sort, plan and saved
    pre-activations (``moe_forward(..., save_for_backward=True)``).

    The SwiGLU backward always runs (it also yields the routing-weight gradient); the dx GEMM and each weight
    gradient run only when asked for (frozen experts, router-only training), and come back None otherwise.
    """
    sort, plan, gate_up, h = saved
    tiles = plan.tiles
    num_tokens, d_model = x.shape
    dw1 = empty(w1.shape, w1.dtype, w1.device) if need_dw1 else None
    dw2 = empty(w2.shape, w2.dtype, w2.device) if need_dw2 else None
    if num_tokens == 0:
        dx = x.new_empty((0, d_model)) if need_dx else None
        dweights = torch.zeros(weights32.shape, dtype=torch.float32, device=x.device)
        return dx, dw1.zero_() if need_dw1 else None, dw2.zero_() if need_dw2 else None, dweights

    if gate_up is None:
        raise ValueError("moe_backward needs the forward's pre-activations: "
                         "run moe_forward(..., save_for_backward=True)")
    dgu, dweights = backward_buffers(x, w1, sort, tiles)
    plan.runner("dh_swiglu")(grad_out, w2, gate_up, h, weights32, dgu, dweights, sort, tiles)
    dx = None
    num_rows = h.shape[0]
    if need_dx:
        dx_out = combine_buffer(x, num_rows, tiles)
        plan.runner("dx")(dgu, w1, dx_out, sort, tiles)
        dx = combined(dx_out, x, sort, tiles)
    # the weight gradients reduce over sorted rows: their gathered operand is copied to sorted order once (a
    # (rows, d) copy, ~1% of the GEMM's time at T=4096) so that their main loops have affine, pipelined loads
    if need_dw1:
        plan.runner("dw1")(dgu, sorted_rows(x, None, sort, num_rows), dw1, sort, tiles)
    if need_dw2:
        plan.runner("dw2")(sorted_rows(grad_out, weights32, sort, num_rows), h, dw2, sort, tiles)
    return dx, dw1, dw2, dweights
