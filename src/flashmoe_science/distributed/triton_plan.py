"""The expert-parallel exchange plan in two Triton launches, with the results of ``pair_plan.plan_pairs_reference``.

A token t visits destination rank w when one of its top-k experts lives on w. The tokens are cut into ``chunks``
consecutive pieces (chunk c holds tokens ``[c·T // n, (c + 1)·T // n)``) and every visiting (token, destination)
pair is sent in (chunk, destination, token) order, so the row (slot) of pair (t, w) in chunk c is

    slot(t, w) = offsets[c, w] + (visits of w among the tokens of chunk c before t)

with ``offsets`` the exclusive prefix over (chunk, destination) of the send counts. Prefix sums, no sort:

- ``_counts_kernel``, one program per (destination, chunk): walks the chunk's tokens in steps of ``STEP_TOKENS``,
  summing the visits of its destination per block of ``block`` tokens; stores the count before every block
  (``block_base``) and the chunk's send count. A program owns a whole (destination, chunk), so the counts need no
  atomics and no zeroed buffer; at 16k tokens of top-8, 2 ranks and 2 chunks, each reads 512 KB of ids.
- ``_pairs_kernel``, one program per block of a chunk, launched while the counts travel: the visits of its tokens
  (BLOCK, W), their running count within the block (``tl.cumsum``), its block's base and its chunk's offsets (from
  the counts table) give every pair's slot; it writes ``slots`` (T, W), and at each slot the token and its k expert
  ids made local to that destination (-1 for slots owned elsewhere).

The owner of expert e follows ``expert_bounds``: the first ``E mod W`` ranks own ``E // W + 1`` experts each.
Ids outside ``[0, E)`` visit no rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashmoe_science.moe.launch import Launch

STEP_TOKENS = 2048  # tokens whose ids one counts program loads at once (16 KB of int64 per expert slot in flight)
# (tokens, destinations) pairs per program of the pairs kernel (128 tokens up to W = 8; at least 16 tokens): twice
# that spilled registers at W = 32 and 64 in an sm_90 build
PAIRS_TILE = 1024


@triton.jit
def _column(ids_ptr, tokens, valid, slot, stride_t, stride_k, num_experts, base, extra):
    """Slot ``slot`` of each token: (the owning rank, -1 where invalid; the id local to that rank)."""
    expert = tl.load(ids_ptr + tokens.to(tl.int64) * stride_t + slot * stride_k, mask=valid, other=-1)
    routed = valid & (expert >= 0) & (expert < num_experts)
    expert = tl.where(routed, expert, 0).to(tl.int32)
    cut = extra * (base + 1)  # experts below it belong to the ranks holding one more
    owner = tl.where(expert < cut, expert // (base + 1), extra + (expert - cut) // base)
    local = expert - (owner * base + tl.minimum(owner, extra))
    return tl.where(routed, owner, -1), local


@triton.jit
def _visits(ids_ptr, tokens, valid, dests, stride_t, stride_k, num_experts, base, extra, TOP_K: tl.constexpr):
    """(tokens, destinations) int32: 1 where the token has an expert on that destination."""
    visits = tl.zeros([tokens.shape[0], dests.shape[0]], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        owner, _ = _column(ids_ptr, tokens, valid, slot, stride_t, stride_k, num_experts, base, extra)
        visits = tl.maximum(visits, (owner[:, None] == dests[None, :]).to(tl.int32))
    return visits


@triton.jit
def _chunk_range(chunk, num_tokens, chunks):
    chunk = tl.cast(chunk, tl.int64)  # c·T may pass 2^31
    first = (chunk * num_tokens // chunks).to(tl.int32)
    stop = ((chunk + 1) * num_tokens // chunks).to(tl.int32)
    return first, stop


@triton.jit
def _counts_kernel(
    ids_ptr,
    send_counts_ptr,  # (W, chunks) int64
    block_base_ptr,  # (W, chunks, blocks) int32: visits of the destination in the chunk before each block
    num_tokens,
    chunks,
    blocks,  # per chunk: cdiv(cdiv(T, chunks), BLOCK)
    num_experts,
    base,
    extra,
    stride_t,
    stride_k,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,  # blocks per step
):
    dest, chunk = tl.program_id(0), tl.program_id(1)
    first, stop = _chunk_range(chunk, num_tokens, chunks)
    dests = tl.full([1], 0, tl.int32) + dest  # `_visits` over this one destination
    running = tl.zeros([], dtype=tl.int32)
    bases = block_base_ptr + (dest * chunks + chunk) * blocks
    for group in range(0, blocks, GROUP):
        tokens = first + group * BLOCK + tl.arange(0, GROUP * BLOCK)
        visits = _visits(ids_ptr, tokens, tokens < stop, dests, stride_t, stride_k, num_experts, base, extra, TOP_K)
        per_block = tl.sum(tl.reshape(visits, (GROUP, BLOCK)), axis=1)
        rows = group + tl.arange(0, GROUP)
        tl.store(bases + rows, running + tl.cumsum(per_block, axis=0) - per_block, mask=rows < blocks)
        running += tl.sum(per_block, axis=0)
    tl.store(send_counts_ptr + dest * chunks + chunk, running.to(tl.int64))


@triton.jit
def _pairs_kernel(
    ids_ptr,
    send_counts_ptr,
    block_base_ptr,
    slots_ptr,  # (T, W) int64
    pair_token_ptr,  # (rows,) int64
    pair_ids_ptr,  # (rows, TOP_K) int32
    num_tokens,
    chunks,
    blocks,
    num_experts,
    base,
    extra,
    stride_t,
    stride_k,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    WORLD: tl.constexpr,
    W_POW2: tl.constexpr,
    C_POW2: tl.constexpr,
):
    block, chunk = tl.program_id(0), tl.program_id(1)
    first, stop = _chunk_range(chunk, num_tokens, chunks)
    tokens = first + block * BLOCK + tl.arange(0, BLOCK)
    valid = tokens < stop
    dests = tl.arange(0, W_POW2)
    # this chunk's first slot per destination: the pairs of the chunks before, then of the destinations before
    chunk_ids = tl.arange(0, C_POW2)
    counts = tl.load(send_counts_ptr + dests[:, None] * chunks + chunk_ids[None, :],
                     mask=(dests < WORLD)[:, None] & (chunk_ids < chunks)[None, :], other=0).to(tl.int32)
    mine = tl.sum(tl.where(chunk_ids[None, :] == chunk, counts, 0), axis=1)
    offsets = tl.sum(tl.where(chunk_ids[None, :] < chunk, counts, 0)) + tl.cumsum(mine, axis=0) - mine
    offsets += tl.load(block_base_ptr + (dests * chunks + chunk) * blocks + block, mask=dests < WORLD, other=0)
    visits = _visits(ids_ptr, tokens, valid, dests, stride_t, stride_k, num_experts, base, extra, TOP_K)
    slot = offsets[None, :] + tl.cumsum(visits, axis=0) - visits  # (BLOCK, W_POW2)
    sent = visits > 0
    slot = tl.where(sent, slot, -1).to(tl.int64)
    tl.store(slots_ptr + tokens.to(tl.int64)[:, None] * WORLD + dests[None, :], slot,
             mask=valid[:, None] & (dests < WORLD)[None, :])
    tl.store(pair_token_ptr + slot, tl.broadcast_to(tokens.to(tl.int64)[:, None], slot.shape), mask=sent)
    for k in tl.static_range(TOP_K):
        owner, local = _column(ids_ptr, tokens, valid, k, stride_t, stride_k, num_experts, base, extra)
        ids = tl.where(owner[:, None] == dests[None, :], local[:, None], -1)
        tl.store(pair_ids_ptr + slot * TOP_K + k, ids, mask=sent)


def plan_pairs(topk_ids: torch.Tensor, num_experts: int, world_size: int, send_counts: torch.Tensor,
               counts_ready, *, block: int | None = None, step: int = STEP_TOKENS):
    """``pair_plan.plan_pairs_reference`` in two launches: fills ``send_counts`` (W, chunks, contiguous), calls
    ``counts_ready()`` (which starts the counts' exchange), then returns ``(slots, pair_token, pair_ids)``.
    ``block`` (tokens per pairs program, default ``PAIRS_TILE // W`` within [16, 128]) and ``step`` (tokens per counts step) are
    powers of 2; tests shrink them to cross block and step boundaries on few tokens."""
    if not send_counts.is_contiguous():
        raise ValueError("send_counts must be contiguous: the counts kernel writes it as a (W, chunks) table")
    num_tokens, top_k = topk_ids.shape
    chunks = send_counts.shape[1]
    device = topk_ids.device
    w_pow2 = triton.next_power_of_2(world_size)
    block = block or max(16, min(128, PAIRS_TILE // w_pow2))
    blocks = triton.cdiv(triton.cdiv(num_tokens, chunks), block)
    block_base = torch.empty(world_size * chunks * blocks, dtype=torch.int32, device=device)  # slots < T·W < 2^31
    base, extra = divmod(num_experts, world_size)
    shape = (num_tokens, chunks, blocks, num_experts, base, extra, topk_ids.stride(0), topk_ids.stride(1))
    group = min(max(step // block, 1), triton.next_power_of_2(max(blocks, 1)))
    Launch(_counts_kernel, (world_size, chunks), (topk_ids, send_counts, block_base, *shape),
           dict(TOP_K=top_k, BLOCK=block, GROUP=group, num_warps=8))()
    counts_ready()
    slots = torch.empty((num_tokens, world_size), dtype=torch.int64, device=device)
    rows = num_tokens * min(world_size, top_k)  # a token visits at most min(W, k) ranks
    pair_token = torch.empty(rows, dtype=torch.int64, device=device)
    pair_ids = torch.empty((rows, top_k), dtype=torch.int32, device=device)
    if blocks > 0:
        Launch(_pairs_kernel, (blocks, chunks),
               (topk_ids, send_counts, block_base, slots, pair_token, pair_ids, *shape),
               dict(TOP_K=top_k, BLOCK=block, WORLD=world_size, W_POW2=w_pow2,
                    C_POW2=triton.next_power_of_2(chunks), num_warps=4 if block * w_pow2 <= PAIRS_TILE else 8))()
    return slots, pair_token, pair_ids
