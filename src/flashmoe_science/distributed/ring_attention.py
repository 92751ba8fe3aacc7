"""Context-parallel ring attention: a sequence (or packed sequences) sharded zig-zag over the ranks of a group.

Each rank holds its queries and its keys/values (two mirrored chunks, see `zigzag`). The forward starts with its
own shard, needing no transfer, while the other shards travel: by default (``kv_exchange="allgather"``) one
all-gather brings every shard at once, laid out so that what a query chunk sees whole is a few contiguous key
ranges (three kernel calls for zig-zag causal, whatever the ring's size) and no transfer competes with the later
kernels for SMs; with ``"ring"`` the shards pass around the ring (rank r sends to r + 1, receives from r - 1, into
two alternating buffers), the next in flight while the current one is computed on. Partial results are merged
into float32 accumulators by their log-sum-exp, in place:

    lse = log(exp(lse_a) + exp(lse_b)),    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

which is exact: softmax over the union of two key sets is this reweighting of the softmaxes over each.

The backward passes the K/V shards around the ring again (or, with ``grad_exchange="allgather"``, gathers them as the
forward does and reduce-scatters dK/dV at the end); each rank computes the gradient contributions of its
queries against the visiting shard with the single-GPU backward kernels, given the *global* out and lse (that is all
the FlashAttention backward needs: P = exp(S - lse), dS = P ∘ (dP - rowsum(dO ∘ O))). dQ stays local; the dK/dV
contributions (float32) follow their shard around the ring and, after one last hop, arrive at the shard's owner.

Masks (causal, sliding window) are stated on global positions. Between a chunk of queries and a chunk of keys the
visible part is a rectangle cropped to the band ``lo <= j - i <= hi``, which the local kernel expresses as a
bottom-right aligned window (`_visible_block`); pairs that see nothing are skipped, fully visible pairs of one ring
step are merged into one kernel call (`_plan_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashmoe_science.attention.api import (BACKENDS, attention_backward_lse, attention_forward_lse,
                                            flash_attention_science)
from flashmoe_science.attention.checks import check_backend, check_inputs
from flashmoe_science.attention.mask import make_mask
from flashmoe_science.attention.reference import default_softmax_scale
from flashmoe_science.distributed.comm import (Pending, all_gather_into, gather_ints, group_rank_and_size,
                                               reduce_scatter_into, ring_shift)
from flashmoe_science.distributed.zigzag import Chunk, _seqlens, sequence_shards, shard_lengths

_KV_TAG, _GRAD_TAG = 0, 1  # gloo matches point-to-point messages by tag; NCCL ignores tags


# ------------------------------------------------------------------------------------------------ planning
@dataclass(frozen=True)
class Block:
    """One local kernel call of a ring step: query rows and key rows (local indices) and the kernel's mask."""

    q_rows: slice
    k_rows: slice
    causal: bool
    window: tuple[int, int] | None


def _band(causal: bool, window: tuple[int, int] | None) -> tuple[float, float]:
    """The global mask as a band of key-minus-query offsets ``lo <= j - i <= hi`` (Lq == Lk: no diagonal shift)."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0  # flash-attn: causal clips the right side of a window to 0
    return (-left if left >= 0 else -math.inf), (right if right >= 0 else math.inf)


def _visible_block(q_chunk: Chunk, k_chunk: Chunk, lo: float, hi: float) -> Block | None:
    """The rectangle of a (query chunk, key chunk) pair that sees anything, as one kernel call, or None.

    Query row i (global) sees keys ``[i + lo, i + hi]``: rows ``[k_start - hi, k_stop - lo)`` see some key of the
    chunk, keys ``[q_start + lo, q_stop + hi)`` are seen by some row. On the cropped rectangle the kernel's window
    (aligned at ``diagonal = Lk - Lq``) is ``left = k_stop - q_stop - lo``, ``right = hi + q_stop - k_stop``, both
    >= 0 by construction of the crop; a side at least as wide as the rectangle is unbounded.
    """
    q_start = max(q_chunk.global_start, k_chunk.global_start - hi)
    q_stop = min(q_chunk.global_start + q_chunk.length, k_chunk.global_start + k_chunk.length - lo)
    k_start = max(k_chunk.global_start, q_chunk.global_start + lo)
    k_stop = min(k_chunk.global_start + k_chunk.length, q_chunk.global_start + q_chunk.length + hi)
    if q_start >= q_stop or k_start >= k_stop:
        return None
    q_start, q_stop, k_start, k_stop = int(q_start), int(q_stop), int(k_start), int(k_stop)
    left, right = k_stop - q_stop - lo, hi + q_stop - k_stop
    left = -1 if left >= k_stop - k_start - 1 else int(left)
    right = -1 if right >= q_stop - q_start - 1 else int(right)
    q_off, k_off = q_chunk.local_start - q_chunk.global_start, k_chunk.local_start - k_chunk.global_start
    rows, keys = slice(q_start + q_off, q_stop + q_off), slice(k_start + k_off, k_stop + k_off)
    if left == -1 and right == 0:
        return Block(rows, keys, True, None)
    return Block(rows, keys, False, None if (left, right) == (-1, -1) else (left, right))


def _whole(block: Block | None, q_chunk: Chunk, k_chunk: Chunk) -> bool:
    """The pair is fully visible: its block is the whole of both chunks with no mask."""
    return (block is not None and not block.causal and block.window is None
            and block.q_rows.stop - block.q_rows.start == q_chunk.length
            and block.k_rows.stop - block.k_rows.start == k_chunk.length)


def _plan_step(q_chunks, k_chunks, causal: bool, window, same_shard: bool) -> list[Block]:
    """The kernel calls of one ring step: the queries of this rank against one visiting K/V shard.

    Zig-zag causal steps collapse to one call each: the own shard is causal over the local order (local order is
    global order); an earlier shard is seen whole by both query chunks; a later shard whole by the second chunk.
    """
    # the rank's two chunks of one sequence are adjacent in its shard: their span
    q_span = slice(q_chunks[0].local_start, q_chunks[1].local_start + q_chunks[1].length)
    k_span = slice(k_chunks[0].local_start, k_chunks[1].local_start + k_chunks[1].length)
    if same_shard and window is None and causal:
        return [Block(q_span, k_span, True, None)]
    lo, hi = _band(causal, window)
    pairs = {(a, b): _visible_block(qc, kc, lo, hi) for a, qc in enumerate(q_chunks) for b, kc in enumerate(k_chunks)}
    whole = {key: _whole(block, q_chunks[key[0]], k_chunks[key[1]]) for key, block in pairs.items()}
    if all(whole.values()):
        return [Block(q_span, k_span, False, None)]
    blocks, used = [], set()
    for b, kc in enumerate(k_chunks):  # a key chunk every query sees: one call for both query chunks
        if whole[0, b] and whole[1, b]:
            blocks.append(Block(q_span, slice(kc.local_start, kc.local_start + kc.length), False, None))
            used |= {(0, b), (1, b)}
    for a, qc in enumerate(q_chunks):  # a query chunk that sees all keys: one call for both key chunks
        if whole[a, 0] and whole[a, 1] and not used & {(a, 0), (a, 1)}:
            blocks.append(Block(slice(qc.local_start, qc.local_start + qc.length), k_span, False, None))
            used |= {(a, 0), (a, 1)}
    blocks += [block for key, block in pairs.items() if block is not None and key not in used]
    return blocks


def _adjacent(a: slice, b: slice) -> bool:
    return a.stop == b.start


def coalesce(blocks: list[Block]) -> list[Block]:
    """Fewer kernel calls: unmasked blocks with the same query rows and adjacent key rows (or the same key rows and
    adjacent query rows) become one call. Masked blocks stay as they are (their window is aligned to their own
    rectangle)."""
    blocks = list(blocks)
    merged = True
    while merged:
        merged = False
        blocks.sort(key=lambda b: (b.causal or b.window is not None, b.q_rows.start, b.k_rows.start))
        for i, a in enumerate(blocks):
            for j in range(i + 1, len(blocks)):
                b = blocks[j]
                if a.causal or b.causal or a.window is not None or b.window is not None:
                    continue
                if a.q_rows == b.q_rows and (_adjacent(a.k_rows, b.k_rows) or _adjacent(b.k_rows, a.k_rows)):
                    keys = slice(min(a.k_rows.start, b.k_rows.start), max(a.k_rows.stop, b.k_rows.stop))
                    joined = Block(a.q_rows, keys, False, None)
                elif a.k_rows == b.k_rows and (_adjacent(a.q_rows, b.q_rows) or _adjacent(b.q_rows, a.q_rows)):
                    rows = slice(min(a.q_rows.start, b.q_rows.start), max(a.q_rows.stop, b.q_rows.stop))
                    joined = Block(rows, a.k_rows, False, None)
                else:
                    continue
                blocks[i] = joined
                del blocks[j]
                merged = True
                break
            if merged:
                break
    return blocks


# ------------------------------------------------------------------------------------------------ the ring
EXCHANGES = ("allgather", "ring")


@dataclass(frozen=True)
class _Ring:
    # The group as the caller passed it, None for the default group, never resolved to the default group's object:
    # an autograd graph still alive after destroy_process_group would otherwise keep that group alive until the
    # interpreter exits, and gloo's teardown there aborts the process ("terminate called without an active
    # exception", measured in 6 of 15 two-rank runs).
    group: object
    rank: int
    world_size: int
    seqlens: tuple[int, ...]  # global: one sequence, or the packed sequences of a varlen batch
    causal: bool
    window: tuple[int, int] | None
    softmax_scale: float
    backend: str  # the local kernels' (flash_attention_science's backend argument)
    exchange: str = "allgather"  # how the forward brings the other shards' K/V (EXCHANGES)
    grad_exchange: str = "ring"  # how the backward brings K/V and returns dK/dV (EXCHANGES)

    def chunks(self, rank: int) -> list[tuple[Chunk, Chunk]]:
        return sequence_shards(self.seqlens, self.world_size, rank)

    def length(self, rank: int) -> int:
        return sum(c.length for pair in self.chunks(rank) for c in pair)

    def peer(self, offset: int) -> int:
        """The global rank of the group member ``offset`` steps along the ring."""
        member = (self.rank + offset) % self.world_size
        return member if self.group is None else dist.get_global_rank(self.group, member)

    def source(self, step: int) -> int:
        """Whose K/V shard this rank holds at ring step ``step``."""
        return (self.rank - step) % self.world_size

    def plan(self, step: int) -> list[Block]:
        """The kernel calls of ring step ``step``, key rows local to the visiting shard."""
        source = self.source(step)
        return [block for mine, theirs in zip(self.chunks(self.rank), self.chunks(source))
                for block in _plan_step(mine, theirs, self.causal, self.window, source == self.rank)]

    def shift(self, sends, recvs, tag: int):
        """Start sending ``sends`` to the next rank and receiving ``recvs`` from the previous one."""
        return ring_shift(sends, recvs, self.peer(1), self.peer(-1), self.group, tag)

    # the all-gather layout ------------------------------------------------------------------------------------
    def pieces(self, rank: int) -> list[tuple[int, int]]:
        """The local row ranges of ``rank``'s shard that are gathered into separate regions. One sequence: its
        second chunk, then its first: in the region of second chunks (rank order: chunks 2W-1 .. W) followed by the
        region of first chunks (chunks 0 .. W-1), the keys a query chunk sees whole form few contiguous ranges (see
        `gathered_blocks`). Several packed sequences: the whole shard, one region."""
        if len(self.seqlens) != 1:
            return [(0, self.length(rank))]
        first, second = self.chunks(rank)[0]
        return [(second.local_start, second.local_start + second.length), (0, first.length)]

    def region_sizes(self) -> list[int]:
        """Per region, the rows each rank's slot holds (the longest piece of any rank; shorter ones are padded)."""
        return [max(stop - start for start, stop in (self.pieces(r)[p] for r in range(self.world_size)))
                for p in range(len(self.pieces(0)))]

    def gathered_rows(self, source: int, rows: slice) -> list[tuple[slice, slice]]:
        """``rows`` of ``source``'s shard as (local rows, rows of the gathered buffer), one per piece it touches."""
        out, offset = [], 0
        for (start, stop), size in zip(self.pieces(source), self.region_sizes()):
            lo, hi = max(rows.start, start), min(rows.stop, stop)
            if lo < hi:
                base = offset + source * size - start
                out.append((slice(lo, hi), slice(lo + base, hi + base)))
            offset += self.world_size * size
        return out

    def gathered_blocks(self) -> list[Block]:
        """The forward's kernel calls on the other ranks' gathered K/V (key rows of the gathered buffer), merged
        where they meet. Zig-zag causal over one sequence of 2W equal chunks: rank r's two query chunks see first
        chunks 0 .. r-1 (one range), its second query chunk also the second chunks of ranks r+1 .. W-1 and the first
        chunks of ranks r+1 .. W-1 (two ranges): three calls, whatever W."""
        blocks = []
        for step in range(1, self.world_size):
            source = self.source(step)
            for block in self.plan(step):
                parts = self.gathered_rows(source, block.k_rows)
                if len(parts) > 1 and (block.causal or block.window is not None):
                    raise AssertionError("a masked block spans two gathered pieces")  # _visible_block: one chunk
                blocks += [Block(block.q_rows, keys, block.causal, block.window) for _, keys in parts]
        return coalesce(blocks)

    def gather(self, kv: list[torch.Tensor]) -> Pending:
        """Start gathering every rank's ``kv`` (K and V, ``(..., L_local, D)``) into ``(2, rows, ..., D)``: one
        all-gather per region and tensor, rows of a region in rank order, sequence-major (a key range is a view)."""
        sizes, sends, recvs = self.region_sizes(), [], []
        lead, head_dim = kv[0].shape[:-2], kv[0].shape[-1]
        total = self.world_size * sum(sizes)
        gathered = kv[0].new_empty((2, total, *lead, head_dim))
        offset = 0
        for (start, stop), size in zip(self.pieces(self.rank), sizes):
            for i, t in enumerate(kv):
                send = t.new_zeros((size, *lead, head_dim))
                send[:stop - start].copy_(t[..., start:stop, :].movedim(-2, 0))
                sends.append(send)
                recvs.append(gathered[i, offset:offset + self.world_size * size])
            offset += self.world_size * size
        pending = all_gather_into(sends, recvs, self.group)
        pending.gathered = gathered
        return pending


def _merge_into(out_acc, lse_acc, rows: slice, out, lse) -> None:
    """Merge a partial (out, lse) for query rows ``rows`` into the float32 accumulators, in place: two passes over
    the output rows (scale, then multiply-add) and a few over the row statistics. Rows that have seen no key on
    either side stay out 0, lse -inf (the shift clamps -inf so exp gives 0, never nan)."""
    acc_out, acc_lse = out_acc[..., rows, :], lse_acc[..., rows]
    merged = torch.logaddexp(acc_lse, lse)
    shift = merged.clamp_min(torch.finfo(torch.float32).min)
    acc_out.mul_(torch.exp(acc_lse - shift).unsqueeze(-1)).addcmul_(out, torch.exp(lse - shift).unsqueeze(-1))
    acc_lse.copy_(merged)


class _Accumulator:
    """The float32 out and lse of this rank's queries over the key blocks seen so far. The first partial that covers
    every row initialises them (a copy, no merge)."""

    def __init__(self, q):
        self.q, self.out, self.lse = q, None, None

    def add(self, rows: slice, out, lse) -> None:
        lse = lse.float()
        if self.out is None and rows.start == 0 and rows.stop == self.q.shape[-2]:
            self.out, self.lse = out.float(), lse.clone()
            return
        if self.out is None:
            self.out = torch.zeros(self.q.shape, dtype=torch.float32, device=self.q.device)
            self.lse = torch.full(self.q.shape[:-1], -math.inf, dtype=torch.float32, device=self.q.device)
        _merge_into(self.out, self.lse, rows, out, lse)

    def result(self):
        if self.out is None:  # no block at all (e.g. a window that sees no other shard): zeros, lse -inf
            self.out = torch.zeros(self.q.shape, dtype=torch.float32, device=self.q.device)
            self.lse = torch.full(self.q.shape[:-1], -math.inf, dtype=torch.float32, device=self.q.device)
        return self.out.to(self.q.dtype), self.lse


def _attend(ring: _Ring, acc: _Accumulator, q, k, v, block: Block) -> None:
    out, lse = attention_forward_lse(q[..., block.q_rows, :], k[..., block.k_rows, :], v[..., block.k_rows, :],
                                     causal=block.causal, softmax_scale=ring.softmax_scale, window=block.window,
                                     backend=ring.backend)
    acc.add(block.q_rows, out, lse)


def _shard_buffers(ring: _Ring, kv: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Two sets of K/V receive buffers (double buffering), each big enough for the longest shard."""
    longest = max(ring.length(r) for r in range(ring.world_size))
    return [[t.new_empty((*t.shape[:-2], longest, t.shape[-1])) for t in kv] for _ in range(2)]


def _shard_views(ring: _Ring, buffers: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """The contiguous views of ``buffers`` that hold the shard visiting at ``step``."""
    length = ring.length(ring.source(step))
    return [b.view(-1)[:b[..., :length, :].numel()].view(*b.shape[:-2], length, b.shape[-1]) for b in buffers]


def _ring_forward(ring: _Ring, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward: the own shard first, while the other shards travel (all-gathered at once, or around the ring
    with the next shard in flight during each step)."""
    kv = [k.contiguous(), v.contiguous()]
    acc = _Accumulator(q)
    if ring.exchange == "allgather":
        arriving = ring.gather(kv)
        for block in ring.plan(0):
            _attend(ring, acc, q, kv[0], kv[1], block)
        arriving.wait()
        keys, values = (arriving.gathered[i].movedim(0, -2) for i in range(2))
        for block in ring.gathered_blocks():
            _attend(ring, acc, q, keys, values, block)
        return acc.result()
    buffers = _shard_buffers(ring, kv)
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        if not last:  # the next shard travels while this one is computed on
            arriving = ring.shift(kv, _shard_views(ring, buffers[step % 2], step + 1), _KV_TAG)
        for block in ring.plan(step):
            _attend(ring, acc, q, kv[0], kv[1], block)
        if not last:
            kv = arriving.wait()
    return acc.result()


def _backward_block(ring: _Ring, q, kv, out, lse, grad_out, block: Block, dq, dkv) -> None:
    """One kernel call's gradient contributions, added into the float32 ``dq`` and ``dkv`` (rows of ``kv``)."""
    rows, keys = block.q_rows, block.k_rows
    dq_b, dk_b, dv_b = attention_backward_lse(
        q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :], out[..., rows, :], lse[..., rows],
        grad_out[..., rows, :], causal=block.causal, softmax_scale=ring.softmax_scale, window=block.window,
        backend=ring.backend)
    dq[..., rows, :] += dq_b
    dkv[0][..., keys, :] += dk_b
    dkv[1][..., keys, :] += dv_b


def _ring_backward(ring: _Ring, q, k, v, out, lse, grad_out):
    if ring.grad_exchange == "allgather":
        return _gathered_backward(ring, q, k, v, out, lse, grad_out)
    kv = [k.contiguous(), v.contiguous()]
    buffers = _shard_buffers(ring, kv)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    incoming = None  # the dK/dV sums arriving from the previous rank
    for step in range(ring.world_size):
        last = step == ring.world_size - 1
        if not last:
            arriving = ring.shift(kv, _shard_views(ring, buffers[step % 2], step + 1), _KV_TAG)
        # this step's shard's contributions (float32); what earlier ranks added for the same shard is added on
        dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
        for block in ring.plan(step):
            _backward_block(ring, q, kv, out, lse, grad_out, block, dq, dkv)
        if incoming is not None:
            for total, earlier in zip(dkv, incoming.wait()):
                total += earlier
        # after the last step this hop brings each shard's sum home: the shard of rank r - 1 - (W - 1) = r
        home = [t.new_empty((*t.shape[:-2], ring.length(ring.source(step + 1)), t.shape[-1])) for t in dkv]
        incoming = ring.shift(dkv, home, _GRAD_TAG)
        if not last:
            kv = arriving.wait()
    dk, dv = incoming.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gathered_backward(ring: _Ring, q, k, v, out, lse, grad_out):
    """The backward in the forward's all-gather layout: every shard's K/V gathered once while the own shard's blocks
    run, the other shards' dK/dV accumulated in float32 in the gathered layout over the same few calls as the
    forward's, then one reduce-scatter per region and tensor sums each shard's gradient on its owner. After the
    gather no transfer runs beside the kernels; the reduce-scatter (float32, the whole sequence's dK/dV) runs after
    them. Memory: the whole sequence's K/V and its float32 dK/dV."""
    kv = [k.contiguous(), v.contiguous()]
    arriving = ring.gather(kv)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
    for block in ring.plan(0):
        _backward_block(ring, q, kv, out, lse, grad_out, block, dq, dkv)
    arriving.wait()
    gathered = arriving.gathered  # (2, rows, ..., D), regions of W slots
    dgathered = torch.zeros(gathered.shape, dtype=torch.float32, device=gathered.device)
    keys = [gathered[i].movedim(0, -2) for i in range(2)]
    dkeys = [dgathered[i].movedim(0, -2) for i in range(2)]
    for block in ring.gathered_blocks():
        _backward_block(ring, q, keys, out, lse, grad_out, block, dq, dkeys)
    pending, homes, offset = [], [], 0
    for (start, stop), size in zip(ring.pieces(ring.rank), ring.region_sizes()):
        for i in range(2):
            home = dgathered.new_empty((size, *dgathered.shape[2:]))
            pending.append(reduce_scatter_into(dgathered[i, offset:offset + ring.world_size * size], home, ring.group))
            homes.append((i, start, stop, home))
        offset += ring.world_size * size
    for work in pending:
        work.wait()
    for i, start, stop, home in homes:  # this rank's slot: its piece's rows, then padding
        dkv[i][..., start:stop, :] += home[:stop - start].movedim(0, -2)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        out, lse = _ring_forward(ring, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out.stride(-1) != 1:  # e.g. the stride-0 gradient of out.sum(): the kernels need unit last stride
            grad_out = grad_out.contiguous()
        dq, dk, dv = _ring_backward(ctx.ring, q, k, v, out, lse, grad_out)
        ctx.ring = None  # spent: the graph no longer refers to the group
        return dq, dk, dv, None


# ------------------------------------------------------------------------------------------------ front door
def _check_window(causal, window) -> tuple[int, int] | None:
    """The window as the single-GPU front door checks it (attention.mask.make_mask), None when unbounded."""
    mask = make_mask(causal, window)
    left, right = mask.window_left, -1 if causal else mask.window_right
    return None if (left, right) == (-1, -1) else (left, right)


def _check_local(q, k, v, softmax_scale, backend) -> None:
    """A rank's shards as the single-GPU front door checks them (attention.checks), then what the ring adds: 3-D or
    4-D shards of one sequence (q and k hold the same positions)."""
    check_inputs(q, k, v, softmax_scale)
    check_backend(backend, BACKENDS)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be (B, H, L, D) or (H, L, D), got shape {tuple(q.shape)}")
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"ring_attention is self-attention over one sharded sequence: q and k must hold the same "
                         f"positions, got local lengths {q.shape[-2]} and {k.shape[-2]}")


def _check_ranks(q, k, group, world_size: int, causal: bool, window, seqlens: list[int] | None) -> list[int]:
    """Every rank's shapes, mask and batch agree and the local lengths form a zig-zag split; returns the global
    sequence lengths (``seqlens``, or the one sequence of all ranks' tokens). One small all-gather, so every rank
    raises the same error instead of hanging in the ring."""
    left, right = window if window is not None else (-1, -1)
    batch = [-1, -1] if seqlens is None else [len(seqlens), sum(i * n for i, n in enumerate(seqlens, 1)) % 2**31]
    mine = [q.dim(), *q.shape[:-2], k.shape[-3], q.shape[-1], int(causal), left, right, *batch, q.shape[-2]]
    everyone = gather_ints(mine, group, q.device)
    if not bool((everyone[:, :-1] == everyone[0, :-1]).all()):
        raise ValueError("ring_attention: the ranks disagree on shapes, mask or cu_seqlens (per rank: [dims, "
                         f"batch.., Hq, Hkv, D, causal, left, right, sequences, checksum, L] = {everyone.tolist()})")
    lengths = everyone[:, -1].tolist()
    seqlens = [sum(lengths)] if seqlens is None else seqlens
    if lengths != shard_lengths(seqlens, world_size):
        raise ValueError(f"ring_attention: local lengths {lengths} are not the zig-zag split of sequences "
                         f"{seqlens} over {world_size} ranks (expected {shard_lengths(seqlens, world_size)}); shard "
                         "the inputs with zigzag_shard")
    return seqlens


def _ring(q, k, v, group, causal, softmax_scale, window, backend, kv_exchange, grad_exchange, seqlens=None):
    """The checks and the ring of `ring_attention` / `ring_attention_varlen` on ``(..., H, L, D)`` views; returns
    (out, lse), or None for a group of one rank (the caller runs its single-GPU function)."""
    _check_local(q, k, v, softmax_scale, backend)
    window = _check_window(causal, window)
    for name, value in (("kv_exchange", kv_exchange), ("grad_exchange", grad_exchange)):
        if value not in EXCHANGES:
            raise ValueError(f"{name} must be one of {EXCHANGES}, got {value!r}")
    rank, world_size = group_rank_and_size(group)
    if world_size == 1:
        return None
    seqlens = _check_ranks(q, k, group, world_size, causal, window, seqlens)
    scale = float(softmax_scale) if softmax_scale is not None else default_softmax_scale(q.shape[-1])
    ring = _Ring(group, rank, world_size, tuple(seqlens), causal, window, scale, backend, kv_exchange, grad_exchange)
    return _RingAttention.apply(q, k, v, ring)


def ring_attention(q, k, v, group=None, *, causal: bool = False, softmax_scale: float | None = None,
                   window: tuple[int, int] | None = None, return_lse: bool = False, backend: str = "auto",
                   kv_exchange: str = "allgather", grad_exchange: str = "ring"):
    """Exact attention over a sequence sharded zig-zag over the ranks of ``group`` (None: the default group).

    Args:
        q, k, v: this rank's shard, ``(B, H, L_local, D)`` or ``(H, L_local, D)``, as produced by `zigzag_shard` from
            the full ``(..., L, D)`` tensors (any strides the local kernel accepts; GQA: ``Hq % Hkv == 0``). Every
            rank passes the same shapes except L_local, which must be its zig-zag share of the global length.
        causal: the causal mask on global positions (what single-GPU attention over the unsharded sequence does).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        window: ``(left, right)`` sliding window on global positions, flash-attn semantics (-1 = unbounded; with
            ``causal`` the right side is 0).
        return_lse: also return the float32 log-sum-exp ``(..., H, L_local)`` of this rank's queries.
        backend: the local kernels, as `flash_attention_science`'s ``backend`` ("auto": the best for the device).
        kv_exchange: how the forward brings the other ranks' K/V. "allgather": one all-gather of every shard,
            in flight while the own shard's block runs, then a few calls over contiguous key ranges of the gathered
            buffer (memory: the whole sequence's K/V during the forward); no transfer overlaps the later kernels.
            "ring": each shard in turn around the ring, the next in flight while the current one is computed on
            (memory: two shards).
        grad_exchange: how the backward brings K/V and returns the float32 dK/dV. "ring" (default): K/V and the
            dK/dV sums pass around the ring, each hop beside a step's kernels (memory: two shards). "allgather": K/V
            all-gathered during the own shard's blocks, the forward's few calls over the gathered buffer, then one
            reduce-scatter of the float32 dK/dV (memory: the whole sequence's K/V and its float32 dK/dV).

    Returns ``out`` (q's shape and dtype; differentiable with respect to q, k and v), or ``(out, lse)``. The result is
    that of `flash_attention_science` on the unsharded sequence, sharded the same way; partial results are merged in
    float32 (each partial rounded once to q's dtype). A group of one rank runs the local kernel directly.
    """
    result = _ring(q, k, v, group, causal, softmax_scale, window, backend, kv_exchange, grad_exchange)
    if result is None:
        return flash_attention_science(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                       return_lse=return_lse, backend=backend)
    return result if return_lse else result[0]


def ring_attention_varlen(q, k, v, cu_seqlens, group=None, *, causal: bool = False,
                          softmax_scale: float | None = None, window: tuple[int, int] | None = None,
                          return_lse: bool = False, backend: str = "auto", kv_exchange: str = "allgather",
                          grad_exchange: str = "ring"):
    """`ring_attention` over a batch of packed sequences of different lengths, each sharded zig-zag on its own.

    Args:
        q, k, v: this rank's packed shard ``(total_local, H, D)``: `zigzag_shard(x, dim=0, cu_seqlens=cu_seqlens)`
            of the full packed ``(total, H, D)`` (each sequence's two chunks, sequence after sequence).
        cu_seqlens: the *global* cumulative lengths ``(batch + 1,)`` (a list, or an integer tensor: one host copy),
            the same on every rank. Masks apply per sequence, on its own positions.
        the rest: as `ring_attention`.

    Returns ``out`` ``(total_local, H, D)``, or ``(out, lse)`` with lse float32 ``(H, total_local)`` (the layout of
    `flash_attention_varlen`). Each step runs the local kernel once per sequence and block: meant for a few long
    sequences; many short ones fit one GPU each (`flash_attention_varlen`).
    """
    seqlens = _seqlens(cu_seqlens)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a packed (total, H, D) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    result = _ring(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), group, causal, softmax_scale, window,
                   backend, kv_exchange, grad_exchange, seqlens)
    if result is None:
        from flashmoe_science.attention.varlen import flash_attention_varlen

        bounds = torch.tensor([0] + [sum(seqlens[:i + 1]) for i in range(len(seqlens))], dtype=torch.int32,
                              device=q.device)
        longest = max(seqlens, default=0)
        return flash_attention_varlen(q, k, v, bounds, bounds, longest, longest, causal=causal,
                                      softmax_scale=softmax_scale, window=window, return_lse=return_lse,
                                      backend=backend)
    out, lse = result
    return (out.transpose(0, 1), lse) if return_lse else out.transpose(0, 1)
