"""Tree models of the Tc model on two feature sets, side by side on the project's splits: the classic features
(``supercon_model.composition_features``: fractions + fraction-weighted mean, std, max, min of 29 properties) and
the Magpie-style descriptors (``supercon_features.magpie_features``). Each fit is the tree member's own
(``supercon_trees.fit_member``: extra trees, LightGBM with early stopping on the validation rows); the numbers are of
the test rows. One thread per fit: LightGBM's OpenMP threads on a shared 2-core machine slow it down tenfold.

    PYTHONPATH=src python benchmarks/tools/supercon_feature_sets.py --seeds 0,1,2 --out feature_sets.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

from flashmoe_science.science.supercon_data import SPLITS, load_supercon, split_indices
from flashmoe_science.science.supercon_features import magpie_features
from flashmoe_science.science.supercon_model import composition_features
from flashmoe_science.science.supercon_train import regression_metrics
from flashmoe_science.science.supercon_trees import MEMBERS, fit_member


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--splits", default=",".join(SPLITS))
    parser.add_argument("--models", default=",".join(MEMBERS))
    parser.add_argument("--trees", type=int, default=100, help="extra trees' tree count (the member's default)")
    parser.add_argument("--out", default="feature_sets.jsonl")
    args = parser.parse_args()
    data, _ = load_supercon()
    features = {"classic": composition_features(data.elements, data.fractions, data.offsets),
                "magpie": magpie_features(data.elements, data.fractions, data.offsets)}
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for split in args.splits.split(","):
            parts = split_indices(data, split, seed)
            y = {part: data.targets[index].numpy() for part, index in parts.items()}
            for name, table in features.items():
                x = {part: table[index].numpy() for part, index in parts.items()}
                for model in args.models.split(","):
                    start = time.perf_counter()
                    fitted = fit_member(model, x, y, seed, args.trees, 1)
                    predicted = torch.from_numpy(fitted.predict(x["test"])).float()
                    row = {"seed": seed, "split": split, "features": name, "model": model,
                           "seconds": round(time.perf_counter() - start, 1),
                           **regression_metrics(predicted, data.targets[parts["test"]])}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    with open(args.out, "w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    groups = collections.defaultdict(list)
    for row in rows:
        groups[(row["model"], row["features"], row["split"])].append(row)
    for (model, name, split), group in sorted(groups.items()):
        r2, mae = [r["r2"] for r in group], [r["mae_K"] for r in group]
        spread = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)
        print(f"| {model} | {name} | {split} | {statistics.mean(r2):.3f} ± {spread(r2):.3f} | "
              f"{statistics.mean(mae):.2f} ± {spread(mae):.2f} | {len(group)} |")


if __name__ == "__main__":
    main()
