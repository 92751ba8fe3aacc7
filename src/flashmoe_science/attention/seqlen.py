"""Sequence bookkeeping, one home for every attention kernel: which rows of the tensors sequence b owns, and how long
it is.

Dense batches: sequence b is batch entry b, its rows start at 0, and every sequence has the call's lengths. Packed
(varlen) batches, flash-attn's layout (`features.Varlen`): q/k/v are `(1, H, total, D)` views, sequence b owns rows
[cu_seqlens[b], cu_seqlens[b+1]) of them, a launch is sized by the longest sequence, and each program reads its own
sequence's first row and lengths.

Host side: `launch_sizes` (the sequences and lengths a launch covers), `varlen_tile_offsets` and `VarlenBatch` (a
packed batch's real query tiles, numbered for persistent kernels: hopper/work_items.varlen_work walks them). Kernel
side, plain `triton.jit` functions that the Gluon kernels call too: `sequence_bounds` (a sequence's first row and
length) and `sequence_coords` (the same as TMA coordinates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def launch_sizes(q: torch.Tensor, k: torch.Tensor, varlen) -> tuple[int, int, int]:
    """(sequences, seqlen_q, seqlen_k) of a launch over 4-D q, k: the batch and the tensors' lengths, or for a packed
    batch (`varlen`: a features.Varlen, else None) the number of sequences and the longest lengths."""
    if varlen is not None:
        return varlen.num_seqs, varlen.max_seqlen_q, varlen.max_seqlen_k
    return q.shape[0], q.shape[2], k.shape[2]


@dataclass(frozen=True)
class VarlenBatch:
    """A packed batch as a persistent kernel walks it: int32 cumulative lengths (B+1,) of the queries and keys on q's
    device, and `tile_offsets` (varlen_tile_offsets of cu_seqlens_q): the work items are the real query tiles only."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    tile_offsets: torch.Tensor


def varlen_tile_offsets(cu_seqlens_q: torch.Tensor, block_m: int) -> torch.Tensor:
    """int32 (B+1,): entry b counts the block_m-row query tiles of the sequences before b (the last entry: all of
    them). Computed on the device (no synchronisation), so the kernel numbers its work items without a host copy of
    the lengths."""
    lengths = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    offsets = torch.zeros(cu_seqlens_q.shape[0], dtype=torch.int32, device=cu_seqlens_q.device)
    torch.cumsum(torch.div(lengths + (block_m - 1), block_m, rounding_mode="floor"), 0, dtype=torch.int32,
                 out=offsets[1:])
    return offsets


@triton.jit
def sequence_bounds(CU_SEQLENS, batch, seqlen, VARLEN: tl.constexpr):
    """(first row, length) of sequence `batch`: from the cumulative lengths of a packed batch (the first row as
    int64), else (0, seqlen) with a compile-time 0 (so dense launches carry no row offset arithmetic, and Gluon
    kernels, which have no layout-free tl.zeros, can call this too)."""
    if VARLEN:
        start = tl.load(CU_SEQLENS + batch)
        seqlen = tl.load(CU_SEQLENS + batch + 1) - start
        start = start.to(tl.int64)
    else:
        start = 0
    return start, seqlen


@triton.jit
def sequence_coords(CU_SEQLENS_Q, CU_SEQLENS_K, seq, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(batch, q_first, seqlen_q, k_first, seqlen_k) of sequence `seq` as TMA coordinates: a packed batch is one
    (1, H, total rows, D) tensor whose sequences start at 32-bit row offsets; a dense batch is batch `seq` with
    offsets 0. The caller returns early where its tile lies past the sequence."""
    q_first, seqlen_q = sequence_bounds(CU_SEQLENS_Q, seq, seqlen_q, VARLEN)
    k_first, seqlen_k = sequence_bounds(CU_SEQLENS_K, seq, seqlen_k, VARLEN)
    if VARLEN:
        return 0, q_first.to(tl.int32), seqlen_q, k_first.to(tl.int32), seqlen_k
    else:
        return seq, q_first, seqlen_q, k_first, seqlen_k
