"""The SuperCon data as packed tensors, its splits, and batches.

Families (for the held-out-family split) are chemical systems: the set of elements of a composition, amounts
ignored (``La1.85Sr0.15CuO4`` and ``La2CuO4.1`` are the system Cu-La-O and Cu-La-O-Sr). Holding out whole systems
removes every doping series of a system from training, the usual "leave-cluster-out" test of extrapolation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from flashmoe_science.science.formula import FormulaTable, read_formula_csv
from flashmoe_science.science.supercon_model import ELEMENT_INDEX, ELEMENT_SYMBOLS, PackedBatch

PACKAGED_DATA = "data/supercon.csv.gz"  # inside flashmoe_science.science; source and terms in data/NOTICE.md
# random: rows shuffled; family: whole chemical systems held out; superconductors: the rows with Tc > 0 shuffled (the
# setting of the published Tc regressions, which leave the non-superconductors out)
SPLITS = ("random", "family", "superconductors")
DEFAULT_SPLITS = ("random", "family")
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)  # train, validation, test


@dataclass
class CompositionSet:
    """Compositions packed end to end: composition i owns tokens ``offsets[i]:offsets[i + 1]``."""

    elements: torch.Tensor  # (T,) int64 element indices (atomic number - 1)
    fractions: torch.Tensor  # (T,) float32, each composition's sum to 1
    offsets: torch.Tensor  # (N + 1,) int64
    formulas: list[str]
    targets: torch.Tensor  # (N,) float32 (Tc in kelvin; NaN where unknown)

    def __len__(self) -> int:
        return len(self.formulas)

    @property
    def max_length(self) -> int:
        return int((self.offsets[1:] - self.offsets[:-1]).max()) if len(self) else 0

    def systems(self) -> list[str]:
        """Each composition's chemical system: its element symbols sorted and joined by '-'."""
        return ["-".join(sorted(ELEMENT_SYMBOLS[e] for e in self.elements[a:b].tolist()))
                for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())]

    def fraction_vectors(self) -> torch.Tensor:
        """``(N, 96)`` float32: each composition's element fractions at its elements' indices."""
        lengths = self.offsets[1:] - self.offsets[:-1]
        segment = torch.repeat_interleave(torch.arange(len(self)), lengths, output_size=self.elements.numel())
        return torch.zeros(len(self), len(ELEMENT_SYMBOLS)).index_put_((segment, self.elements), self.fractions,
                                                                       accumulate=True)

    def subset(self, index: torch.Tensor) -> "CompositionSet":
        """The compositions ``index`` (int64) as a CompositionSet of their own."""
        packed = self.batch(index)
        return CompositionSet(packed.elements, packed.fractions, packed.cu_seqlens.long(),
                              [self.formulas[i] for i in index.tolist()], self.targets[index])

    def batch(self, index: torch.Tensor) -> PackedBatch:
        """The compositions ``index`` (int64, on the CPU) as a PackedBatch (CPU tensors), vectorised."""
        starts, ends = self.offsets[index], self.offsets[index + 1]
        lengths = ends - starts
        cu_seqlens = torch.zeros(index.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=cu_seqlens[1:])
        total = int(cu_seqlens[-1])
        token = torch.arange(total) - torch.repeat_interleave(cu_seqlens[:-1] - starts, lengths, output_size=total)
        max_seqlen = int(lengths.max()) if index.numel() else 0
        return PackedBatch(self.elements[token], self.fractions[token], cu_seqlens.to(torch.int32), max_seqlen)


def pack_compositions(compositions: list[dict[str, float]], formulas: list[str],
                      targets: list[float] | None = None) -> CompositionSet:
    """Element amounts -> a CompositionSet (amounts normalised to fractions)."""
    lengths = [len(c) for c in compositions]
    elements = [ELEMENT_INDEX[s] for c in compositions for s in c]
    fractions = [amount / sum(c.values()) for c in compositions for amount in c.values()]
    offsets = torch.zeros(len(compositions) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    values = targets if targets is not None else [math.nan] * len(compositions)
    return CompositionSet(torch.tensor(elements, dtype=torch.int64), torch.tensor(fractions, dtype=torch.float32),
                          offsets, list(formulas), torch.tensor(values, dtype=torch.float32))


def load_supercon(path: str | Path | None = None, limit: int | None = None) -> tuple[CompositionSet, FormulaTable]:
    """Reads a SuperCon CSV (columns ``name``, ``Tc``; gzip when it ends in ``.gz``), by default the 16,406
    compositions that ship with the package; returns the packed set and the table (with its rejects)."""
    if path is None:
        with resources.as_file(resources.files("flashmoe_science.science").joinpath(PACKAGED_DATA)) as packaged:
            table = read_formula_csv(packaged, "name", "Tc", limit=limit)
    else:
        table = read_formula_csv(path, "name", "Tc", limit=limit)
    return pack_compositions(table.compositions, table.formulas, table.values), table


# the label sets the train and baselines commands read: "raw", every row as published; "curated", exact duplicate
# compositions merged and conflicting near-duplicates left out (curate_labels)
LABEL_SETS = ("raw", "curated")
CONFLICT_DISTANCE = 0.01  # L1 distance of the element-fraction vectors: 0.5% of the atoms replaced
CONFLICT_TC_K = 30.0  # a 0 K label this close to one at or above this Tc is a conflict


def curate_labels(data: CompositionSet, distance: float = CONFLICT_DISTANCE,
                  conflict_tc: float = CONFLICT_TC_K) -> tuple[CompositionSet, dict[str, int]]:
    """A dataset variant with consistent labels. Compositions with the same element fractions (the same formula
    written in another element order or scale) become one row at their median Tc (the first one's formula).
    Then every pair of compositions at most ``distance`` apart (L1 of the element-fraction vectors) of which one is
    0 K and the other at least ``conflict_tc`` is left out, both rows: nothing in the composition says which
    measurement to believe (``Y1Ba2Cu2.94Zr0.06O6.81`` 92.3 K, ``...O6.82`` 0 K). Applied before any split, so
    every model and baseline trains and is tested on the same rows. Returns the variant and the counts of what
    changed (``merged_groups``, ``merged_rows``, ``conflicting_rows``)."""
    if distance < 0 or conflict_tc <= 0:
        raise ValueError(f"distance must be >= 0 and conflict_tc > 0, got {distance} and {conflict_tc}")
    vectors = data.fraction_vectors().double()
    keys = torch.round(vectors * 1e6).to(torch.int64)  # fractions equal to 6 digits: one composition
    _, group = torch.unique(keys, dim=0, return_inverse=True)
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group)
    first = order[torch.cumsum(counts, 0) - counts]  # each group's first row in data order
    targets = torch.stack([data.targets[rows].double().quantile(0.5)
                           for rows in torch.split(order, counts.tolist())]).float()
    first, index = torch.sort(first)  # keep the data's order
    merged = data.subset(first)
    merged.targets = targets[index]
    vectors = vectors[first]
    zero = torch.nonzero(merged.targets == 0).flatten()
    high = torch.nonzero(merged.targets >= conflict_tc).flatten()
    close = torch.cdist(vectors[zero], vectors[high], p=1) <= distance if zero.numel() and high.numel() else (
        torch.zeros(zero.numel(), high.numel(), dtype=torch.bool))
    conflicting = torch.zeros(len(merged), dtype=torch.bool)
    conflicting[zero[close.any(1)]] = True
    conflicting[high[close.any(0)]] = True
    kept = merged.subset(torch.nonzero(~conflicting).flatten())
    return kept, {"merged_groups": int((counts > 1).sum()), "merged_rows": int(counts[counts > 1].sum()),
                  "conflicting_rows": int(conflicting.sum())}


def split_indices(data: CompositionSet, split: str, seed: int) -> dict[str, torch.Tensor]:
    """``{"train", "val", "test"}`` -> int64 indices, 80/10/10. ``"random"``: rows shuffled with ``seed``.
    ``"family"``: chemical systems shuffled with ``seed`` and taken whole until each part holds its share of rows.
    ``"superconductors"``: the rows with Tc > 0 shuffled with ``seed`` (the others belong to no part)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    generator = torch.Generator().manual_seed(seed)
    n = len(data)
    if split in ("random", "superconductors"):
        rows = torch.arange(n) if split == "random" else torch.nonzero(data.targets > 0).flatten()
        n = rows.numel()
        order = rows[torch.randperm(n, generator=generator)]
        n_train, n_val = round(SPLIT_FRACTIONS[0] * n), round(SPLIT_FRACTIONS[1] * n)
        return {"train": order[:n_train], "val": order[n_train:n_train + n_val], "test": order[n_train + n_val:]}
    systems = data.systems()
    members: dict[str, list[int]] = {}
    for i, system in enumerate(systems):
        members.setdefault(system, []).append(i)
    names = list(members)
    parts: dict[str, list[int]] = {"test": [], "val": [], "train": []}
    quota = {"test": SPLIT_FRACTIONS[2] * n, "val": SPLIT_FRACTIONS[1] * n}
    for k in torch.randperm(len(names), generator=generator).tolist():
        rows = members[names[k]]
        part = next((p for p in ("test", "val") if len(parts[p]) + len(rows) / 2 <= quota[p]), "train")
        parts[part].extend(rows)
    empty = [part for part, rows in parts.items() if not rows]
    if empty:
        raise ValueError(f"the family split of {n} compositions in {len(names)} chemical systems leaves {empty} "
                         "empty: too few systems (use the random split)")
    return {part: torch.tensor(sorted(rows), dtype=torch.int64) for part, rows in parts.items()}


def iterate_batches(index: torch.Tensor, batch_size: int, generator: torch.Generator | None = None):
    """Slices of ``index`` of ``batch_size`` (shuffled with ``generator`` when given; the last one may be short)."""
    order = index[torch.randperm(index.numel(), generator=generator)] if generator is not None else index
    for start in range(0, order.numel(), batch_size):
        yield order[start:start + batch_size]
