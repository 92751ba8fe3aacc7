"""Paged caches with pages larger than the kernels take, read as caches of smaller pages.

The cache kernels take pages of 16 to 256 rows (`checks.MIN_BLOCK_SIZE`, `checks.MAX_BLOCK_SIZE`); FlashAttention 2
takes multiples of 256 (512 is common). A page of ``B`` rows whose rows are adjacent to the next row's in memory is
``r = B / s`` consecutive pages of ``s`` rows, ``s`` the largest size in range that divides ``B``: the cache is viewed
as ``(num_blocks · r, s, Hkv, D)`` (the same storage, so appended keys land in the caller's cache) and each
block-table entry ``p`` becomes the ``r`` entries ``p·r .. p·r + r - 1`` (a negative entry, a row that holds no page,
stays negative). A few device ops on the table, no host read, once per table tensor while it is unwritten (a
model's layers share one per step): it works while a CUDA graph is captured.
"""

from __future__ import annotations

import torch

from flashmoe_science.attention.decode.checks import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from flashmoe_science.prepared_cache import TensorMemo

# split_pages' expanded tables, per block-table tensor and split
_SPLIT_TABLES = TensorMemo()


def page_split(block_size: int) -> int | None:
    """The page size the kernels read a ``block_size``-row page as: itself where it is in range, else the largest
    size in range that divides it (None: none does)."""
    if block_size <= MAX_BLOCK_SIZE:
        return block_size
    return next((size for size in range(MAX_BLOCK_SIZE, MIN_BLOCK_SIZE - 1, -1) if block_size % size == 0), None)


def split_pages(k_cache, v_cache, block_table):
    """``(k_cache, v_cache, block_table)`` with pages above `checks.MAX_BLOCK_SIZE` rows split (module docstring);
    anything else (no block table, pages in range, pages no size divides, or caches whose pages cannot be viewed
    so) as given, for the checks to take or refuse."""
    tensors = (k_cache, v_cache, block_table)
    if block_table is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        return k_cache, v_cache, block_table
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or block_table.dim() != 2:
        return k_cache, v_cache, block_table
    block_size = k_cache.shape[1]
    size = page_split(block_size)
    if size is None or size == block_size or any(c.stride(0) != block_size * c.stride(1) for c in (k_cache, v_cache)):
        return k_cache, v_cache, block_table
    parts = block_size // size
    k_cache, v_cache = (c.view(c.shape[0] * parts, size, *c.shape[2:]) for c in (k_cache, v_cache))
    table = _SPLIT_TABLES.get((block_table,), parts)
    if table is None:
        offsets = torch.arange(parts, dtype=block_table.dtype, device=block_table.device)
        entries = block_table.unsqueeze(-1)
        table = torch.where(entries >= 0, entries * parts + offsets, -1).flatten(1).to(block_table.dtype)
        _SPLIT_TABLES.put((block_table,), parts, table)
    return k_cache, v_cache, table


__all__ = ["page_split", "split_pages"]
