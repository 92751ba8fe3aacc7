"""The zig-zag layout of a sequence sharded over the ranks of a ring (load-balanced causal context parallelism).

A sequence of L positions is cut into ``2W`` consecutive chunks (W = number of ranks), sized as
``torch.tensor_split`` sizes them: the first ``L % 2W`` chunks hold one position more. Rank r holds chunk r and its
mirror, chunk ``2W - 1 - r``, in that order. Under a causal mask every rank then has the same amount of work at
every ring step (an early chunk paired with a late one), which a plain contiguous split does not give: there the
last rank attends to everything and the first to almost nothing.

Every rank can compute every other rank's chunks from L and W alone; `ring_attention` relies on that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmoe_science.distributed.comm import all_gather, gather_ints, group_rank_and_size


@dataclass(frozen=True)
class Chunk:
    """One chunk of a rank's shard: where it starts in the rank's local tensor and in the global sequence."""

    local_start: int
    global_start: int
    length: int


def _check_split(seqlen: int, world_size: int) -> None:
    for name, value in (("seqlen", seqlen), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if seqlen < 0:
        raise ValueError(f"seqlen must be >= 0, got {seqlen}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def chunk_starts(seqlen: int, world_size: int) -> list[int]:
    """The global start of each of the ``2W`` chunks, then L (so chunk i is ``[starts[i], starts[i + 1])``)."""
    _check_split(seqlen, world_size)
    num_chunks = 2 * world_size
    base, extra = divmod(seqlen, num_chunks)
    starts = [0]
    for i in range(num_chunks):
        starts.append(starts[-1] + base + (1 if i < extra else 0))
    return starts


def shard_chunks(seqlen: int, world_size: int, rank: int) -> tuple[Chunk, Chunk]:
    """The two chunks rank ``rank`` holds: chunk ``rank`` then chunk ``2W - 1 - rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    starts = chunk_starts(seqlen, world_size)
    first, second = rank, 2 * world_size - 1 - rank
    first_len = starts[first + 1] - starts[first]
    return (Chunk(0, starts[first], first_len),
            Chunk(first_len, starts[second], starts[second + 1] - starts[second]))


def sequence_shards(seqlens, world_size: int, rank: int) -> list[tuple[Chunk, Chunk]]:
    """Rank ``rank``'s two chunks of each of several packed sequences (varlen), each sequence split on its own:
    ``local_start`` in the rank's packed shard (the sequences one after the other, each as its two chunks),
    ``global_start`` in the packed full batch. One sequence of length L gives `shard_chunks`."""
    shards, local, offset = [], 0, 0
    for seqlen in seqlens:
        first, second = shard_chunks(seqlen, world_size, rank)
        shards.append((Chunk(local, offset + first.global_start, first.length),
                       Chunk(local + first.length, offset + second.global_start, second.length)))
        local += first.length + second.length
        offset += seqlen
    return shards


def shard_lengths(seqlens, world_size: int) -> list[int]:
    """The local (packed) length of each rank, for one sequence of length ``seqlens`` or several (a list)."""
    seqlens = [seqlens] if isinstance(seqlens, int) else list(seqlens)
    return [sum(c.length for pair in sequence_shards(seqlens, world_size, r) for c in pair)
            for r in range(world_size)]


def _seqlens(cu_seqlens) -> list[int]:
    """Sequence lengths from cumulative lengths (a list or an integer tensor: one host copy)."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {bounds}")
    return [b - a for a, b in zip(bounds, bounds[1:])]


def zigzag_positions(seqlen, world_size: int, rank: int, device=None, *, cu_seqlens=None) -> torch.Tensor:
    """The position of each local token of rank ``rank`` in its sequence (int64), e.g. for rotary embeddings: of a
    sequence of length ``seqlen``, or with ``cu_seqlens`` (``seqlen`` then None) of each packed sequence."""
    lengths = _seqlens(cu_seqlens) if cu_seqlens is not None else [seqlen]
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    positions = [torch.arange(c.global_start - start, c.global_start - start + c.length, device=device)
                 for pair, start in zip(sequence_shards(lengths, world_size, rank), starts) for c in pair]
    return torch.cat(positions) if positions else torch.empty(0, dtype=torch.int64, device=device)


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [-{x.dim()}, {x.dim()}) for a tensor of shape {tuple(x.shape)}, "
                         f"got {dim!r}")
    return dim % x.dim()


def zigzag_shard(x: torch.Tensor, group=None, *, dim: int = -2, cu_seqlens=None) -> torch.Tensor:
    """This rank's zig-zag shard of the full sequence ``x`` (the sequence along ``dim``; default -2, the L of
    ``(..., H, L, D)``), or with ``cu_seqlens`` of each packed sequence of ``x`` (varlen: ``dim=0`` of
    ``(total, H, D)``). Returns a new contiguous tensor (each sequence's two chunks, sequence after sequence)."""
    dim = _check_dim(x, dim)
    rank, world_size = group_rank_and_size(group)
    lengths = _lengths_along(x, dim, cu_seqlens)
    return torch.cat([x.narrow(dim, c.global_start, c.length)
                      for pair in sequence_shards(lengths, world_size, rank) for c in pair], dim=dim)


def _lengths_along(x, dim, cu_seqlens) -> list[int]:
    if cu_seqlens is None:
        return [x.shape[dim]]
    lengths = _seqlens(cu_seqlens)
    if sum(lengths) != x.shape[dim]:
        raise ValueError(f"cu_seqlens end at {sum(lengths)} but x has {x.shape[dim]} positions along dim {dim}")
    return lengths


def zigzag_unshard(local: torch.Tensor, group=None, *, dim: int = -2, cu_seqlens=None) -> torch.Tensor:
    """The full sequence (or, with ``cu_seqlens``, the packed full batch) from every rank's zig-zag shard: an
    all-gather, every rank gets the whole tensor. Not differentiable: for inspecting results and for tests."""
    dim = _check_dim(local, dim)
    rank, world_size = group_rank_and_size(group)
    lengths = gather_ints([local.shape[dim]], group, local.device)[:, 0].tolist()
    seqlens = [sum(lengths)] if cu_seqlens is None else _seqlens(cu_seqlens)
    expected = shard_lengths(seqlens, world_size)
    if lengths != expected:
        raise ValueError(f"zigzag_unshard: shard lengths {lengths} along dim {dim} are not a zig-zag split of "
                         f"sequences {seqlens} over {world_size} ranks (expected {expected})")
    longest = max(lengths)
    padded = torch.zeros(*local.shape[:dim], longest, *local.shape[dim + 1:], dtype=local.dtype,
                         device=local.device)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    gathered = all_gather(padded, group)
    pieces: list[tuple[int, torch.Tensor]] = []
    for r, shard in enumerate(gathered):
        for pair in sequence_shards(seqlens, world_size, r):
            pieces += [(c.global_start, shard.narrow(dim, c.local_start, c.length)) for c in pair]
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda item: item[0])], dim=dim)
