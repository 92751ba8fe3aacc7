"""The symmetric-memory exchange's kernels: token rows stored straight into the peers' receive buffers, results
stored straight back, and each token's results summed.

Every rank holds the same symmetric buffers (``symm_exchange.PeerBuffers``); a peer's copy of a buffer lies at a
fixed byte distance from this rank's (``deltas[p]``, from the handle's buffer pointers), so a kernel reaches peer
p's row r of a region as ``region_ptr + deltas[p] / element_size + r * width``: no pointer table per region.
Rows from source s land at rows ``[s·cap, (s + 1)·cap)`` of the destination's region, in token order: the
position of token t among the tokens of its source that visit destination w is ``pos(t, w) = slots[t, w] -
offsets[w]`` (the pair plan's row, less the rows sent to the destinations before w). Positions at or past the
capacity are not stored: the source's ``combine`` turns the tokens that lost a row into NaN rows (never a silent
zero) and the counts sent tell how many rows were wanted.

- ``_dispatch_kernel`` (one program per block of tokens and columns): reads each token's row once and stores it
  to every destination it visits; with ``META`` also its k expert ids made local to the destination (-1 where
  another rank owns the slot), its k routing weights, and (program 0) this rank's count at ``counts[rank]`` of
  every peer.
- ``_return_kernel`` (one program per block of received rows and columns): row ``s·cap + i`` (``i`` below the
  count received from s) goes back to row ``rank·cap + i`` of source s's return region.
- ``_combine_kernel`` (one program per block of tokens and columns): each token's float32 sum, in rank order, of
  the rows the ranks it visited returned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashmoe_science.distributed.triton_plan import _column
from flashmoe_science.moe.launch import Launch

BLOCK_ROWS = 16  # rows per program: a (16, 256) bf16 tile is 8 KB in flight per store
# The byte distances between the ranks' buffers are multiples of this (symmetric-memory mappings are granularity
# aligned; `symm_exchange` checks it): 16 elements of any dtype up to 8 bytes and more, which the kernels tell the
# compiler so that stores to a peer vectorise as local ones do.
DELTA_ALIGN = 1024


@triton.jit
def _offsets(send_counts_ptr, dests, WORLD: tl.constexpr):
    """Each destination's first row in the pair plan's order: the rows sent to the destinations before it."""
    counts = tl.load(send_counts_ptr + dests, mask=dests < WORLD, other=0)
    return tl.cumsum(counts, axis=0) - counts


@triton.jit
def _pick(values, dests, w):
    """``values[w]`` of a per-destination vector."""
    return tl.sum(tl.where(dests == w, values, 0), axis=0)


@triton.jit
def _dispatch_kernel(
    rows_ptr,  # (T, D) the payload
    recv_ptr,  # (W·cap, D) this rank's copy of the receive region
    slots_ptr,  # (T, W) int64
    send_counts_ptr,  # (W,) int64
    deltas_ptr,  # (W,) int64 bytes from this rank's buffer to each peer's
    ids_ptr,  # (T, TOP_K) int expert ids (META)
    weights_ptr,  # (T, TOP_K) float32 (META)
    ids_recv_ptr,  # (W·cap, TOP_K) int32 (META)
    weights_recv_ptr,  # (W·cap, TOP_K) float32 (META)
    counts_recv_ptr,  # (W,) int32 (META)
    num_tokens,
    width,
    rank,
    cap,
    num_experts,
    base,
    extra,
    stride_t,
    stride_k,
    WORLD: tl.constexpr,
    W_POW2: tl.constexpr,
    TOP_K: tl.constexpr,
    ELEM: tl.constexpr,  # bytes per payload element
    META: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_t, pid_d = tl.program_id(0), tl.program_id(1)
    tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = tokens < num_tokens
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    in_cols = cols < width
    rows = tl.load(rows_ptr + tokens.to(tl.int64)[:, None] * width + cols[None, :],
                   mask=valid[:, None] & in_cols[None, :])
    dests = tl.arange(0, W_POW2)
    offsets = _offsets(send_counts_ptr, dests, WORLD)
    deltas = tl.load(deltas_ptr + dests, mask=dests < WORLD, other=0)
    for w in tl.static_range(WORLD):
        slot = tl.load(slots_ptr + tokens.to(tl.int64) * WORLD + w, mask=valid, other=-1)
        pos = slot - _pick(offsets, dests, w)
        sent = valid & (slot >= 0) & (pos < cap)
        row = rank * cap + pos  # int64
        delta = _pick(deltas, dests, w)
        shift = tl.multiple_of(delta // ELEM, 16)  # DELTA_ALIGN: peer rows stay as aligned as this rank's
        tl.store(recv_ptr + shift + row[:, None] * width + cols[None, :], rows,
                 mask=sent[:, None] & in_cols[None, :])
        if META:
            if pid_d == 0:  # the routing goes once per token, with its first block of columns
                for k in tl.static_range(TOP_K):
                    owner, local = _column(ids_ptr, tokens, valid, k, stride_t, stride_k, num_experts, base, extra)
                    weight = tl.load(weights_ptr + tokens.to(tl.int64) * TOP_K + k, mask=valid, other=0.0)
                    at = delta // 4 + row * TOP_K + k
                    tl.store(ids_recv_ptr + at, tl.where(owner == w, local, -1), mask=sent)
                    tl.store(weights_recv_ptr + at, weight, mask=sent)
    if META:
        if pid_t + pid_d == 0:
            counts = tl.load(send_counts_ptr + dests, mask=dests < WORLD, other=0).to(tl.int32)
            tl.store(counts_recv_ptr + deltas // 4 + rank, counts, mask=dests < WORLD)


@triton.jit
def _return_kernel(
    rows_ptr,  # (W·cap, D) this rank's results for the rows it received
    back_ptr,  # (W·cap, D) this rank's copy of the return region
    counts_recv_ptr,  # (W,) int32 rows received from each source
    deltas_ptr,
    width,
    rank,
    cap,
    WORLD: tl.constexpr,
    ELEM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_r, pid_d = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    valid = rows < WORLD * cap
    source = tl.where(valid, rows // cap, 0)
    index = rows - source * cap
    received = tl.load(counts_recv_ptr + source, mask=valid, other=0)
    back = valid & (index < received)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = back[:, None] & (cols < width)[None, :]
    values = tl.load(rows_ptr + rows[:, None] * width + cols[None, :], mask=mask)
    shift = tl.multiple_of(tl.load(deltas_ptr + source, mask=valid, other=0) // ELEM, [16])  # DELTA_ALIGN
    tl.store(back_ptr + (shift + (rank * cap + index) * width)[:, None] + cols[None, :], values, mask=mask)


@triton.jit
def _combine_kernel(
    back_ptr,  # (W·cap, D) the rows returned to this rank, source-major
    out_ptr,  # (T, D)
    slots_ptr,
    send_counts_ptr,
    num_tokens,
    width,
    cap,
    WORLD: tl.constexpr,
    W_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,  # float32, or float64 for float64 rows
):
    pid_t, pid_d = tl.program_id(0), tl.program_id(1)
    tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = tokens < num_tokens
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    in_cols = cols < width
    dests = tl.arange(0, W_POW2)
    offsets = _offsets(send_counts_ptr, dests, WORLD)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
    lost = tl.zeros([BLOCK_T], dtype=tl.int32)
    for w in tl.static_range(WORLD):
        slot = tl.load(slots_ptr + tokens.to(tl.int64) * WORLD + w, mask=valid, other=-1)
        pos = slot - _pick(offsets, dests, w)
        got = valid & (slot >= 0) & (pos < cap)
        lost = tl.maximum(lost, (valid & (slot >= 0) & (pos >= cap)).to(tl.int32))
        row = w * cap + pos
        acc += tl.load(back_ptr + row[:, None] * width + cols[None, :], mask=got[:, None] & in_cols[None, :],
                       other=0.0).to(ACC)
    acc = tl.where(lost[:, None] > 0, float("nan"), acc)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * width + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & in_cols[None, :])


def _block_d(width: int) -> int:
    return min(256, triton.next_power_of_2(max(width, 1)))


def dispatch_launch(rows: torch.Tensor, recv: torch.Tensor, slots: torch.Tensor, send_counts: torch.Tensor,
                    deltas: torch.Tensor, rank: int, cap: int, meta=None) -> Launch:
    """Store each row of ``rows`` (T, D) at ``pos(t, w)`` of ``recv`` on every destination w it visits. ``meta``:
    ``(topk_ids, weights32, ids_recv, weights_recv, counts_recv, num_experts)`` to send the routing along (and the
    counts; at least one program runs so that a rank without tokens still sends its zero counts)."""
    num_tokens, width = rows.shape
    world_size = slots.shape[1]
    has_meta = meta is not None
    if has_meta:
        topk_ids, weights32, ids_recv, weights_recv, counts_recv, num_experts = meta
    else:  # unread: the META branches are compiled out
        topk_ids, weights32, ids_recv, weights_recv, counts_recv, num_experts = (slots, slots, slots, slots,
                                                                                 slots, world_size)
    top_k = topk_ids.shape[1] if has_meta else 1
    base, extra = divmod(num_experts, world_size)
    block_d = _block_d(width)
    grid = (max(1, triton.cdiv(num_tokens, BLOCK_ROWS)), triton.cdiv(width, block_d))
    return Launch(_dispatch_kernel, grid,
                  (rows, recv, slots, send_counts, deltas, topk_ids, weights32, ids_recv, weights_recv, counts_recv,
                   num_tokens, width, rank, cap, num_experts, base, extra, topk_ids.stride(0), topk_ids.stride(1)),
                  dict(WORLD=world_size, W_POW2=triton.next_power_of_2(world_size), TOP_K=top_k,
                       ELEM=rows.element_size(), META=has_meta, BLOCK_T=BLOCK_ROWS, BLOCK_D=block_d, num_warps=4))


def return_launch(rows: torch.Tensor, back: torch.Tensor, counts_recv: torch.Tensor, deltas: torch.Tensor, rank: int,
                  cap: int) -> Launch:
    """Send row ``s·cap + i`` of ``rows`` (W·cap, D; i below the count received from s) to row ``rank·cap + i`` of
    source s's ``back``."""
    total, width = rows.shape
    block_d = _block_d(width)
    grid = (triton.cdiv(total, BLOCK_ROWS), triton.cdiv(width, block_d))
    return Launch(_return_kernel, grid, (rows, back, counts_recv, deltas, width, rank, cap),
                  dict(WORLD=deltas.shape[0], ELEM=rows.element_size(), BLOCK_R=BLOCK_ROWS, BLOCK_D=block_d,
                       num_warps=4))


def combine_launch(back: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, send_counts: torch.Tensor,
                   cap: int) -> Launch:
    """``out[t]`` = the float32 (float64) sum over the ranks t visited of the row each returned to ``back`` (NaN where t lost
    its row to the capacity)."""
    num_tokens, width = out.shape
    world_size = slots.shape[1]
    block_d = _block_d(width)
    grid = (triton.cdiv(num_tokens, BLOCK_ROWS), triton.cdiv(width, block_d))
    return Launch(_combine_kernel, grid, (back, out, slots, send_counts, num_tokens, width, cap),
                  dict(WORLD=world_size, W_POW2=triton.next_power_of_2(world_size), BLOCK_T=BLOCK_ROWS,
                       BLOCK_D=block_d, ACC=tl.float64 if out.dtype == torch.float64 else tl.float32, num_warps=4))
