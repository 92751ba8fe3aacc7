"""The ``mask-mods`` suite of `bench/features.py`: masks users write, as `mask_mod` functions, through our kernels,
compiled FlexAttention and FlashAttention-4 with the same block mask, forward and backward.

Each case is one mask at B=4, H=16, L=4096, D=128 (bf16; sizes / 64 on a CPU), written twice: the `@triton.jit`
mod our kernels call (attention/mods.py) and its torch twin, which FlexAttention's `create_block_mask` traces (built
once per case, outside timing, like our block mask, which the first call builds and later calls reuse).

- ``document window``: packed documents (about 8 per row), causal, at most `WINDOW` keys back;
- ``prefix-LM``: a per-row prefix every query sees, causal after it;
- ``head windows``: a causal sliding window whose width is a per-head table (128..2048 keys);
- ``neighbour list``: atoms (sorted along a space-filling curve, so neighbours are near in index) attending to
  themselves and to the `NEIGHBOURS` atoms of their row of a neighbour table, within `REACH` positions;
- ``causal`` and ``sliding window`` (causal, `WINDOW` keys back): built-in masks written as mods, each also timed as
  the built-in keyword (`BUILTIN_KEYWORDS`): what a built-in would cost if the kernels took it as a mod.

TFLOP/s count the (query, key) pairs the mask lets through (4·D FLOPs each forward; backward 2.5 x), the same
for every backend, so their ratio is the time ratio. FlashAttention-4's `mask_mod` takes CuTe DSL functions: each case's
CuTe DSL twin, which reads the same tensors, is in `bench/mask_mods_fa4.py` (imported only where FA4 runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashmoe_science.attention.mods import MaskMod

BATCH, HEADS, LENGTH, HEAD_DIM = 4, 16, 4096, 128
WINDOW = 512
NEIGHBOURS, REACH = 16, 64
# the same, as the mods below read them (Triton takes module globals that are constexprs)
LENGTH_STRIDE = tl.constexpr(LENGTH)
WINDOW_KEYS = tl.constexpr(WINDOW)
NEIGHBOUR_SLOTS = tl.constexpr(NEIGHBOURS)


@triton.jit
def document_window(b, h, q_idx, kv_idx, doc):
    """Same document, causal, at most WINDOW keys back (`doc`: (B, L) document ids)."""
    row = doc + b * LENGTH_STRIDE
    same = tl.load(row + q_idx) == tl.load(row + kv_idx)
    return same & (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW_KEYS)


@triton.jit
def prefix_lm(b, h, q_idx, kv_idx, prefix):
    """Keys in row b's prefix (`prefix`: (B,)) are seen by every query; the rest causally."""
    return (kv_idx < tl.load(prefix + b)) | (kv_idx <= q_idx)


@triton.jit
def head_windows(b, h, q_idx, kv_idx, windows):
    """Causal, at most windows[h] keys back (`windows`: (H,))."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= tl.load(windows + h))


@triton.jit
def neighbour_list(b, h, q_idx, kv_idx, table):
    """Atom q_idx sees itself and the atoms of its row of `table` (B, L, NEIGHBOURS), -1 = none."""
    seen = q_idx == kv_idx
    row = table + (b * LENGTH_STRIDE + q_idx) * NEIGHBOUR_SLOTS
    for n in tl.static_range(NEIGHBOUR_SLOTS):
        seen = seen | (tl.load(row + n) == kv_idx)
    return seen


@triton.jit
def causal(b, h, q_idx, kv_idx):
    """The built-in `causal=True` at Lq == Lk."""
    return kv_idx <= q_idx


@triton.jit
def sliding_window(b, h, q_idx, kv_idx):
    """The built-in `window=(WINDOW, 0)`."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW_KEYS)


# the cases that are a built-in mask written as a mod: the keywords of the same mask
BUILTIN_KEYWORDS = {"causal": dict(causal=True), "sliding window": dict(window=(WINDOW, 0))}


def _document_ids(batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """(B, L) int32 ids of about 8 documents per row, in order."""
    cuts = torch.sort(torch.randint(1, length, (batch, 7), generator=gen), dim=1).values
    positions = torch.arange(length)
    return (positions[None, :, None] >= cuts[:, None, :]).sum(-1).to(torch.int32)


def _neighbour_table(batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """(B, L, NEIGHBOURS) int32: for each atom, atoms within REACH positions of it (a cell list's neighbours after
    a space-filling-curve sort), -1 where the row has fewer."""
    offsets = torch.randint(-REACH, REACH + 1, (batch, length, NEIGHBOURS), generator=gen)
    table = torch.arange(length)[None, :, None] + offsets
    return torch.where((table >= 0) & (table < length), table, -1).to(torch.int32)


def mask_cases(length: int, device) -> list[tuple[str, MaskMod, object, int]]:
    """(name, our mask_mod, Flex's mask_mod, pairs attended) of each case at rows of `length` (<= LENGTH: the mods
    index their tables with the LENGTH stride)."""
    gen = torch.Generator().manual_seed(0)
    doc = torch.zeros(BATCH, LENGTH, dtype=torch.int32)
    doc[:, :length] = _document_ids(BATCH, length, gen)
    prefix = torch.randint(0, length // 2 + 1, (BATCH,), generator=gen).to(torch.int32)
    windows = torch.randint(128, 2049, (HEADS,), generator=gen).to(torch.int32)
    table = torch.full((BATCH, LENGTH, NEIGHBOURS), -1, dtype=torch.int32)
    table[:, :length] = _neighbour_table(BATCH, length, gen)
    doc, prefix, windows, table = (t.to(device) for t in (doc, prefix, windows, table))

    def flex_document(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (kv <= q) & (q - kv <= WINDOW)

    def flex_prefix(b, h, q, kv):
        return (kv < prefix[b]) | (kv <= q)

    def flex_windows(b, h, q, kv):
        return (kv <= q) & (q - kv <= windows[h])

    def flex_neighbours(b, h, q, kv):
        seen = q == kv
        for n in range(NEIGHBOURS):
            seen = seen | (table[b, q, n] == kv)
        return seen

    def flex_causal(b, h, q, kv):
        return kv <= q

    def flex_window(b, h, q, kv):
        return (kv <= q) & (q - kv <= WINDOW)

    cases = [("document window", MaskMod(document_window, doc), flex_document),
             ("prefix-LM", MaskMod(prefix_lm, prefix), flex_prefix),
             ("head windows", MaskMod(head_windows, windows), flex_windows),
             ("neighbour list", MaskMod(neighbour_list, table), flex_neighbours),
             ("causal", MaskMod(causal), flex_causal),
             ("sliding window", MaskMod(sliding_window), flex_window)]
    return [(name, ours, flex, _pairs(flex, length, device)) for name, ours, flex in cases]


def _pairs(mask, length: int, device) -> int:
    """The (query, key) pairs `mask` lets through over the batch and heads, a (b, h) at a time."""
    q = torch.arange(length, device=device)[:, None]
    kv = torch.arange(length, device=device)[None, :]
    return sum(int(mask(b, h, q, kv).sum()) for b in range(BATCH) for h in range(HEADS))
