"""Expert parallelism over symmetric memory: our kernels move the tokens between the GPUs of one host, with no host
read in the forward or the backward, so a layer (and a step) can be captured in a CUDA graph.

Every rank allocates the same buffers once (``torch.distributed._symmetric_memory``: CUDA IPC mappings of each
peer's allocation; NVLink multicast is not used) and reaches a peer's copy at a fixed distance from its own
(``triton_exchange``). Rank s's rows for rank w land in rows ``[s·cap, (s + 1)·cap)`` of w's receive regions, in
token order, ``cap`` rows per (source, destination) (`capacity`). A layer's forward, on every rank:

1. the pair plan (``pair_plan.plan_pairs``, device only): each (token, destination) pair's row; then one kernel
   stores every token row, its k expert ids made local to the destination, its k weights, and this rank's counts,
   straight into the destinations' buffers (``dispatch``);
2. a device barrier (the handle's signal pads); the rows received from source s are the first ``counts[s]`` of
   its block, the others get expert id -1 (`fused_experts` skips them); this rank's experts run on the whole
   receive region;
3. one kernel stores each result row back at its source (``return``), a device barrier, and one kernel sums
   each token's returned rows in float32, in rank order (``combine``).

The backward is the same exchange with the output gradient going out (dispatch) and the input and routing-weight
gradients coming back (return, combine). Between two uses of the buffers no barrier is needed: a rank writes a
peer's receive regions only after the barrier that follows the peer's last read of them, and the same holds for
the return regions.

Capacity: a source sends a token at most once to a rank, so ``cap = max_tokens`` never overflows (the default).
A ``capacity_factor`` sizes ``cap`` to ``factor · max_tokens · min(k, W) / W`` instead; a pair past it is not
sent, its token's output (and gradients) are NaN, and the largest count is kept on the device for
`PeerBuffers.check_capacity`, which raises with the capacity that would have held it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from flashmoe_science.distributed.pair_plan import plan_pairs
from flashmoe_science.distributed.triton_exchange import DELTA_ALIGN, combine_launch, dispatch_launch, return_launch

ALIGN = 256  # bytes between regions: vector stores stay aligned whatever the widths
# a rank that never reaches a barrier (an error on one rank) stops the others with a device error instead of a hang;
# long enough for the other ranks' first-call kernel compilations between two barriers
BARRIER_TIMEOUT_MS = 300_000


def capacity(max_tokens: int, top_k: int, world_size: int, capacity_factor: float | None) -> int:
    """Rows per (source, destination): ``max_tokens`` (never overflows) or ``capacity_factor`` times the average
    a destination receives from a source (``max_tokens · min(k, W) / W``), at most ``max_tokens``, at least 1."""
    if capacity_factor is None:
        return max(1, max_tokens)
    expected = max_tokens * min(top_k, world_size) / world_size
    return max(1, min(max_tokens, math.ceil(capacity_factor * expected)))


def _regions(world_size: int, cap: int, width: int, top_k: int, dtype: torch.dtype):
    """(name, shape, dtype) of each region, in buffer order."""
    rows = world_size * cap
    return (("x_recv", (rows, width), dtype), ("ids_recv", (rows, top_k), torch.int32),
            ("weights_recv", (rows, top_k), torch.float32), ("counts_recv", (world_size,), torch.int32),
            ("y_back", (rows, width), dtype), ("dweights_back", (rows, top_k), torch.float32))


def _region_bytes(shape, dtype) -> int:
    return -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN


def buffer_bytes(world_size: int, cap: int, width: int, top_k: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's exchange buffer."""
    return sum(_region_bytes(shape, dt) for _, shape, dt in _regions(world_size, cap, width, top_k, dtype))


@dataclass
class PeerBuffers:
    """One rank's view of the exchange's symmetric buffer: its regions (views of this rank's copy), the byte
    distance to each peer's copy (``deltas``, on the device), and the device barrier over the group."""

    rank: int
    world_size: int
    capacity: int
    max_tokens: int
    x_recv: torch.Tensor  # (W·cap, d) rows received (forward: tokens; backward: output gradients)
    ids_recv: torch.Tensor  # (W·cap, k) int32 expert ids local to this rank, -1 for slots owned elsewhere
    weights_recv: torch.Tensor  # (W·cap, k) float32 routing weights
    counts_recv: torch.Tensor  # (W,) int32 rows each source sent (may exceed cap: then cap were stored)
    y_back: torch.Tensor  # (W·cap, d) rows returned (forward: expert outputs; backward: input gradients)
    dweights_back: torch.Tensor  # (W·cap, k) float32 routing-weight gradients returned
    deltas: torch.Tensor  # (W,) int64 bytes from this rank's buffer to each peer's
    most_sent: torch.Tensor  # (1,) int64: the largest count this rank sent to one rank since the buffers were made
    barrier: Callable[[], None]
    keep: object = None  # what must outlive the views (the symmetric-memory handle)

    def received(self):
        """The expert ids and weights of the received rows: -1 and 0 past each source's count."""
        rows = torch.arange(self.capacity, device=self.counts_recv.device)
        valid = (rows < self.counts_recv.view(-1, 1)).view(-1, 1)
        return torch.where(valid, self.ids_recv, -1), torch.where(valid, self.weights_recv, 0.0)

    def check_capacity(self) -> None:
        """Raise where a call since the buffers were made sent more rows to one rank than the capacity holds (a
        host read: call it outside the timed or captured region)."""
        most = int(self.most_sent.item())
        if most > self.capacity:
            raise RuntimeError(f"expert-parallel exchange overflow: rank {self.rank} sent {most} tokens to one rank, "
                               f"the capacity is {self.capacity} (their outputs are NaN); raise capacity_factor "
                               f"(None: {self.max_tokens}, never overflows)")


def carve(buffer: torch.Tensor, rank: int, world_size: int, cap: int, max_tokens: int, width: int, top_k: int,
          dtype: torch.dtype, deltas: torch.Tensor, barrier, keep=None) -> PeerBuffers:
    """The regions of a uint8 ``buffer`` of ``buffer_bytes`` as a PeerBuffers."""
    views, offset = {}, 0
    for name, shape, dt in _regions(world_size, cap, width, top_k, dtype):
        nbytes = math.prod(shape) * dt.itemsize
        views[name] = buffer[offset:offset + nbytes].view(dt).view(shape)
        offset += _region_bytes(shape, dt)
    most_sent = torch.zeros(1, dtype=torch.int64, device=buffer.device)
    return PeerBuffers(rank, world_size, cap, max_tokens, deltas=deltas, most_sent=most_sent, barrier=barrier,
                       keep=keep, **views)


def emulated_group(world_size: int, max_tokens: int, width: int, top_k: int, dtype: torch.dtype,
                   capacity_factor: float | None = None, device="cpu") -> list[PeerBuffers]:
    """W ranks' PeerBuffers in one process (plain tensors, barrier a no-op): run their steps in lockstep
    (`run_lockstep`) to check the exchange's index math and kernels without a group (on the CPU under
    TRITON_INTERPRET=1)."""
    cap = capacity(max_tokens, top_k, world_size, capacity_factor)
    nbytes = buffer_bytes(world_size, cap, width, top_k, dtype)
    allocations = [torch.zeros(nbytes + DELTA_ALIGN, dtype=torch.uint8, device=device) for _ in range(world_size)]
    buffers = [a[-a.data_ptr() % DELTA_ALIGN:][:nbytes] for a in allocations]  # aligned as the GPUs' mappings are
    ptrs = [b.data_ptr() for b in buffers]
    return [carve(b, r, world_size, cap, max_tokens, width, top_k, dtype, _deltas(ptrs, r, device), lambda: None,
                  allocations) for r, b in enumerate(buffers)]


def _deltas(ptrs: list[int], rank: int, device) -> torch.Tensor:
    """(W,) int64 bytes from this rank's buffer to each peer's (multiples of ``DELTA_ALIGN``, as the kernels
    assume)."""
    deltas = [p - ptrs[rank] for p in ptrs]
    if any(d % DELTA_ALIGN for d in deltas):
        raise RuntimeError(f"the exchange buffers' addresses differ by {deltas} bytes: the kernels need multiples "
                           f"of {DELTA_ALIGN}")
    return torch.tensor(deltas, dtype=torch.int64, device=device)


def symmetric_group(group, max_tokens: int, width: int, top_k: int, dtype: torch.dtype,
                    capacity_factor: float | None, device) -> PeerBuffers:
    """This rank's PeerBuffers over a symmetric-memory allocation (a collective: every rank of ``group`` calls it
    with the same arguments; ``max_tokens`` the largest over the ranks)."""
    import torch.distributed._symmetric_memory as symm_mem

    # the exchange uses peer mappings only: no NVLink multicast object (which hosts without it fail to create)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    group = group if group is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    cap = capacity(max_tokens, top_k, world_size, capacity_factor)
    buffer = symm_mem.empty(buffer_bytes(world_size, cap, width, top_k, dtype), dtype=torch.uint8, device=device)
    buffer.zero_()  # received rows past the counts are never read as data, but stay finite
    handle = symm_mem.rendezvous(buffer, group.group_name)
    # the handle's pointers are its allocations' starts; a tensor from the symmetric memory pool may start inside
    # its allocation, so each rank's offset travels too (one all-gather while the buffers are made)
    offsets = [None] * world_size
    dist.all_gather_object(offsets, buffer.data_ptr() - handle.buffer_ptrs[rank], group=group)
    deltas = _deltas([p + o for p, o in zip(handle.buffer_ptrs, offsets)], rank, device)

    def barrier():
        handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)

    barrier()  # the zero fill is done everywhere before any peer writes
    return carve(buffer, rank, world_size, cap, max_tokens, width, top_k, dtype, deltas, barrier, (handle, buffer))


_GROUPS: dict[tuple, PeerBuffers] = {}


def buffers_for(group, num_tokens: int, width: int, top_k: int, dtype: torch.dtype, device,
                capacity_factor: float | None, max_tokens: int | None) -> PeerBuffers:
    """The buffers of the calls with this group, width, k, dtype, device and capacity: made on the first call (a
    collective; with ``max_tokens`` None, sized by the most tokens any rank passes, agreed by one all-reduce) and
    again, larger, on a call with more tokens than they hold (every rank must then pass more: ranks whose counts
    outgrow the buffers at different calls must give ``max_tokens``)."""
    if max_tokens is not None and num_tokens > max_tokens:
        raise ValueError(f"x has {num_tokens} tokens, more than max_tokens ({max_tokens})")
    name = (group if group is not None else dist.group.WORLD).group_name
    key = (name, width, top_k, dtype, str(device), capacity_factor, max_tokens)
    found = _GROUPS.get(key)
    if found is not None and num_tokens <= found.max_tokens:
        return found
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the expert-parallel exchange's buffers are made by a collective, which a CUDA graph "
                           "cannot capture: run the layer once before capturing it")
    tokens = max_tokens
    if tokens is None:
        most = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        tokens = int(most.item())
    _GROUPS.pop(key, None)  # the smaller buffers are freed once no pending backward holds them
    _GROUPS[key] = symmetric_group(group, tokens, width, top_k, dtype, capacity_factor, device)
    return _GROUPS[key]


def check_exchange_capacity(group=None) -> None:
    """Raise where a call on ``group`` since its buffers were made sent more rows to a rank than they hold
    (`PeerBuffers.check_capacity`: one host read per buffer; outside the timed or captured region)."""
    name = (group if group is not None else dist.group.WORLD).group_name
    for key, buffers in _GROUPS.items():
        if key[0] == name:
            buffers.check_capacity()


# ------------------------------------------------------------------------------------------------ the steps
def plan_route(topk_ids: torch.Tensor, num_experts: int, world_size: int):
    """``(slots (T, W), send_counts (W, 1))`` of the pair plan in one chunk (device ops only)."""
    send_counts = torch.empty((world_size, 1), dtype=torch.int64, device=topk_ids.device)
    slots, _, _ = plan_pairs(topk_ids, num_experts, world_size, send_counts, lambda: None)
    return slots, send_counts


def _combined(buffers: PeerBuffers, back: torch.Tensor, route, num_tokens: int, dtype) -> torch.Tensor:
    slots, send_counts = route
    out = torch.empty((num_tokens, back.shape[1]), dtype=dtype, device=back.device)
    if num_tokens:
        combine_launch(back, out, slots, send_counts, buffers.capacity)()
    return out


def forward_steps(buffers: PeerBuffers, x, weights32, topk_ids, route, num_experts: int, experts):
    """The forward on one rank, as a generator that yields where the group's barrier goes and returns the output
    ``(T, d)``; ``experts(x_recv, ids, weights)`` runs this rank's experts on the receive region."""
    slots, send_counts = route
    torch.maximum(buffers.most_sent, send_counts.amax(), out=buffers.most_sent)
    meta = (topk_ids, weights32, buffers.ids_recv, buffers.weights_recv, buffers.counts_recv, num_experts)
    dispatch_launch(x, buffers.x_recv, slots, send_counts, buffers.deltas, buffers.rank, buffers.capacity, meta)()
    yield
    ids, weights = buffers.received()
    y = experts(buffers.x_recv, ids, weights)
    return_launch(y, buffers.y_back, buffers.counts_recv, buffers.deltas, buffers.rank, buffers.capacity)()
    yield
    return _combined(buffers, buffers.y_back, route, x.shape[0], x.dtype)


def backward_steps(buffers: PeerBuffers, grad_out, route, local_backward, need_dx: bool, need_dweights: bool):
    """The backward on one rank, as a generator like `forward_steps`; returns ``(dx, dweights32)`` (None where
    not needed). ``local_backward(grad_recv)`` returns the received rows' ``(dx, dweights)``."""
    slots, send_counts = route
    dispatch_launch(grad_out, buffers.x_recv, slots, send_counts, buffers.deltas, buffers.rank, buffers.capacity)()
    yield
    dx_recv, dweights_recv = local_backward(buffers.x_recv)
    for needed, rows, back in ((need_dx, dx_recv, buffers.y_back), (need_dweights, dweights_recv,
                                                                    buffers.dweights_back)):
        if needed:
            return_launch(rows.contiguous(), back, buffers.counts_recv, buffers.deltas, buffers.rank,
                          buffers.capacity)()
    yield
    num_tokens = grad_out.shape[0]
    dx = _combined(buffers, buffers.y_back, route, num_tokens, grad_out.dtype) if need_dx else None
    dweights = (_combined(buffers, buffers.dweights_back, route, num_tokens, torch.float32) if need_dweights
                else None)
    return dx, dweights


def run_steps(steps, barrier):
    """Run one rank's steps, the group's barrier at each yield; their result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        barrier()


def run_lockstep(all_steps: list) -> list:
    """Run every rank's steps of an emulated group, all ranks up to each barrier before any passes it."""
    results, pending = [None] * len(all_steps), list(enumerate(all_steps))
    while pending:
        waiting = []
        for rank, steps in pending:
            try:
                next(steps)
                waiting.append((rank, steps))
            except StopIteration as done:
                results[rank] = done.value
        if waiting and len(waiting) != len(pending):
            raise RuntimeError("the ranks' steps reached different numbers of barriers")
        pending = waiting
    return results


# ------------------------------------------------------------------------------------------------ autograd
class LocalExperts:
    """This rank's experts on the receive region, with the graph the backward differentiates (``needs``: which
    of x, topk_weights, w1, w2 need a gradient)."""

    def __init__(self, w1, w2, needs, backend: str):
        from flashmoe_science.moe.api import fused_experts

        self.fused_experts, self.backend, self.needs = fused_experts, backend, tuple(needs)
        # leaves of the local graph (detached views: no copy)
        self.w1 = w1.detach().requires_grad_(self.needs[2])
        self.w2 = w2.detach().requires_grad_(self.needs[3])
        self.graph = None
        self.dw1 = self.dw2 = None

    def forward(self, x_recv, ids, weights):
        """The experts' rows ``(W·cap, d)``; in training on a copy of the received rows (the backward's gradients
        arrive in their place)."""
        x_in = x_recv.clone() if any(self.needs) else x_recv
        with torch.enable_grad():
            x_in.requires_grad_(self.needs[0])
            weights.requires_grad_(self.needs[1])
            y = self.fused_experts(x_in, self.w1, self.w2, weights, ids, backend=self.backend)
        self.graph = (y, (x_in, weights, self.w1, self.w2))
        return y.detach()

    def backward(self, grad_recv):
        """``(dx, dweights)`` of the received rows (None where not needed); keeps ``dw1``/``dw2``."""
        y, leaves = self.graph
        wanted = [t for t, need in zip(leaves, self.needs) if need]
        # a rank that received no token has an output no input reaches: zero gradients
        grads = torch.autograd.grad(y, wanted, grad_recv, allow_unused=True) if y.requires_grad else [None] * len(
            wanted)
        grads = iter([torch.zeros_like(t) if g is None else g for t, g in zip(wanted, grads)])
        dx, dweights, self.dw1, self.dw2 = (next(grads) if need else None for need in self.needs)
        self.graph = None
        return dx, None if dweights is None else dweights.float()


class SymmExpertParallel(torch.autograd.Function):
    """`forward_steps` / `backward_steps` with the group's device barrier."""

    @staticmethod
    def forward(ctx, x, topk_weights, w1, w2, topk_ids, buffers: PeerBuffers, num_experts: int, backend: str,
                grad_enabled: bool):
        # (grad_enabled: whether autograd records the call; a parameter under no_grad needs no local graph)
        experts = LocalExperts(w1, w2, [need and grad_enabled for need in ctx.needs_input_grad[:4]], backend)
        route = plan_route(topk_ids, num_experts, buffers.world_size)
        steps = forward_steps(buffers, x.contiguous(), topk_weights.float().contiguous(), topk_ids, route,
                              num_experts, experts.forward)
        out = run_steps(steps, buffers.barrier)
        ctx.state = (buffers, route, experts, topk_weights.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        buffers, route, experts, weights_dtype = ctx.state
        need_dx, need_dweights = ctx.needs_input_grad[:2]
        grad_out = grad_out.to(buffers.x_recv.dtype).contiguous()  # it travels in the receive region
        steps = backward_steps(buffers, grad_out, route, experts.backward, need_dx, need_dweights)
        dx, dweights = run_steps(steps, buffers.barrier)
        ctx.state = None
        dweights = None if dweights is None else dweights.to(weights_dtype)
        return dx, dweights, experts.dw1, experts.dw2, None, None, None, None, None


@torch.compiler.disable  # device barriers and peer stores: eager kernels (a graph break under torch.compile)
def symmetric_expert_parallel(x, topk_weights, w1, w2, topk_ids, group, num_experts: int, backend: str,
                              capacity_factor: float | None, max_tokens: int | None):
    """`expert_parallel_experts` over this exchange, on checked arguments."""
    buffers = buffers_for(group, x.shape[0], x.shape[1], topk_ids.shape[1], x.dtype, x.device, capacity_factor,
                          max_tokens)
    return SymmExpertParallel.apply(x, topk_weights, w1, w2, topk_ids, buffers, num_experts, backend,
                                    torch.is_grad_enabled())
