"""A padded batch as a packed one, built once per padding mask and without reading anything on the host.

A padding mask ``(B, L)`` (True at real tokens) says which rows of a token-major ``(B·L, H, D)`` tensor are real.
The packed layout of flash-attn's varlen calls wants the real rows one sequence after the other; its length (the
number of real tokens) is a device value, and reading it on the host would stop the host until the device has
caught up, once per layer. Instead the packed tensors keep all ``B·L`` rows, as a permutation of the token rows:
the real tokens first, batch row by batch row, then the padding tokens. The cumulative lengths end at the number of
real tokens, so the padding rows lie after the last sequence, attended by none (the varlen kernels' rule for
unchecked cu_seqlens), and every shape and launch grid is fixed by ``B`` and ``L``: a model step over the batch
issues its kernels without waiting and can be captured in a CUDA graph.

``padded_rows(mask, length_q)`` builds the permutations (``PaddedRows``: a handful of device ops) and remembers them
per mask tensor, so a model's layers, which all receive the same mask, build them once per forward. ``to_packed``
and ``to_tokens`` move rows between the two layouts as autograd ops, one gather each way (``to_packed`` reads the
``(B, H, L, D)`` tensors in whatever layout they come: a transposed ``(B, L, H, D)`` projection or a contiguous KV
cache, without a transposing copy first): the packed output's padding rows (unspecified) come back as zeros, and no
gradient reaches a padding token from rows no sequence computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashmoe_science.prepared_cache import TensorMemo


@dataclass(frozen=True)
class RowOrder:
    """One side (queries or keys) of a padded batch: ``order[i]`` is the token row ``b·L + l`` of packed row i (real
    tokens first), ``order_batch`` / ``order_position`` its ``b`` and ``l``, ``inverse`` the packed row of each token
    row; ``pad_tokens`` / ``pad_rows`` ``(B·L, 1, 1)`` bool mark the padding tokens and the packed rows after the last
    sequence; ``cu_seqlens`` int32 ``(B+1,)``."""

    order: torch.Tensor
    order_batch: torch.Tensor
    order_position: torch.Tensor
    inverse: torch.Tensor
    pad_tokens: torch.Tensor
    pad_rows: torch.Tensor
    cu_seqlens: torch.Tensor


@dataclass(frozen=True)
class PaddedRows:
    """Queries' and keys' `RowOrder` (the same object when they have the same mask) and the longest lengths the
    kernels are sized by: the padded lengths, upper bounds of every sequence's."""

    q: RowOrder
    k: RowOrder
    max_seqlen_q: int
    max_seqlen_k: int


def row_order(real: torch.Tensor) -> RowOrder:
    """The `RowOrder` of a boolean ``(B, L)`` mask, on its device, in a few elementwise ops and scans."""
    flat = real.reshape(-1)
    rows = torch.arange(flat.numel(), device=flat.device)
    real_count = flat.sum()
    # the packed row of a real token is its rank among the real tokens; a padding token's, the real count plus its
    # rank among the padding tokens
    inverse = torch.where(flat, flat.cumsum(0) - 1, (~flat).cumsum(0) - 1 + real_count)
    order = torch.empty_like(inverse).scatter_(0, inverse, rows)
    cu_seqlens = F.pad(real.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    length = real.shape[1]
    return RowOrder(order, order // length, order % length, inverse, (~flat).view(-1, 1, 1),
                    (rows >= real_count).view(-1, 1, 1), cu_seqlens)


# padded_rows' answers, per mask tensor while it lives unwritten (a model's layers share one per forward)
_PADDED_ROWS = TensorMemo()


def padded_rows(mask: torch.Tensor, length_q: int) -> PaddedRows:
    """The `PaddedRows` of a boolean padding mask ``(B, Lk)`` for ``length_q`` queries: the keys follow the mask,
    the queries its last ``length_q`` columns (queries appended after the keys seen so far, as with a KV cache).
    Remembered per mask tensor (not while torch.compile traces: the compiled graph computes it once per call)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise TypeError(f"mask must be a boolean (batch, keys) tensor, got "
                        f"{mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__}"
                        f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else ''}")
    if not 0 < length_q <= mask.shape[1]:
        raise ValueError(f"length_q must be in [1, {mask.shape[1]}] (the mask's keys), got {length_q}")
    remember = not torch.compiler.is_compiling()
    rows = _PADDED_ROWS.get((mask,), length_q) if remember else None
    if rows is None:
        keys = row_order(mask)
        queries = keys if length_q == mask.shape[1] else row_order(mask[:, -length_q:])
        rows = PaddedRows(queries, keys, length_q, mask.shape[1])
        if remember:
            _PADDED_ROWS.put((mask,), length_q, rows)
    return rows


class _Gather(torch.autograd.Function):
    """``x.index_select(0, index)`` with the rows ``drop`` marks set to zero; its gradient is the same operation with
    the inverse permutation and the other side's mask (a permutation's gradient is its inverse)."""

    @staticmethod
    def forward(ctx, x, index, drop, inverse, drop_back):
        ctx.save_for_backward(inverse, drop_back)
        return x.index_select(0, index).masked_fill_(drop, 0)

    @staticmethod
    def backward(ctx, grad):
        inverse, drop_back = ctx.saved_tensors
        return grad.index_select(0, inverse).masked_fill_(drop_back, 0), None, None, None, None


class _GatherTokens(torch.autograd.Function):
    """The packed rows ``(N, H, D)`` of a ``(B, H, L, D)`` tensor of any strides: one gather at the rows' (batch,
    position) pairs, whichever of the two layouts the tensor is in. Its gradient scatters back by the inverse
    permutation (a gather too) into a token-major buffer, returned as the ``(B, H, L, D)`` view of it (the layout of
    a projection's ``view(B, L, H, D).transpose(1, 2)``, whose gradient then needs no copy); padding tokens get
    zeros."""

    @staticmethod
    def forward(ctx, x, batch, position, inverse, pad_tokens):
        ctx.save_for_backward(inverse, pad_tokens)
        ctx.shape = x.shape
        return x.transpose(1, 2)[batch, position]

    @staticmethod
    def backward(ctx, grad):
        inverse, pad_tokens = ctx.saved_tensors
        batch, heads, length, head_dim = ctx.shape
        tokens = grad.index_select(0, inverse).masked_fill_(pad_tokens, 0)
        return tokens.view(batch, length, heads, head_dim).transpose(1, 2), None, None, None, None


def to_packed(x: torch.Tensor, rows: RowOrder) -> torch.Tensor:
    """``x (B, H, L, D)`` (any strides) as packed rows ``(B·L, H, D)`` in ``rows``' order. The padding rows are
    copied as they are (no sequence reads them); the gradient of a padding token is zero."""
    return _GatherTokens.apply(x, rows.order_batch, rows.order_position, rows.inverse, rows.pad_tokens)


def to_tokens(packed: torch.Tensor, rows: RowOrder) -> torch.Tensor:
    """Packed rows back in token order ``(B·L, H, D)``, the padding tokens' rows zero; rows after the last sequence
    get no gradient."""
    return _Gather.apply(packed, rows.inverse, rows.pad_tokens, rows.order, rows.pad_rows)


__all__ = ["PaddedRows", "RowOrder", "padded_rows", "row_order", "to_packed", "to_tokens"]
