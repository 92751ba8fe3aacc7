"""Packed documents from position ids: the cumulative lengths of the documents a batch's rows pack, for the varlen
calls (documents attend only within themselves).

A document starts at every token whose position is 0 and at every row's first token (attention never crosses
rows, as in Flex's per-row document mask), and runs to the next start. The number of documents and the longest one
size the varlen call, so they are read on the host: once, together, in one small copy. Callers read them once per
batch (a model forward), never once per layer (`PackedDocuments` is what they keep). The cu_seqlens are valid by
construction (from 0 to the token count, non-decreasing, none longer than ``longest``): callers pass
``check_values=False`` to the varlen calls on them, which then read nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmoe_science.prepared_cache import TensorMemo

# packed_documents' answers, per positions tensor while it lives unwritten
_DOCUMENTS = TensorMemo()

@dataclass(frozen=True)
class PackedDocuments:
    """int32 ``cu_seqlens`` (documents + 1: the starts and the token count), the longest document's length, and
    whether some row packs several documents (else each row is one document)."""

    cu_seqlens: torch.Tensor
    longest: int
    several_per_row: bool


def packed_documents(positions: torch.Tensor) -> PackedDocuments:
    """The `PackedDocuments` of ``positions`` ``(B, L)`` (all ``B·L`` tokens as one packed sequence of documents).

    ``longest`` is a token's distance from the start at or before it (a running maximum of start indices), plus
    one. A few device ops and one host synchronisation; remembered per ``positions`` tensor while it lives unwritten
    (a model's layers receive the same one: one synchronisation per forward)."""
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"positions must be an integer torch.Tensor, got "
                        f"{positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__}")
    if positions.dim() != 2:
        raise ValueError(f"positions must be (batch, seq_len), got shape {tuple(positions.shape)}")
    documents = _DOCUMENTS.get((positions,))
    if documents is None:
        documents = _packed_documents(positions)
        _DOCUMENTS.put((positions,), None, documents)
    return documents


def _packed_documents(positions: torch.Tensor) -> PackedDocuments:
    total = positions.numel()
    if total == 0:
        return PackedDocuments(torch.zeros(1, dtype=torch.int32, device=positions.device), 0, False)
    # Python numbers enter device tensors only as fill/kernel arguments: an assignment such as ``t[i] = n`` is a
    # host-to-device copy, which synchronises (three syncs measured on an H200 with one of them)
    starts = positions == 0
    starts[:, 0].fill_(True)
    starts = starts.view(-1)
    index = torch.arange(total, dtype=torch.int32, device=positions.device)
    doc_first = torch.cummax(index.masked_fill(~starts, 0), dim=0).values
    count, longest = torch.stack([starts.sum(dtype=torch.int32), (index - doc_first).max() + 1]).tolist()
    # each start's index written at its rank among the starts, every other token into a spare last slot (sliced
    # off); slot ``count`` keeps the fill, ``total`` (nonzero_static would synchronise on CUDA, torch 2.11)
    rank = (starts.cumsum(0, dtype=torch.int32) - 1).masked_fill_(~starts, count + 1)
    cu_seqlens = torch.full((count + 2,), total, dtype=torch.int32, device=positions.device)
    cu_seqlens = cu_seqlens.scatter_(0, rank.long(), index)[:count + 1]
    return PackedDocuments(cu_seqlens, longest, count > positions.shape[0])


__all__ = ["PackedDocuments", "packed_documents"]
