"""The MoE layer's expert computation as a sequence of launches over the expert-sorted rows: the buffers, the
sort, the grouped GEMMs of ``triton_gemm`` (and on Hopper with 128-row tiles the Gluon kernels of ``moe/hopper``,
falling back to the Triton ones where they do not build: ``hopper.availability``), forward (``moe_forward``, and
``prepare_forward`` for repeated call signatures) and backward (``moe_backward``). See ``triton_gemm``'s docstring
for what each launch computes.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from flashmoe_science.device import device_traits
from flashmoe_science.gluon.availability import run_gluon, unavailable_reason
from flashmoe_science.moe.dispatch import (ExpertSort, flat_ids, sort_buffers, sort_launch_tensors, sort_launches,
                                           sort_pairs_by_expert)
from flashmoe_science.moe.tiles import MoETiles, choose_tiles
from flashmoe_science.moe.triton_gemm import (down_forward_launch, dh_launch, dw1_launch, dw2_launch, dx_launch,
                                              gather_rows_launch, swiglu_backward_launch, up_swiglu_launch)
from flashmoe_science.prepared_launch import PreparedLaunch


class SavedForBackward(NamedTuple):
    sort: ExpertSort
    tiles: MoETiles
    gate_up: torch.Tensor | None  # (sorted rows, 2F) pre-activations [gate | up] in x.dtype; None without tokens
    h: torch.Tensor | None  # (sorted rows, F) the forward's SwiGLU output, GEMM2's operand; None without tokens


def _empty(shape, dtype, device):
    """``torch.empty``, or NaN-filled when FLASHMOE_SCIENCE_POISON=1 so tests catch any element a kernel skips."""
    if os.environ.get("FLASHMOE_SCIENCE_POISON", "0") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def forward_buffers(x, w1, sort: ExpertSort, tiles: MoETiles, save_for_backward: bool = False):
    """``h`` (sorted rows, F), the float32 output accumulator (T, d) of the forward and, when saving for the
    backward, the pre-activations ``gate_up`` (sorted rows, 2F; else None)."""
    num_rows = sort.tile_expert.numel() * tiles.block_m
    h = _empty((num_rows, w1.shape[1] // 2), x.dtype, x.device)
    out32 = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    gate_up = _empty((num_rows, w1.shape[1]), x.dtype, x.device) if save_for_backward else None
    return h, out32, gate_up


def sorted_rows(src, row_scale, sort: ExpertSort, num_rows: int):
    """``(row_scale *) src[token]`` for every sorted row, in src's dtype: the weight gradients' gathered operand."""
    dst = _empty((num_rows, src.shape[1]), src.dtype, src.device)
    gather_rows_launch(src, dst, row_scale, sort)()
    return dst


def backward_buffers(x, w1, sort: ExpertSort, tiles: MoETiles):
    """``d(gate, up)`` (sorted rows, 2F) and the routing-weight gradient (T, k) float32 (zeros: dropped slots are
    never written, and the Gluon dh kernel adds per-column-block partial sums into it)."""
    num_rows = sort.tile_expert.numel() * tiles.block_m
    dgu = _empty((num_rows, w1.shape[1]), x.dtype, x.device)
    dweights = torch.zeros((x.shape[0], sort.top_k), dtype=torch.float32, device=x.device)
    return dgu, dweights


def dh_buffer(dgu):
    """``dh = dout @ w2`` for the Triton path (float32, sorted rows x F; the Gluon path keeps dh in registers)."""
    # float32: the routing-weight gradient sums F products of it (bf16 dh tripled that gradient's error in the
    # one-token GPU test); the extra traffic is ~1% of the backward at T=4096
    return _empty((dgu.shape[0], dgu.shape[1] // 2), torch.float32, dgu.device)


def _default_tiles(x, w1, topk_ids) -> MoETiles:
    num_experts, two_d_ff, _ = w1.shape
    return choose_tiles(x.shape[0], topk_ids.shape[1], num_experts, x.shape[1], two_d_ff // 2, x.device,
                        x.element_size())


def _forward_launches(x, w1, w2, weights32, topk_ids, tiles: MoETiles, save_for_backward: bool = False):
    """Fresh sort buffers, ``h``, ``out32`` (and ``gate_up`` when saving for the backward), and the forward's
    launches over them, in order: the sort's (one, or count, scan and scatter), then up and down. Returns
    ``(sort, out32, h, gate_up, launches)``."""
    sort, chunk_counts, chunk_row_base = sort_buffers(x.shape[0], topk_ids.shape[1], w1.shape[0], tiles.block_m,
                                                      x.device)
    h, out32, gate_up = forward_buffers(x, w1, sort, tiles, save_for_backward)
    launches = (*sort_launches(flat_ids(topk_ids), sort, chunk_counts, chunk_row_base),
                up_swiglu_launch(x, w1, h, gate_up, sort, tiles),
                _down_launch(h, w2, out32, weights32, sort, tiles))
    return sort, out32, h, gate_up, launches


class HopperDownLaunch(NamedTuple):
    """GEMM2 of the forward in dx_sm90's Gluon kernel (``down_sm90``), kept as data as a ``Launch`` is: run it, or
    prepare it for repeats (``prepare_down``)."""

    h: torch.Tensor
    w2: torch.Tensor
    out32: torch.Tensor
    weights32: torch.Tensor
    sort: ExpertSort
    tiles: MoETiles  # the Triton launch's, where the Gluon kernel does not build on this triton

    def __call__(self) -> None:
        from flashmoe_science.moe.hopper import dx_sm90

        if not run_gluon("MoE down", lambda: dx_sm90.down_sm90(self.h, self.w2, self.out32, self.weights32,
                                                                self.sort, self.sort.block_m)):
            down_forward_launch(self.h, self.w2, self.out32, self.weights32, self.sort, self.tiles)()

    def prepare(self) -> PreparedLaunch:
        from flashmoe_science.moe.hopper import dx_sm90

        return dx_sm90.prepare_down(self.h, self.w2, self.out32, self.weights32, self.sort)


def _down_launch(h, w2, out32, weights32, sort: ExpertSort, tiles: MoETiles):
    """GEMM2 of the forward: the Gluon kernel where ``_hopper_down`` takes the call, else ``down_forward_launch``."""
    if _hopper_down(h, w2, out32, weights32, sort, tiles):
        return HopperDownLaunch(h, w2, out32, weights32, sort, tiles)
    return down_forward_launch(h, w2, out32, weights32, sort, tiles)


def _down_sort_tensors(launch) -> tuple[str, ...]:
    """The sort's tensors a prepared down launch takes after (h, w2, out32, weights32), in its kernel's order."""
    if isinstance(launch, HopperDownLaunch):
        from flashmoe_science.moe.hopper import dx_sm90

        return dx_sm90.DOWN_SORT_TENSORS
    return ("sorted_pair_ids", "tile_expert")  # down_combine_launch's


def _hopper_down(h, w2, out32, weights32, sort: ExpertSort, tiles: MoETiles) -> bool:
    """Whether the forward's down GEMM runs in the Gluon sm_90 kernel (``dx_sm90.down_sm90``): on Hopper, with
    128-row tiles, 16-bit operands and TMA-aligned rows."""
    if not _gluon_may_run(h, tiles):
        return False
    from flashmoe_science.moe.hopper import dx_sm90

    return dx_sm90.unsupported_reason(h, w2, out32, sort, tiles.block_m, dx_sm90.down_config(w2.shape[2]), "down",
                                      row_scale=weights32) is None


def moe_forward(x, w1, w2, weights32, topk_ids, tiles: MoETiles | None = None, save_for_backward: bool = False):
    """Already-checked tensors: x (T, d), w1 (E, 2F, d), w2 (E, d, F), weights32 (T, k) contiguous float32,
    topk_ids (T, k) int. ``tiles``: the launch configs (default: ``choose_tiles``; the tile sweep passes its
    candidates here). Returns ``(out, SavedForBackward)``; the backward runs with the same tiles. With
    ``save_for_backward`` the forward also writes the SwiGLU pre-activations (sorted rows x 2F, in x.dtype) and keeps
    h (sorted rows x F, GEMM2's operand), which ``moe_backward`` needs: saving them costs one (T·k, 2F) write,
    recomputing them would cost the backward a third more GEMM work (docs/perf-notes.md, session 8)."""
    if tiles is None:
        tiles = _default_tiles(x, w1, topk_ids)
    if x.shape[0] == 0:
        sort = sort_pairs_by_expert(topk_ids, w1.shape[0], tiles.block_m)
        return x.new_empty((0, x.shape[1])), SavedForBackward(sort, tiles, None, None)
    sort, out32, h, gate_up, launches = _forward_launches(x, w1, w2, weights32, topk_ids, tiles, save_for_backward)
    for launch in launches:
        launch()
    return out32.to(x.dtype), SavedForBackward(sort, tiles, gate_up, h if save_for_backward else None)


class PreparedForward(NamedTuple):
    """``moe_forward``'s output for one call signature, without its JIT launches: per call, fresh buffers as
    ``_forward_launches`` makes them, then its launches as PreparedLaunches. Every grid and scalar they freeze
    follows from the shapes (T, k, E, d, F), strides, dtypes and device (the sort sizes its outputs for the worst
    case and never reads a count back to the host), so a cache of these is keyed on those and on the inputs'
    16-byte alignment (moe.api._moe_key, _experts_key)."""

    tiles: MoETiles
    sort: tuple[PreparedLaunch, ...]  # dispatch.sort_launches'
    up: PreparedLaunch
    down: PreparedLaunch
    down_sort_tensors: tuple[str, ...]  # the sort's tensors ``down`` takes after (h, w2, out32, weights32)

    def __call__(self, x, w1, w2, weights32, topk_ids) -> torch.Tensor:
        """``moe_forward(x, w1, w2, weights32, topk_ids)[0]`` for new tensors of the prepared signature."""
        ids = flat_ids(topk_ids)
        sort, chunk_counts, chunk_row_base = sort_buffers(x.shape[0], topk_ids.shape[1], w1.shape[0],
                                                          self.tiles.block_m, x.device)
        h, out32, _ = forward_buffers(x, w1, sort, self.tiles)
        # each kernel's tensor parameters, in order, as sort_launches / up_swiglu_launch / down_forward_launch pass them
        for launch, tensors in zip(self.sort, sort_launch_tensors(ids, sort, chunk_counts, chunk_row_base)):
            launch(*tensors)
        self.up(x, w1, h, h, sort.sorted_pair_ids, sort.tile_expert)  # (h twice: no gate_up in inference)
        self.down(h, w2, out32, weights32, *(getattr(sort, name) for name in self.down_sort_tensors))
        return out32.to(x.dtype)


def prepare_forward(x, w1, w2, weights32, topk_ids, tiles: MoETiles | None = None) -> PreparedForward:
    """``moe_forward`` for this call signature (arguments as moe_forward, at least one token) as a PreparedForward.
    Builds its launches over throwaway buffers; Triton compiles any kernel no call has compiled yet."""
    if tiles is None:
        tiles = _default_tiles(x, w1, topk_ids)
    _, _, _, _, launches = _forward_launches(x, w1, w2, weights32, topk_ids, tiles)
    *sort, up, down = (launch.prepare() for launch in launches)
    return PreparedForward(tiles, tuple(sort), up, down, _down_sort_tensors(launches[-1]))


def moe_backward(grad_out, x, w1, w2, weights32, saved: SavedForBackward,
                 need_dx: bool = True, need_dw1: bool = True, need_dw2: bool = True):
    """Gradients ``(dx, dw1, dw2, dweights32)`` of ``moe_forward``'s output, reusing its sort, tiles and saved
    pre-activations (``moe_forward(..., save_for_backward=True)``).

    The SwiGLU backward always runs (it also yields the routing-weight gradient); the dx GEMM and each weight
    gradient run only when asked for (frozen experts, router-only training), and come back None otherwise.
    """
    sort, tiles, gate_up, h = saved
    num_tokens, d_model = x.shape
    dw1 = _empty(w1.shape, w1.dtype, w1.device) if need_dw1 else None
    dw2 = _empty(w2.shape, w2.dtype, w2.device) if need_dw2 else None
    if num_tokens == 0:
        dx = x.new_empty((0, d_model)) if need_dx else None
        dweights = torch.zeros(weights32.shape, dtype=torch.float32, device=x.device)
        return dx, dw1.zero_() if need_dw1 else None, dw2.zero_() if need_dw2 else None, dweights

    if gate_up is None:
        raise ValueError("moe_backward needs the forward's pre-activations: "
                         "run moe_forward(..., save_for_backward=True)")
    dgu, dweights = backward_buffers(x, w1, sort, tiles)
    _dh_swiglu_backward(grad_out, w2, gate_up, h, weights32, dgu, dweights, sort, tiles)
    dx = None
    if need_dx:
        dx32 = torch.zeros((num_tokens, d_model), dtype=torch.float32, device=x.device)
        dx_sm90 = _hopper_dx(dgu, w1, dx32, sort, tiles)
        if dx_sm90 is None or not run_gluon("MoE dx", lambda: dx_sm90.dx_sm90(
                dgu, w1, dx32, sort, tiles.block_m, dx_sm90.dx_config(w1.shape[1]))):
            dx_launch(dgu, w1, dx32, sort, tiles)()
        dx = dx32.to(x.dtype)
    # the weight gradients reduce over sorted rows: their gathered operand is copied to sorted order once (a
    # (rows, d) copy, ~1% of the GEMM's time at T=4096) so that their main loops have affine, pipelined loads
    num_rows = h.shape[0]
    if need_dw1:
        _weight_gradient(dgu, sorted_rows(x, None, sort, num_rows), dw1, sort, tiles, dw1_launch)
    if need_dw2:
        _weight_gradient(sorted_rows(grad_out, weights32, sort, num_rows), h, dw2, sort, tiles, dw2_launch)
    return dx, dw1, dw2, dweights


def _dh_swiglu_backward(grad_out, w2, gate_up, h, weights32, dgu, dweights, sort: ExpertSort,
                        tiles: MoETiles) -> None:
    """``d(gate, up)`` and the routing-weight gradient from ``dh[row] = dout[token] @ w2[e]``: on Hopper with 128-row
    tiles the Gluon dh GEMM with the SwiGLU backward in its epilogue (moe/hopper/dx_sm90.py, ``dh_swiglu_sm90``:
    dh never reaches memory) over dout gathered to the sorted rows first (TMA loads dense boxes), else
    ``dh_launch`` (which gathers in its loads) into a float32 dh, then ``swiglu_backward_launch``."""
    hopper = _hopper_dh_swiglu(grad_out, w2, gate_up, h, weights32, dgu, dweights, sort, tiles)
    if hopper is not None:
        dx_sm90, swiglu = hopper
        dout_sorted = sorted_rows(grad_out, None, sort, dgu.shape[0])
        if run_gluon("MoE dh", lambda: dx_sm90.dh_swiglu_sm90(dout_sorted, w2, dgu, swiglu, sort, tiles.block_m,
                                                              dx_sm90.DH_SWIGLU_CONFIG)):
            return
    dh = dh_buffer(dgu)
    dh_launch(grad_out, w2, dh, sort, tiles)()
    swiglu_backward_launch(gate_up, dh, h, weights32, dgu, dweights, sort)()


def _hopper_dh_swiglu(grad_out, w2, gate_up, h, weights32, dgu, dweights, sort: ExpertSort, tiles: MoETiles):
    """(the Gluon sm_90 dx module, the SwigluOperands of its dh kernel) where that kernel takes these arguments on
    this GPU (Hopper, 128-row tiles, 16-bit operands, TMA-aligned), else None (dh_launch, swiglu_backward_launch)."""
    if not _gluon_may_run(dgu, tiles):
        return None
    from flashmoe_science.moe.hopper import dx_sm90

    swiglu = dx_sm90.SwigluOperands(gate_up, h, weights32, dweights)
    # checked on a stand-in for the gathered copy of dout (its shape and dtype; fresh, so contiguous and aligned) so
    # that the copy is only made where the kernel takes it
    a = torch.empty((dgu.shape[0], grad_out.shape[1]), dtype=grad_out.dtype, device="meta")
    if dx_sm90.unsupported_reason(a, w2, dgu, sort, tiles.block_m, dx_sm90.DH_SWIGLU_CONFIG, "dh_swiglu",
                                  swiglu) is not None:
        return None
    return dx_sm90, swiglu


def _hopper_dx(dgu, w1, dx32, sort: ExpertSort, tiles: MoETiles):
    """The Gluon sm_90 dx module (TMA, warp-specialised: moe/hopper/dx_sm90.py, ``dx_config``) where it takes
    these arguments on this GPU (Hopper, 128-row tiles, 16-bit operands, TMA-aligned), else None (dx_launch)."""
    if not _gluon_may_run(dgu, tiles):
        return None
    from flashmoe_science.moe.hopper import dx_sm90

    if dx_sm90.unsupported_reason(dgu, w1, dx32, sort, tiles.block_m, dx_sm90.dx_config(w1.shape[1])) is not None:
        return None
    return dx_sm90


def _weight_gradient(a, b, out, sort: ExpertSort, tiles: MoETiles, triton_launch) -> None:
    """``out[e] = A_e^T B_e``: on Hopper with 128-row tiles the Gluon kernel of moe/hopper/wgrad_sm90.py (TMA,
    warp-specialised; it needs the padding rows of A and B zeroed, which their producers in this module do), else
    ``triton_launch`` (dw1_launch / dw2_launch)."""
    if _gluon_may_run(a, tiles):
        from flashmoe_science.moe.hopper import wgrad_sm90

        config = wgrad_sm90.MEASURED_CONFIG
        if wgrad_sm90.unsupported_reason(a, b, out, sort, config) is None and run_gluon(
                "MoE weight-gradient", lambda: wgrad_sm90.wgrad_sm90(a, b, out, sort, config)):
            return
    triton_launch(a, b, out, sort, tiles)()


def _gluon_may_run(t: torch.Tensor, tiles: MoETiles) -> bool:
    """Whether the Gluon sm_90 GEMMs may take a call: on Hopper, with 128-row tiles, where they build on this triton
    (hopper.availability: after a build failure every call runs the Triton kernels)."""
    return (t.is_cuda and tiles.block_m == 128 and device_traits(t.device).is_hopper
            and unavailable_reason() is None)
