"""High-throughput screening: a streaming enumeration of candidate compositions, scored in large ragged batches, the
best N kept (memory flat in the number of candidates), resumable.

The candidates are partial substitutions of the known compositions: for every parent composition, every element
site A of amount a, every dopant element B of the data not already in the parent, and every level x of a grid, the
parent with ``A(a) -> A(a(1 - x)) B(a x)`` (x = 1 replaces A entirely). Candidate ``i`` is decoded from its index by
integer arithmetic on the device (no strings, no Python loop per candidate), so the enumeration needs no memory of
its own and a run can resume from any index. Formulas are written only for the N best.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flashmoe_science.errors import CommandError
from flashmoe_science.science.checkpoint import (
    CHECKPOINT_INTERVAL_S,
    Checkpoint,
    Interrupted,
    deferred_interrupt,
    save_atomic,
)
from flashmoe_science.science.formula import format_formula, parse_formula
from flashmoe_science.science.progress import progress_bar
from flashmoe_science.science.supercon_data import CompositionSet
from flashmoe_science.science.supercon_model import (
    ELEMENT_SYMBOLS,
    IMPLEMENTATIONS,
    CompositionTransformer,
    PackedBatch,
    PaddedBatch,
)

DEFAULT_LEVELS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 1.0)
STATE_FILE = "screen_state.pt"
STATE_FORMAT = "screen state 2"  # part of a run's signature: a state file of another layout is another run
HISTOGRAM_RANGE_K = (-20.0, 200.0)  # predictions outside fall into the first or last bin
HISTOGRAM_BINS = 220


class CandidateSpace:
    """Substitution candidates over ``parents`` (a CompositionSet; amounts are its fractions, which the
    substitution preserves in sum), with dopants ``dopants`` (element indices) and levels ``levels``."""

    def __init__(self, parents: CompositionSet, dopants: torch.Tensor, levels=DEFAULT_LEVELS,
                 device: torch.device | str = "cpu"):
        if len(parents) == 0:
            raise ValueError("parents must hold at least one composition")
        levels = torch.tensor(levels, dtype=torch.float32)
        if levels.numel() == 0 or not bool(((levels > 0) & (levels <= 1)).all()):
            raise ValueError(f"levels must be in (0, 1], got {levels.tolist()}")
        self.parents, self.device = parents, torch.device(device)
        lengths = parents.offsets[1:] - parents.offsets[:-1]
        self.max_parent_length = int(lengths.max())
        num = len(parents)
        # parent tables, padded: element indices and fractions (B, L)
        if not bool((parents.fractions > 0).all()):
            raise ValueError("parents must have positive fractions (an element of amount 0 is no element)")
        padded = parents.batch(torch.arange(num)).padded()
        present = torch.zeros(num, len(ELEMENT_SYMBOLS), dtype=torch.bool)
        present.scatter_(1, padded.elements, padded.mask)
        dopants = torch.unique(dopants)
        absent = ~present[:, dopants]  # (P, D): dopant d may go into parent p
        # the absent dopants of each parent first, in dopant order (a stable sort of "present" flags)
        order = torch.sort((~absent).to(torch.int8), dim=1, stable=True).indices
        self.dopant_table = dopants[order].to(self.device)  # (P, D)
        self.dopant_counts = absent.sum(1).to(self.device)  # (P,)
        self.parent_elements = padded.elements.to(self.device)
        self.parent_fractions = padded.fractions.to(self.device)
        self.parent_lengths = lengths.to(self.device)
        self.levels = levels.to(self.device)
        per_parent = lengths * absent.sum(1) * levels.numel()
        self.offsets = torch.zeros(num + 1, dtype=torch.int64)
        torch.cumsum(per_parent, 0, out=self.offsets[1:])
        self.size = int(self.offsets[-1])
        # the token counts on the host (token_count): a candidate has its parent's elements, plus the dopant's
        # when x < 1; the level is the fastest-varying digit of a candidate's index
        partial = (levels < 1).tolist()
        self._partial_prefix = [sum(partial[:j]) for j in range(len(partial) + 1)]
        tokens = per_parent * lengths + per_parent // levels.numel() * self._partial_prefix[-1]
        self._host_offsets = self.offsets.tolist()
        self._host_lengths = lengths.tolist()
        self._token_offsets = [0, *torch.cumsum(tokens, 0).tolist()]
        self.offsets = self.offsets.to(self.device)
        self.signature = hashlib.sha256(
            repr((parents.formulas, dopants.tolist(), levels.tolist())).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return self.size

    def decode(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Candidate indices (int64, on the device) -> (parent, site, dopant element, level value)."""
        parent = torch.searchsorted(self.offsets, index, right=True) - 1
        rest = index - self.offsets[parent]
        num_levels = self.levels.numel()
        level, rest = rest % num_levels, rest // num_levels
        count = self.dopant_counts[parent]
        rank, site = rest % count, rest // count
        return parent, site, self.dopant_table[parent, rank], self.levels[level]

    def token_count(self, stop: int) -> int:
        """Element tokens of candidates ``0:stop``, from host-side tables (no device work)."""
        if not 0 <= stop <= self.size:
            raise ValueError(f"stop must be in [0, {self.size}], got {stop}")
        if stop == self.size:
            return self._token_offsets[-1]
        parent = bisect.bisect_right(self._host_offsets, stop) - 1
        done = stop - self._host_offsets[parent]  # candidates of this parent before stop
        cycles, level = divmod(done, len(self._partial_prefix) - 1)
        return (self._token_offsets[parent] + done * self._host_lengths[parent]
                + cycles * self._partial_prefix[-1] + self._partial_prefix[level])

    def batch(self, start: int, stop: int, implementation: str) -> "PackedBatch | PaddedBatch":
        """Candidates ``start:stop`` in the form an implementation takes: ``"plain"`` a PaddedBatch, ``"fused"``
        a PackedBatch packed with the host's token count, so building a batch never waits for the device (the
        host decodes the next batch while the device scores this one)."""
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        padded = self.padded_batch(start, stop)
        if implementation == "plain":
            return padded
        return padded.packed(self.token_count(stop) - self.token_count(start))

    def padded_batch(self, start: int, stop: int) -> PaddedBatch:
        """Candidates ``start:stop`` as a PaddedBatch of width max parent length + 1 (the dopant's extra slot)."""
        index = torch.arange(start, stop, device=self.device)
        parent, site, dopant, level = self.decode(index)
        width = self.max_parent_length + 1
        elements = torch.zeros(index.numel(), width, dtype=torch.int64, device=self.device)
        fractions = torch.zeros(index.numel(), width, dtype=torch.float32, device=self.device)
        elements[:, :-1] = self.parent_elements[parent]
        fractions[:, :-1] = self.parent_fractions[parent]
        rows = torch.arange(index.numel(), device=self.device)
        site_fraction = fractions[rows, site]
        full = level >= 1
        # x = 1: the dopant takes the site; x < 1: the site keeps a(1 - x) and the dopant (a x) goes after the
        # parent's last element
        elements[rows, site] = torch.where(full, dopant, elements[rows, site])
        fractions[rows, site] = site_fraction * torch.where(full, 1.0, 1.0 - level)
        extra = self.parent_lengths[parent]
        elements[rows, extra] = torch.where(full, 0, dopant)
        fractions[rows, extra] = torch.where(full, 0.0, site_fraction * level)
        mask = fractions > 0
        return PaddedBatch(elements, fractions, mask)

    def formula(self, index: int) -> str:
        """Candidate ``index`` written in its parent's amounts (``La2Cu1O4``, Sr for La at 0.1 ->
        ``La1.8Sr0.2Cu1O4``)."""
        parent, site, dopant, level = self._decode_one(index)
        composition: dict[str, float] = {}
        for position, (symbol, amount) in enumerate(parse_formula(self.parents.formulas[parent]).items()):
            if position != site:
                composition[symbol] = amount
                continue
            if level < 1:
                composition[symbol] = amount * (1 - level)
            composition[ELEMENT_SYMBOLS[dopant]] = amount * level
        return format_formula(composition)

    def _decode_one(self, index: int) -> tuple:
        return tuple(t.item() for t in self.decode(torch.tensor([index], device=self.device)))

    def substitution(self, index: int) -> dict:
        """Candidate ``index`` as a chemist reads it: the parent formula and its measured Tc, and the substitution
        (``"Sr for La, x = 0.1"``: a fraction x of the La site's amount replaced by Sr)."""
        parent, site, dopant, level = self._decode_one(index)
        site_symbol = list(parse_formula(self.parents.formulas[parent]))[site]
        return {"parent": self.parents.formulas[parent], "parent_Tc_K": round(float(self.parents.targets[parent]), 2),
                "substitution": f"{ELEMENT_SYMBOLS[dopant]} for {site_symbol}, x = {level:g}"}

    def fraction_vectors(self, index: torch.Tensor) -> torch.Tensor:
        """Candidates ``index`` as element-fraction vectors ``(len(index), 96)`` float32 (CPU)."""
        vectors = [self.padded_batch(i, i + 1) for i in index.tolist()]
        return torch.cat([torch.zeros(1, len(ELEMENT_SYMBOLS), device=self.device).scatter_add_(
            1, batch.elements, batch.fractions) for batch in vectors]).cpu()


# no_grad, not inference_mode: inference tensors have no version counter, so flash_attention_varlen would check the
# batch's cu_seqlens in every layer instead of once
@torch.no_grad()
def score(model: CompositionTransformer, batch: PackedBatch | PaddedBatch, implementation: str,
          mc_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) predicted Tc of a batch of candidates (the whole model: the transformer with the library build
    (packed; a PaddedBatch is packed here) or the plain one, and its tree members when it has them)."""
    if implementation == "fused" and isinstance(batch, PaddedBatch):
        batch = batch.packed()
    return model.predict_samples(batch, mc_samples)


@dataclass
class ScreenState:
    """The running top-K and where the enumeration stands: all a resumed run needs."""

    next_index: int
    scores: torch.Tensor  # (K,) float32, -inf where empty
    stds: torch.Tensor
    indices: torch.Tensor  # (K,) int64, -1 where empty
    histogram: torch.Tensor  # (HISTOGRAM_BINS,) int64: every screened candidate's predicted Tc, binned

    @classmethod
    def empty(cls, keep: int, device) -> "ScreenState":
        return cls(0, torch.full((keep,), -torch.inf, device=device), torch.zeros(keep, device=device),
                   torch.full((keep,), -1, dtype=torch.int64, device=device),
                   torch.zeros(HISTOGRAM_BINS, dtype=torch.int64, device=device))

    @classmethod
    def from_dict(cls, saved: dict) -> "ScreenState":
        return cls(saved["next_index"], saved["scores"], saved["stds"], saved["indices"], saved["histogram"])

    def to_dict(self, signature: str | None) -> dict:
        """Tensors and plain values (``torch.load(..., weights_only=True)`` reads them back)."""
        return {"signature": signature, "next_index": self.next_index, "scores": self.scores, "stds": self.stds,
                "indices": self.indices, "histogram": self.histogram}

    def merge(self, scores: torch.Tensor, stds: torch.Tensor, start: int) -> None:
        low, high = HISTOGRAM_RANGE_K
        bins = ((scores.float().clamp(low, high - 1e-3) - low) * (HISTOGRAM_BINS / (high - low))).long()
        self.histogram += torch.bincount(bins, minlength=HISTOGRAM_BINS)
        indices = torch.arange(start, start + scores.numel(), device=scores.device)
        all_scores = torch.cat([self.scores, scores.float()])
        best = torch.topk(all_scores, self.scores.numel()).indices
        self.scores = all_scores[best]
        self.stds = torch.cat([self.stds, stds.float()])[best]
        self.indices = torch.cat([self.indices, indices])[best]


def run_signature(model: CompositionTransformer, space: CandidateSpace, keep: int, implementation: str,
                  mc_samples: int) -> str:
    """What the running top-K depends on: the candidate space, the model's weights and dtype, how it is scored."""
    digest = hashlib.sha256(repr((STATE_FORMAT, space.signature, keep, implementation, mc_samples)).encode())
    for tensor in model.state_dict().values():
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def screen(model: CompositionTransformer, space: CandidateSpace, *, top: int, batch_size: int,
           implementation: str, mc_samples: int, limit: int | None = None, out_dir: Path | None = None,
           restart: bool = False, checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S, progress: bool = True,
           known: CompositionSet | None = None) -> dict:
    """Scores candidates ``0:limit`` (all by default) in batches of ``batch_size``; keeps the ``top`` best (by the
    model's mean). With ``out_dir``: the state is saved there every ``checkpoint_interval_s`` seconds and on
    Ctrl-C (raising :class:`Interrupted`), a later call with the same model and settings continues from it
    (``restart``: starts over), and ``top.csv`` (:func:`write_top`; ``known``: the measured compositions, for each
    candidate's nearest) and ``candidates.png`` (:func:`plot_candidates`) are written at the end. Returns a summary
    (candidates, seconds, candidates/s)."""
    if top < 1 or batch_size < 1:
        raise ValueError(f"top and batch_size must be >= 1, got top={top}, batch_size={batch_size}")
    stop = len(space) if limit is None else min(limit, len(space))
    keep = 2 * top  # room for the duplicates dropped when the formulas are written
    state_path = None if out_dir is None else out_dir / STATE_FILE
    state = ScreenState.empty(keep, space.device)
    signature = None
    if state_path is not None:
        signature = run_signature(model, space, keep, implementation, mc_samples)
        if restart:
            state_path.unlink(missing_ok=True)
        elif state_path.is_file():
            saved = torch.load(state_path, map_location=space.device, weights_only=True)
            if saved["signature"] != signature:
                raise CommandError(f"{out_dir} holds a screening run of another model, candidate space, --top, "
                                   "--implementation, --mc-samples or --dtype: add --restart to start over, or "
                                   "choose another --out")
            state = ScreenState.from_dict(saved)
    first = state.next_index
    model.eval()
    bar = progress_bar(stop, f"screen ({implementation})", unit="cand", enabled=progress, unit_scale=True,
                       initial=min(first, stop))
    synchronize = torch.cuda.synchronize if space.device.type == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    with deferred_interrupt() as interrupt:
        checkpoint = None if state_path is None else Checkpoint(state_path, checkpoint_interval_s)
        for start in range(first, stop, batch_size):
            end = min(start + batch_size, stop)
            scores, stds = score(model, space.batch(start, end, implementation), implementation, mc_samples)
            state.merge(scores, stds, start)
            state.next_index = end
            bar.update(end - start)
            if checkpoint is not None and (checkpoint.due() or interrupt.requested):
                checkpoint.save(state.to_dict(signature))
            if interrupt.requested:
                bar.close()
                raise Interrupted(state_path) if checkpoint is not None else KeyboardInterrupt
    synchronize()
    seconds = time.perf_counter() - started
    bar.close()
    screened = max(0, stop - first)
    summary = {"candidates": screened, "screened_total": state.next_index, "space_size": len(space),
               "seconds": seconds, "candidates_per_s": screened / seconds if seconds > 0 else float("nan"),
               "implementation": implementation, "batch_size": batch_size, "mc_samples": mc_samples}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_atomic(state.to_dict(signature), state_path)
        top_csv, rows = write_top(space, state, top, out_dir / "top.csv", known)
        summary["top_csv"] = str(top_csv)
        summary["plot"] = str(plot_candidates(state, rows, out_dir / "candidates.png"))
        (out_dir / "screen_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_top(space: CandidateSpace, state: ScreenState, top: int, path: Path,
              known: CompositionSet | None = None) -> tuple[Path, list[dict]]:
    """The ``top`` best distinct formulas as CSV: rank, formula, predicted Tc and its uncertainty (the model's std:
    the transformer's MC-dropout spread, with tree members also theirs and the members' disagreement),
    the parent, its measured Tc and the substitution; with ``known`` (the measured compositions) also the nearest
    known composition (L1 distance of the element-fraction vectors, 0 to 2), its measured Tc and the distance.
    Returns the path and the rows."""
    rows, seen = [], set()
    for score_value, std, index in zip(state.scores.tolist(), state.stds.tolist(), state.indices.tolist()):
        if index < 0 or len(rows) == top:
            break
        formula = space.formula(index)
        if formula in seen:
            continue
        seen.add(formula)
        rows.append({"rank": len(rows) + 1, "formula": formula, "predicted_Tc_K": round(score_value, 2),
                     "uncertainty_K": round(std, 2), **space.substitution(index), "candidate_index": index})
    if known is not None and rows:
        nearest, distance = nearest_known(space.fraction_vectors(torch.tensor([r["candidate_index"] for r in rows])),
                                          known)
        for row, k, d in zip(rows, nearest.tolist(), distance.tolist()):
            row.update(nearest_known=known.formulas[k], nearest_known_Tc_K=round(float(known.targets[k]), 2),
                       nearest_distance=round(d, 4))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["rank", "formula"])
        writer.writeheader()
        writer.writerows(rows)
    return path, rows


def nearest_known(vectors: torch.Tensor, known: CompositionSet, chunk: int = 256) -> tuple[torch.Tensor, ...]:
    """For each element-fraction vector ``(M, 96)``, the index of the nearest composition of ``known`` (L1
    distance) and that distance."""
    reference = known.fraction_vectors()
    best = [torch.cdist(vectors[start:start + chunk], reference, p=1).min(1) for start in range(0, len(vectors), chunk)]
    return torch.cat([b.indices for b in best]), torch.cat([b.values for b in best])


def plot_candidates(state: ScreenState, rows: list[dict], path: Path) -> Path:
    """Left: the predicted Tc of every screened candidate (histogram, log counts), the top N's threshold marked.
    Right: the top N's predicted Tc against their nearest known composition's measured Tc, with uncertainty bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    low, high = HISTOGRAM_RANGE_K
    edges = torch.linspace(low, high, HISTOGRAM_BINS + 1)
    counts = state.histogram.cpu().double()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.stairs(counts.numpy(), edges.numpy(), fill=True, alpha=0.6)
    left.set(yscale="log", xlabel="predicted Tc (K)", ylabel="candidates",
             title=f"{int(counts.sum()):,} candidates screened")
    if rows:
        left.axvline(rows[-1]["predicted_Tc_K"], color="black", linewidth=0.8, linestyle="--",
                     label=f"top {len(rows)}")
        left.legend()
    if rows and "nearest_known_Tc_K" in rows[0]:
        known = [r["nearest_known_Tc_K"] for r in rows]
        predicted = [r["predicted_Tc_K"] for r in rows]
        right.errorbar(known, predicted, yerr=[r["uncertainty_K"] for r in rows], fmt="o", markersize=3,
                       alpha=0.6, elinewidth=0.6)
        top = max(max(known), max(predicted)) * 1.05 + 1
        right.plot([0, top], [0, top], color="black", linewidth=0.8)
        right.set(xlim=(0, top), ylim=(0, top))
    right.set(xlabel="measured Tc of the nearest known composition (K)", ylabel="predicted Tc (K)",
              title=f"top {len(rows)} candidates")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def dopant_elements(data: CompositionSet, min_count: int = 1) -> torch.Tensor:
    """Element indices appearing in at least ``min_count`` compositions of ``data``."""
    counts = torch.bincount(data.elements, minlength=len(ELEMENT_SYMBOLS))
    return torch.nonzero(counts >= min_count).flatten()
