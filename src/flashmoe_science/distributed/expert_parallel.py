"""Expert-parallel MoE: the experts of a layer sharded over the ranks of a process group.

Rank r owns a contiguous range of experts (`expert_bounds`, sized as ``torch.tensor_split`` sizes them). Each rank
routes its own tokens; the exchange that moves them is planned per call (``exchange_plan``): on the GPUs of one
host our kernels over symmetric memory (``symm_exchange``: no host read, CUDA-graph capturable), elsewhere the
NCCL/gloo collectives described here. With the collectives, each rank:

1. plans the exchange: a token goes once to every rank owning at least one of its top-k experts (not once per
   expert), carrying its k routing weights and its k expert ids made local to that rank, -1 for slots owned
   elsewhere (`fused_experts` skips ids outside ``[0, E_local)``);
2. exchanges the per-rank counts (one small asynchronous ``all_to_all_single``, issued before the send order is
   computed on the device, then the call's only host synchronisation; on CUDA the plan is two Triton launches,
   ``triton_plan``), then the token rows and their (ids, weights) with ``all_to_all_single`` of uneven splits:
   capacity-free, nothing dropped or padded, a rank may send or receive zero tokens;
3. runs its local experts with `fused_experts` on what it received and sends the weighted partial results back;
   each token's output is the float32 sum, in rank order, of the partials of the ranks it visited (one gather
   over all chunks' returns, `_Exchange.combine`).

Overlap: the tokens are cut into ``overlap_chunks`` consecutive pieces, each exchanged by its own asynchronous
collectives. All dispatches are started first; then for each piece, its experts run as soon as its tokens have
arrived (while later pieces are still in flight) and its results are sent back at once (while the next piece
computes). The backward does the same with the output gradient going out and the input gradients coming back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashmoe_science.distributed.comm import all_to_all, all_to_all_counts, group_rank_and_size
from flashmoe_science.distributed.exchange_plan import (ExchangeProblem, check_capacity_args, check_exchange,
                                                       describe_exchange, plan_exchange)
from flashmoe_science.distributed.pair_plan import plan_pairs
from flashmoe_science.moe.api import fused_experts, moe_route
from flashmoe_science.moe.checks import check_experts as _check_experts, check_topk as _check_topk
from flashmoe_science.moe.plan import BACKENDS
from flashmoe_science.nn.moe import _check_positive_int, check_layer_args, init_experts, tokens_of


def expert_bounds(num_experts: int, world_size: int) -> list[int]:
    """The first expert of each rank, then E: rank r owns experts ``[bounds[r], bounds[r + 1])``."""
    base, extra = divmod(num_experts, world_size)
    bounds = [0]
    for r in range(world_size):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds


@dataclass
class _Exchange:
    """Who sends what to whom in one call, per overlap chunk (pieces of consecutive tokens)."""

    group: object  # as the caller passed it, None for the default group (see ring_attention._Ring.group)
    token_rows: list[torch.Tensor]  # per chunk: the local token of each row sent, ordered by destination
    local_ids: list[torch.Tensor]  # per chunk: (rows, k) int32 expert ids local to the destination, -1 elsewhere
    send_splits: list[list[int]]  # per chunk, per destination rank
    recv_splits: list[list[int]]  # per chunk, per source rank
    # (T, W): the row of each (token, destination) pair in the send order over all chunks, which is also its row in
    # the concatenated returns; -1 (the returns' extra zero row) where the token does not visit that rank
    slots: torch.Tensor

    def returns_buffer(self, like: torch.Tensor, width: int) -> torch.Tensor:
        """Rows for every chunk's returns in send order, plus a last zero row that ``slots`` -1 reads."""
        total = sum(sum(splits) for splits in self.send_splits)
        buffer = like.new_empty((total + 1, width))
        buffer[-1].zero_()
        return buffer

    def combine(self, returned: torch.Tensor, dtype) -> torch.Tensor:
        """Each token's sum of the rows the ranks it visited sent back: one gather of (T, W) rows and a float32 sum
        in rank order, deterministic (an fp32 copy and an index_add per chunk took 0.8 ms at T = 16k, d = 2048 on
        an H100; this, one pass over the returns)."""
        return returned[self.slots].sum(1, dtype=dtype)  # reductions accumulate 16-bit floats in float32


def _plan_exchange(topk_ids: torch.Tensor, num_experts: int, world_size: int, group, chunks: int) -> _Exchange:
    """Who sends what to whom, with one host synchronisation: the counts table goes out first (an asynchronous
    all-to-all of a few bytes), the send order of every (token, destination) pair is computed on the device while it
    flies, and one host copy of both count tables then sizes the transfers."""
    tables = torch.empty((2, world_size, chunks), dtype=torch.int64, device=topk_ids.device)  # sent, received
    arriving = []

    def counts_ready():
        arriving.append(all_to_all_counts(tables[0], group, out=tables[1]))

    slots, pair_token, pair_ids = plan_pairs(topk_ids, num_experts, world_size, tables[0], counts_ready)
    arriving[0].wait()
    send_table, recv_table = tables.tolist()  # the one host synchronisation
    send_splits = [list(col) for col in zip(*send_table)]  # per chunk, per destination
    recv_splits = [list(col) for col in zip(*recv_table)]  # per chunk, per source
    token_rows, local_ids, first = [], [], 0
    for splits in send_splits:
        stop = first + sum(splits)
        token_rows.append(pair_token[first:stop])
        local_ids.append(pair_ids[first:stop])
        first = stop
    return _Exchange(group, token_rows, local_ids, send_splits, recv_splits, slots)


class _ExpertParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, w1, w2, exchange: _Exchange, backend: str):
        group, top_k = exchange.group, exchange.local_ids[0].shape[1]
        needs_grad = any(ctx.needs_input_grad[:4])
        # leaves of the local expert graphs (detached views: no copy), kept for the backward
        w1_leaf = w1.detach().requires_grad_(ctx.needs_input_grad[2])
        w2_leaf = w2.detach().requires_grad_(ctx.needs_input_grad[3])
        arrivals = []
        for rows, ids, send_splits, recv_splits in zip(exchange.token_rows, exchange.local_ids,
                                                       exchange.send_splits, exchange.recv_splits):
            meta = torch.cat((ids, topk_weights[rows].float().view(torch.int32)), dim=1)  # one message
            arrivals.append((all_to_all(x[rows], send_splits, recv_splits, group),
                             all_to_all(meta, send_splits, recv_splits, group)))
        saved, returns, first = [], [], 0
        returned = exchange.returns_buffer(x, x.shape[1])
        for (x_arriving, meta_arriving), send_splits, recv_splits in zip(arrivals, exchange.send_splits,
                                                                         exchange.recv_splits):
            x_recv, meta_recv = x_arriving.wait(), meta_arriving.wait()
            ids_recv = meta_recv[:, :top_k].contiguous()
            weights_recv = meta_recv[:, top_k:].contiguous().view(torch.float32)
            with torch.enable_grad():
                x_recv.requires_grad_(ctx.needs_input_grad[0])
                weights_recv.requires_grad_(ctx.needs_input_grad[1])
                y = fused_experts(x_recv, w1_leaf, w2_leaf, weights_recv, ids_recv, backend=backend)
            saved.append((y, x_recv, weights_recv) if needs_grad else None)
            stop = first + sum(send_splits)
            returns.append(all_to_all(y.detach(), recv_splits, send_splits, group, out=returned[first:stop]))
            first = stop
        for partials in returns:
            partials.wait()
        out = exchange.combine(returned, x.dtype)  # the sum over the ranks each token visited
        ctx.exchange, ctx.saved, ctx.leaves = exchange, saved, (w1_leaf, w2_leaf)
        ctx.shapes = (x.shape, x.dtype, topk_weights.shape, topk_weights.dtype)
        return out.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        exchange, group = ctx.exchange, ctx.exchange.group
        (x_shape, x_dtype, w_shape, w_dtype), (w1_leaf, w2_leaf) = ctx.shapes, ctx.leaves
        need_dx, need_dweights, need_dw1, need_dw2 = ctx.needs_input_grad[:4]
        arrivals = [all_to_all(grad_out[rows], send_splits, recv_splits, group)
                    for rows, send_splits, recv_splits in zip(exchange.token_rows, exchange.send_splits,
                                                             exchange.recv_splits)]
        dw1 = dw2 = None  # the first chunk's weight gradients, then the others added in place (no zero fill)
        returns, first = [], 0
        dx_returned = exchange.returns_buffer(grad_out, x_shape[1]) if need_dx else None  # x's dtype, as dx_recv
        dweights_returned = (exchange.returns_buffer(grad_out.new_empty(0, dtype=torch.float32), w_shape[1])
                             if need_dweights else None)
        for arriving, (y, x_recv, weights_recv), send_splits, recv_splits in zip(
                arrivals, ctx.saved, exchange.send_splits, exchange.recv_splits):
            grad_recv = arriving.wait()
            wanted = [t for t, need in ((x_recv, need_dx), (weights_recv, need_dweights), (w1_leaf, need_dw1),
                                        (w2_leaf, need_dw2)) if need]
            # a rank that received no token has an output no input reaches: zero gradients
            grads = (list(torch.autograd.grad(y, wanted, grad_recv, allow_unused=True)) if y.requires_grad
                     else [None] * len(wanted))
            grads = [torch.zeros_like(t) if g is None else g for t, g in zip(wanted, grads)]
            dx_recv = grads.pop(0) if need_dx else None
            dweights_recv = grads.pop(0) if need_dweights else None
            if need_dw1:
                dw1 = _accumulate(dw1, grads.pop(0))
            if need_dw2:
                dw2 = _accumulate(dw2, grads.pop(0))
            stop = first + sum(send_splits)
            if need_dx:
                returns.append(all_to_all(dx_recv, recv_splits, send_splits, group, out=dx_returned[first:stop]))
            if need_dweights:
                returns.append(all_to_all(dweights_recv.float(), recv_splits, send_splits, group,
                                          out=dweights_returned[first:stop]))
            first = stop
        for back in returns:
            back.wait()
        dx = exchange.combine(dx_returned, x_dtype) if need_dx else None
        dweights = exchange.combine(dweights_returned, w_dtype) if need_dweights else None
        ctx.saved = ctx.exchange = None  # the local graphs are spent; the graph no longer refers to the group
        return dx, dweights, dw1, dw2, None, None


def _accumulate(total, grad):
    """total + grad, in place into total from the second term on (the first term is kept as is: no zeroed buffer
    and no extra pass over a weight-sized tensor)."""
    return grad if total is None else total.add_(grad)


def _check_chunks(overlap_chunks) -> None:
    if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
        raise ValueError(f"overlap_chunks must be an int >= 1, got {overlap_chunks!r}")


def expert_parallel_experts(x, w1, w2, topk_weights, topk_ids, group=None, *, num_experts: int,
                            backend: str = "auto", overlap_chunks: int = 2, exchange: str = "auto",
                            capacity_factor: float | None = None, max_tokens: int | None = None):
    """`fused_experts` with the experts sharded over ``group`` (None: the default group).

    Args:
        x: ``(T, d)`` this rank's tokens (T may differ between ranks, and be 0).
        w1, w2: this rank's experts, ``(E_local, 2F, d)`` and ``(E_local, d, F)``: experts
            ``[expert_bounds(E, W)[r], expert_bounds(E, W)[r + 1])`` of the layer.
        topk_weights, topk_ids: ``(T, k)`` routing of this rank's tokens over the *global* expert ids ``[0, E)``.
        num_experts: E, the layer's expert count (the same on every rank, at least the group's size).
        overlap_chunks: pieces of the token range whose exchanges overlap the expert GEMMs of the others (the same
            on every rank; the NCCL exchange); 1: no overlap.
        exchange: "auto" (``exchange_plan``: symmetric memory where the group's GPUs share a host, else NCCL),
            "symm_mem" or "nccl".
        capacity_factor: the symmetric-memory exchange's rows per (source, destination) over the average
            (``symm_exchange.capacity``); None: room for every token, never overflows.
        max_tokens: the most tokens any rank passes, which the symmetric-memory exchange's buffers hold (the same
            on every rank; default: the most of the first call, agreed by one all-reduce, grown when every rank
            passes more).

    Returns ``(T, d)`` in x's dtype, differentiable with respect to x, topk_weights, w1 and w2 (the gradients of w1
    and w2 include every rank's tokens). Equals `fused_experts` of the whole layer on all ranks' tokens.
    """
    rank, world_size = group_rank_and_size(group)
    _check_positive_int("num_experts", num_experts)
    if num_experts < world_size:
        raise ValueError(f"num_experts ({num_experts}) must be at least the group's size ({world_size})")
    _check_chunks(overlap_chunks)
    num_tokens, _, local_experts, _ = _check_experts(x, w1, w2)
    _check_topk(topk_weights, topk_ids, num_tokens, x)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    bounds = expert_bounds(num_experts, world_size)
    if local_experts != bounds[rank + 1] - bounds[rank]:
        raise ValueError(f"w1 must hold this rank's {bounds[rank + 1] - bounds[rank]} experts "
                         f"([{bounds[rank]}, {bounds[rank + 1]}) of {num_experts} over {world_size} ranks), "
                         f"got {local_experts}")
    check_exchange(exchange)
    check_capacity_args(capacity_factor, max_tokens)
    if world_size == 1:
        return fused_experts(x, w1, w2, topk_weights, topk_ids, backend=backend)
    if plan_exchange(ExchangeProblem(x, group, exchange)).backend == "symm_mem":
        from flashmoe_science.distributed.symm_exchange import symmetric_expert_parallel

        return symmetric_expert_parallel(x, topk_weights, w1, w2, topk_ids, group, num_experts, backend,
                                         capacity_factor, max_tokens)
    plan = _plan_exchange(topk_ids, num_experts, world_size, group, overlap_chunks)
    return _ExpertParallel.apply(x, topk_weights, w1, w2, plan, backend)


class ExpertParallelMoE(nn.Module):
    """A Mixture-of-Experts FFN whose experts are sharded over a process group: the `FusedMoE` layer of E experts,
    of which this rank holds ``[expert_bounds(E, W)[r], expert_bounds(E, W)[r + 1])``.

    Parameters: ``router.weight (E, d)`` (replicated: every rank routes its own tokens; average its gradient over the
    data-parallel ranks as for any replicated parameter, e.g. with DistributedDataParallel), ``w1 (E_local, 2F, d)``,
    ``w2 (E_local, d, F)``. Input ``(..., d_model)``: this rank's tokens; output of the same shape and dtype.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, group=None, *,
                 renormalize: bool = True, scoring: str = "softmax", backend: str = "auto", overlap_chunks: int = 2,
                 exchange: str = "auto", capacity_factor: float | None = None, max_tokens: int | None = None,
                 device=None, dtype=None):
        super().__init__()
        check_layer_args(d_model, d_ff, num_experts, top_k, renormalize, scoring, backend)
        _check_chunks(overlap_chunks)
        check_exchange(exchange)
        check_capacity_args(capacity_factor, max_tokens)
        self.exchange, self.capacity_factor, self.max_tokens = exchange, capacity_factor, max_tokens
        rank, world_size = group_rank_and_size(group)
        if num_experts < world_size:
            raise ValueError(f"num_experts ({num_experts}) must be at least the group's size ({world_size})")
        bounds = expert_bounds(num_experts, world_size)
        self.group, self.expert_range = group, (bounds[rank], bounds[rank + 1])
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.renormalize, self.scoring, self.backend, self.overlap_chunks = renormalize, scoring, backend, overlap_chunks
        factory = dict(device=device, dtype=dtype)
        local = bounds[rank + 1] - bounds[rank]
        self.router = nn.Linear(d_model, num_experts, bias=False, **factory)
        self.w1 = nn.Parameter(torch.empty(local, 2 * d_ff, d_model, **factory))
        self.w2 = nn.Parameter(torch.empty(local, d_model, d_ff, **factory))
        self.reset_parameters()

    def reset_parameters(self):
        # as FusedMoE (the router should match across ranks: seed identically or broadcast it)
        init_experts(self.w1, self.w2)
        self.router.reset_parameters()

    @classmethod
    def from_fused_moe(cls, module, group=None, *, overlap_chunks: int = 2, exchange: str = "auto",
                       capacity_factor: float | None = None, max_tokens: int | None = None) -> "ExpertParallelMoE":
        """This rank's shard of a `FusedMoE` (present on every rank): a copy of its local experts and of its router."""
        sharded = cls(module.d_model, module.d_ff, module.num_experts, module.top_k, group,
                      renormalize=module.renormalize, scoring=module.scoring, backend=module.backend,
                      overlap_chunks=overlap_chunks, exchange=exchange, capacity_factor=capacity_factor,
                      max_tokens=max_tokens, device="meta", dtype=module.w1.dtype)
        first, stop = sharded.expert_range
        sharded.router = nn.Linear(module.d_model, module.num_experts, bias=False, device=module.w1.device,
                                   dtype=module.router.weight.dtype)
        with torch.no_grad():
            sharded.router.weight.copy_(module.router.weight)
        sharded.w1 = nn.Parameter(module.w1.detach()[first:stop].clone())
        sharded.w2 = nn.Parameter(module.w2.detach()[first:stop].clone())
        return sharded

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = tokens_of(hidden_states, self.d_model)
        topk_weights, topk_ids = moe_route(self.router(x), self.top_k, self.renormalize, self.scoring)
        out = expert_parallel_experts(x, self.w1, self.w2, topk_weights, topk_ids, self.group,
                                      num_experts=self.num_experts, backend=self.backend,
                                      overlap_chunks=self.overlap_chunks, exchange=self.exchange,
                                      capacity_factor=self.capacity_factor, max_tokens=self.max_tokens)
        return out.reshape(hidden_states.shape)

    def check_capacity(self) -> None:
        """Raise where a call on this layer's group since its symmetric-memory buffers were made sent more tokens to a
        rank than their capacity (``capacity_factor``); one host read, for outside the step or the captured graph."""
        from flashmoe_science.distributed.symm_exchange import check_exchange_capacity

        check_exchange_capacity(self.group)

    def describe_exchange(self, hidden_states: torch.Tensor) -> str:
        """Which exchange a call on ``hidden_states`` takes, and why the ones before it declined."""
        return describe_exchange(plan_exchange(ExchangeProblem(hidden_states, self.group, self.exchange)))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"experts=[{self.expert_range[0]}, {self.expert_range[1]}), backend={self.backend!r}, "
                f"overlap_chunks={self.overlap_chunks}, exchange={self.exchange!r}, "
                f"capacity_factor={self.capacity_factor}, max_tokens={self.max_tokens}")
