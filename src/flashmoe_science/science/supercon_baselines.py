"""Classical baselines for the Tc model, on its data, features and splits: k-nearest neighbours, random forest,
extra trees and LightGBM (scikit-learn and LightGBM: the optional extra ``pip install -e ".[science]"``).

The features are the classic composition features the model's head also reads, here of the fixed periodic-table
properties: the composition as a vector of element fractions (96) and the fraction-weighted mean and standard
deviation, the max and the min of the 29 standardised element properties (:func:`composition_features`). kNN reads
the fraction vector alone (distances over unscaled property statistics would mean little). Each model trains on the
split's training rows; LightGBM stops adding trees when the validation rows stop improving; every number reported
is of the test rows, in kelvin, as ``supercon train`` reports them.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from flashmoe_science.bench.report import environment_metadata, resolve_commit, result_stem, unused_result_path
from flashmoe_science.errors import CommandError
from flashmoe_science.science.progress import progress_bar
from flashmoe_science.science.supercon_data import CONFLICT_DISTANCE, CONFLICT_TC_K, CompositionSet, split_indices
from flashmoe_science.science.supercon_model import ELEMENT_SYMBOLS
from flashmoe_science.science.supercon_model import composition_features as features_of_packed
from flashmoe_science.science.supercon_train import regression_metrics
from flashmoe_science.science.supercon_trees import MEMBERS, fit_member, science_modules

BASELINES = ("knn", "random_forest", "extra_trees", "lightgbm")
LABELS = {"ours": "ours", "ours_transformer": "ours, the transformer alone", "knn": "k-nearest neighbours (k=5), fractions only",
          "random_forest": "random forest", "extra_trees": "extra trees", "lightgbm": "LightGBM"}


def composition_features(data: CompositionSet) -> torch.Tensor:
    """``(N, 96 + 4 * 29)`` float32: the classic features of every composition of ``data``
    (:func:`~flashmoe_science.science.supercon_model.composition_features`)."""
    return features_of_packed(data.elements, data.fractions, data.offsets)


def fit_predict(name: str, features: torch.Tensor, targets: torch.Tensor, parts: dict[str, torch.Tensor], seed: int,
                trees: int, threads: int) -> torch.Tensor:
    """Trains baseline ``name`` on ``parts["train"]`` (LightGBM: early stopping on ``parts["val"]``) and returns its
    Tc predictions for ``parts["test"]`` (float32)."""
    if name not in BASELINES:
        raise ValueError(f"name must be one of {BASELINES}, got {name!r}")
    sklearn, _ = science_modules()
    x = {part: features[index].numpy() for part, index in parts.items()}
    y = {part: targets[index].numpy() for part, index in parts.items()}
    if name == "knn":
        fractions = slice(0, len(ELEMENT_SYMBOLS))
        model = sklearn.neighbors.KNeighborsRegressor(n_neighbors=5, n_jobs=threads)
        model.fit(x["train"][:, fractions], y["train"])
        return torch.from_numpy(model.predict(x["test"][:, fractions])).float()
    if name in MEMBERS:  # the same fits as the model's tree members
        model = fit_member(name, x, y, seed, trees, threads)
    else:
        model = sklearn.ensemble.RandomForestRegressor(n_estimators=trees, max_features=1 / 3, random_state=seed,
                                                       n_jobs=threads)
        model.fit(x["train"], y["train"])
    return torch.from_numpy(model.predict(x["test"])).float()


def run_baselines(data: CompositionSet, splits: list[str], seeds: list[int], models: list[str], trees: int = 300,
                  threads: int = 1, progress: bool = True) -> list[dict]:
    """Every model on every (split, seed): a record ``{"model", "split", "seed", "test": metrics, "seconds"}``."""
    features = composition_features(data)
    records = []
    bar = progress_bar(len(splits) * len(seeds) * len(models), "baselines", unit="fit", enabled=progress)
    for split in splits:
        for seed in seeds:
            parts = split_indices(data, split, seed)
            for name in models:
                started = time.perf_counter()
                predicted = fit_predict(name, features, data.targets, parts, seed, trees, threads)
                records.append({"model": name, "split": split, "seed": seed,
                                "test": regression_metrics(predicted, data.targets[parts["test"]]),
                                "seconds": time.perf_counter() - started})
                bar.set_postfix(model=name, split=split, seed=seed, r2=f"{records[-1]['test']['r2']:.3f}",
                                refresh=False)
                bar.update(1)
    bar.close()
    return records


def read_ours(folder: Path) -> list[dict]:
    """The records of the finished ``supercon train`` runs under ``folder`` (its ``metrics.json`` files, at any
    depth), as :func:`run_baselines` writes them: model ``"ours"`` (the trained model: the transformer blended with
    its tree members) and, for a blend, ``"ours_transformer"`` (its transformer alone, on the same test rows)."""
    records = []
    for path in sorted(Path(folder).rglob("metrics.json")):
        metrics = json.loads(path.read_text())
        settings = metrics["settings"]
        members = settings.get("members") or []
        size = (f"d={settings['model']['d_model']}, layers={settings['model']['num_layers']}, "
                f"experts={settings['model']['num_experts']}, epochs={settings['epochs']}, {metrics['device']}")
        common = {"split": metrics["split"], "seed": metrics["seed"], "seconds": metrics["train_seconds"],
                  "run": str(path.parent)}
        records.append({"model": "ours", **common, "test": metrics["test"],
                        "size": size + "".join(f" + {LABELS[name]}" for name in members)})
        if members:
            records.append({"model": "ours_transformer", **common, "size": size,
                            "test": metrics["members"]["transformer"]["test"]})
    if not records:
        raise CommandError(f"no finished `supercon train` run (metrics.json) under {folder}")
    return records


def read_earlier(path: Path) -> list[dict]:
    """The records of an earlier results file of :func:`write_results`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise CommandError(f"cannot read {path} as a supercon baselines result ({error})") from None
    if not isinstance(data, dict) or data.get("benchmark") != "supercon-baselines":
        raise CommandError(f"{path} is not a supercon baselines result (a supercon-baselines-*.json)")
    return data["records"]


def summarize(records: list[dict]) -> dict[str, dict[str, dict]]:
    """model -> split -> ``{"r2", "r2_spread", "mae_K", "mae_spread", "seeds", "sizes"}``: means over the seeds
    and their sample standard deviations (0 for one seed); ``sizes``: the model runs' sizes (ours only)."""
    grouped: dict[str, dict[str, list[dict]]] = {}
    for record in records:
        grouped.setdefault(record["model"], {}).setdefault(record["split"], []).append(record)
    summary: dict[str, dict[str, dict]] = {}
    for model, by_split in grouped.items():
        for split, rows in by_split.items():
            r2 = [row["test"]["r2"] for row in rows]
            mae = [row["test"]["mae_K"] for row in rows]
            summary.setdefault(model, {})[split] = {
                "r2": statistics.fmean(r2), "r2_spread": statistics.stdev(r2) if len(r2) > 1 else 0.0,
                "mae_K": statistics.fmean(mae), "mae_spread": statistics.stdev(mae) if len(mae) > 1 else 0.0,
                "seeds": sorted(row["seed"] for row in rows),
                "sizes": sorted({row["size"] for row in rows if "size" in row})}
    return summary


def markdown_table(summary: dict[str, dict[str, dict]], splits: list[str]) -> str:
    """One row per model, one column per split: test R² / MAE, mean ± standard deviation over the seeds."""
    header = ["model", *(f"{split}: R² / MAE (K)" for split in splits), "seeds"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    order = ["ours", "ours_transformer", *BASELINES]
    for model in sorted(summary, key=lambda m: order.index(m) if m in order else len(order)):
        cells = []
        for split in splits:
            entry = summary[model].get(split)
            cells.append("–" if entry is None else
                         f"{entry['r2']:.3f} ± {entry['r2_spread']:.3f} / {entry['mae_K']:.2f} ± "
                         f"{entry['mae_spread']:.2f}")
        seeds = sorted({seed for entry in summary[model].values() for seed in entry["seeds"]})
        sizes = sorted({size for entry in summary[model].values() for size in entry.get("sizes", ())})
        label = LABELS.get(model, model) + (f" ({'; '.join(sizes)})" if sizes else "")
        lines.append("| " + " | ".join([label, *cells, ",".join(map(str, seeds))]) + " |")
    return "\n".join(lines)


NOTE = ("Test R² and MAE (K) of each split's test rows, mean ± standard deviation over the split seeds. Baseline "
        "features: element fractions + fraction-weighted mean, standard deviation, max and min of 29 element "
        "properties; kNN: the fractions only; LightGBM: early stopping on the validation rows. Ours: the composition "
        "transformer blended with extra-trees and LightGBM members on the same features (convex weights fitted on "
        "the validation rows), all trained by `supercon train`; the transformer alone: its transformer member.")

CURATED_NOTE = (f"Curated labels (`--labels curated`, a dataset variant): repeated compositions merged at their median "
                f"Tc, and every pair of compositions within L1 {CONFLICT_DISTANCE} of the element fractions labelled "
                f"0 K and >= {CONFLICT_TC_K:g} K left out, before the splits; every model on the same rows. ")


def write_results(records: list[dict], splits: list[str], out_dir: Path, settings: dict,
                  commit: str | None = None) -> tuple[Path, str]:
    """``supercon-baselines-<machine>-<date>-<commit>.json`` (where and with what, the settings, every record, the
    summary) and the ``.md`` table beside it in ``out_dir``; a second run never overwrites the first."""
    summary = summarize(records)
    table = markdown_table(summary, splits)
    note = NOTE if settings.get("labels", "raw") == "raw" else CURATED_NOTE + NOTE
    record = {"benchmark": "supercon-baselines", **environment_metadata(resolve_commit(commit)), "note": note,
              "settings": settings, "splits": splits, "records": records, "summary": summary}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = unused_result_path(out_dir, "supercon-baselines-" + result_stem(record["gpu"], record["date"],
                                                                          record["commit"]))
    path.write_text(json.dumps(record, indent=2) + "\n")
    path.with_suffix(".md").write_text(f"{note}\n\n{table}\n")
    return path, table
