"""Who sends which token to which rank: the expert-parallel exchange's pair plan, shared by every exchange.

A token t visits destination rank w when one of its top-k experts lives on w (`owner_and_start`: ranks own
contiguous expert ranges, the first ``E mod W`` one expert more). ``plan_pairs`` orders every visiting (token,
destination) pair by (chunk, destination, token) and gives each its row in that order (``slots``); on CUDA in the
two Triton launches of ``triton_plan``, elsewhere in PyTorch ops (``plan_pairs_reference``, their reference).
"""

from __future__ import annotations

import torch


def plan_pairs(topk_ids: torch.Tensor, num_experts: int, world_size: int, send_counts: torch.Tensor, counts_ready):
    """``(slots, pair_token, pair_ids)`` and ``send_counts`` filled, as ``plan_pairs_reference`` documents, by
    the Triton plan where ``plans_in_triton`` says so."""
    if plans_in_triton(topk_ids):
        from flashmoe_science.distributed import triton_plan

        return triton_plan.plan_pairs(topk_ids, num_experts, world_size, send_counts, counts_ready)
    return plan_pairs_reference(topk_ids, num_experts, world_size, send_counts, counts_ready)


def owner_and_start(expert_ids: torch.Tensor, num_experts: int, world_size: int):
    """The rank owning each expert id and that rank's first expert, by `expert_bounds`' arithmetic (the first
    ``E mod W`` ranks own one expert more): no bounds table to copy to the device."""
    base, extra = divmod(num_experts, world_size)
    cut = extra * (base + 1)  # experts below it belong to the larger ranks
    owner = torch.where(expert_ids < cut, expert_ids // (base + 1), extra + (expert_ids - cut) // base)
    return owner, owner * base + owner.clamp(max=extra)


def plans_in_triton(topk_ids: torch.Tensor) -> bool:
    """CUDA ids take the two Triton launches of ``triton_plan.plan_pairs``; elsewhere ``plan_pairs_reference`` (47 aten ops,
    each launched from Python: host-bound on a GPU; benchmarks/tools/profile_ep_plan.py counts both)."""
    return topk_ids.is_cuda


def plan_pairs_reference(topk_ids: torch.Tensor, num_experts: int, world_size: int, send_counts: torch.Tensor, counts_ready):
    """The send order of every (token, destination) pair, in PyTorch ops: the reference of ``triton_plan.plan_pairs``.

    Fills ``send_counts`` (W, chunks) with the pairs each chunk sends to each rank, calls ``counts_ready()`` (the
    caller starts the counts' exchange there), then returns ``(slots, pair_token, pair_ids)``: ``slots`` (T, W) int64
    the row of pair (t, w) in the send order over all chunks, -1 where t does not visit w; ``pair_token`` int64 and
    ``pair_ids`` (rows, k) int32 the token of each row sent and its k expert ids local to the row's destination (-1
    for slots owned elsewhere). The order is (chunk, destination, token); rows past the pairs sent are unspecified.
    Every step is a device op on (T, k) or (T, W) tensors (H100, 16k tokens, W = 2: the counts by an accumulating
    index_put took 0.74 ms, by a prefix sum a few µs)."""
    num_tokens, top_k = topk_ids.shape
    chunks = send_counts.shape[1]
    device = topk_ids.device
    owner, start = owner_and_start(topk_ids, num_experts, world_size)  # (T, k): each routed expert's rank, its first
    visits = torch.zeros(num_tokens, world_size, dtype=torch.bool, device=device).scatter_(1, owner, True)
    token = torch.arange(num_tokens, device=device)
    # chunk c holds tokens [c·T // n, (c + 1)·T // n): token t is in chunk ceil((t + 1)·n / T) - 1
    chunk = ((token + 1) * chunks + num_tokens - 1) // max(num_tokens, 1) - 1
    # (W destinations, chunks): prefix sums of the visits read at the chunk boundaries. The scan runs along the
    # contiguous dim of (W, T): along dim 0 of (T, W) CUDA parallelises over W only (1.5 ms at T = 16k, W = 2).
    bounds = torch.arange(chunks + 1, device=device) * num_tokens // chunks
    prefix = torch.nn.functional.pad(visits.t().to(torch.int32).cumsum(1), (1, 0))
    send_counts.copy_(prefix[:, bounds[1:]] - prefix[:, bounds[:-1]])
    counts_ready()
    # while the counts fly: every (token, destination) pair ordered by (chunk, destination, token), the pairs not
    # sent last; each with its k expert ids local to the destination (-1 for slots owned elsewhere)
    dest = torch.arange(world_size, device=device)
    keys = ((chunk.unsqueeze(1) * world_size + dest) * max(num_tokens, 1) + token.unsqueeze(1))
    order = torch.where(visits, keys, torch.iinfo(torch.int64).max).view(-1).argsort()
    pair_token, pair_dest = order // world_size, order % world_size
    mine = owner[pair_token] == pair_dest.unsqueeze(1)
    pair_ids = torch.where(mine, topk_ids[pair_token] - start[pair_token], -1).to(torch.int32)
    position = torch.empty(num_tokens * world_size, dtype=torch.int64, device=device)
    position[order] = torch.arange(num_tokens * world_size, device=device)
    slots = torch.where(visits.view(-1), position, -1).view(num_tokens, world_size)
    return slots, pair_token, pair_ids
