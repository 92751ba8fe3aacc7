"""The example's outputs: ``megatron-train.json`` (envelope, one record per run, the comparison), ``.csv`` (every
step of every run) and ``.png`` (loss curves, tokens/s, the loss gap).

The comparison (``summary``), when both kernel sets ran: ``speedup`` and ``final_loss_ratio`` (flashmoe over local,
means over repeats), the same two per repeat (``per_repeat``), each kernel set's run-to-run ``final_loss_spread``
((max - min) / mean over its repeats: what the same kernels give twice, the scale a flashmoe/local difference is
read against), and ``loss_gap_max``: the largest |flashmoe / local - 1| over every step of the two mean loss curves
(each step's loss averaged over repeats, then a trailing mean over ``WINDOW`` steps, since single steps' losses
swing with their batch), and ``loss_spikes``: per run, the steps whose loss exceeds ``SPIKE`` times the median of
the ``WINDOW`` steps before (one spike moves a ``WINDOW``-step mean by several percent: a gap there is read with
the spikes beside it).

``loss_comparison`` reads the loss curves at matched steps (a run stopped by its time limit is compared over the
steps both runs reached, where ``final_loss_ratio`` sets its last 10 steps against the other run's): per repeat,
flashmoe's run against local's, and per kernel set, its repeat 1 against its repeat 0, the same measures on both
(``compare_losses``), so a gap between the kernel sets is read beside what the same kernels give twice.
``python train_outputs.py megatron-train.csv`` prints it for a written CSV.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

WINDOW = 10  # steps in the trailing mean of the loss curves compared
SPIKE = 1.15  # a step's loss over this many times the median of the WINDOW steps before: a spike
FIRST_STEP = 10  # loss comparisons start here: the steps before fall by nats each (lr warmup from log(vocab))


def write_outputs(out: Path, head: dict, results: list[dict]) -> dict:
    """Writes the three files under ``out``; ``results``: ``{"record", "rows"}`` per run, in run order."""
    out.mkdir(parents=True, exist_ok=True)
    document = {**head, "records": [result["record"] for result in results], "summary": summarize(results)}
    (out / "megatron-train.json").write_text(json.dumps(document, indent=1) + "\n")
    with open(out / "megatron-train.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["run", "repeat", "kernels", "step", "loss", "tokens_per_s"])
        writer.writeheader()
        for index, result in enumerate(results):
            for row in result["rows"]:
                writer.writerow({"run": index, "repeat": result["record"]["repeat"], **row})
    plot(out / "megatron-train.png", head, results)
    return document


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def by_kernels(results: list[dict]) -> dict[str, list[dict]]:
    grouped = {}
    for result in results:
        grouped.setdefault(result["record"]["kernels"], []).append(result)
    return grouped


def smoothed_curve(runs: list[dict]) -> list[float]:
    """The runs' per-step loss averaged over runs (the steps every run reached), then a trailing mean over
    ``WINDOW`` steps (fewer at the start)."""
    steps = min(len(run["rows"]) for run in runs)
    per_step = [_mean(run["rows"][step]["loss"] for run in runs) for step in range(steps)]
    return [_mean(per_step[max(0, step - WINDOW + 1):step + 1]) for step in range(steps)]


def loss_gap(grouped: dict[str, list[dict]]) -> list[float]:
    """flashmoe / local - 1 of the smoothed mean loss curves, per step both reached."""
    ours, theirs = smoothed_curve(grouped["flashmoe"]), smoothed_curve(grouped["local"])
    return [a / b - 1 for a, b in zip(ours, theirs)]


def loss_spikes(rows: list[dict]) -> list[list]:
    """``[step, loss]`` of every step whose loss exceeds ``SPIKE`` times the median of the ``WINDOW`` before."""
    losses = [row["loss"] for row in rows]
    found = []
    for step in range(WINDOW, len(losses)):
        before = sorted(losses[step - WINDOW:step])
        median = (before[(WINDOW - 1) // 2] + before[WINDOW // 2]) / 2
        if losses[step] > SPIKE * median:
            found.append([rows[step]["step"], losses[step]])
    return found


def _pair(ours: list[dict], theirs: list[dict]) -> dict:
    rate = _mean(r["record"]["tokens_per_s"] or 0 for r in theirs)
    return {"speedup": _mean(r["record"]["tokens_per_s"] or 0 for r in ours) / rate if rate else None,
            "final_loss_ratio": (_mean(r["record"]["final_loss"] for r in ours)
                                 / _mean(r["record"]["final_loss"] for r in theirs))}


def compare_losses(ours: list[dict], theirs: list[dict]) -> dict | None:
    """Two runs' rows over the steps from FIRST_STEP on that both reached: ``window_ratio``, the mean loss of the
    last WINDOW of those steps, ``ours`` over ``theirs``; ``gap_mean`` and ``gap_mean_abs``, the mean over those
    steps of ours / theirs - 1 and of its magnitude; ``steps``, the first and last step compared. None when they
    share fewer than WINDOW such steps."""
    steps = min(len(ours), len(theirs))
    if steps - FIRST_STEP < WINDOW:
        return None
    a, b = ([row["loss"] for row in run[FIRST_STEP:steps]] for run in (ours, theirs))
    gaps = [x / y - 1 for x, y in zip(a, b)]
    return {"steps": [ours[FIRST_STEP]["step"], ours[steps - 1]["step"]],
            "window_ratio": _mean(a[-WINDOW:]) / _mean(b[-WINDOW:]),
            "gap_mean": _mean(gaps), "gap_mean_abs": _mean(abs(gap) for gap in gaps)}


def loss_comparison(results: list[dict]) -> dict:
    """``per_repeat``: flashmoe's run against local's of the same repeat; ``repeat_to_repeat``: per kernel set, its
    repeat 1 against its repeat 0 (None with one repeat); each by ``compare_losses``."""
    runs = {(r["record"]["kernels"], r["record"]["repeat"]): r["rows"] for r in results}
    repeats = sorted({repeat for _, repeat in runs})
    return {"first_step": FIRST_STEP, "window": WINDOW,
            "per_repeat": [{"repeat": repeat, **(compare_losses(runs[("flashmoe", repeat)], runs[("local", repeat)])
                                                  or {})}
                           for repeat in repeats if ("flashmoe", repeat) in runs and ("local", repeat) in runs],
            "repeat_to_repeat": {kernels: (compare_losses(runs[(kernels, 1)], runs[(kernels, 0)])
                                           if (kernels, 1) in runs and (kernels, 0) in runs else None)
                                 for kernels in dict.fromkeys(k for k, _ in runs)}}


def read_csv(path: Path) -> list[dict]:
    """A written ``megatron-train.csv`` as ``{"record": {"kernels", "repeat"}, "rows"}`` per run, in run order: what
    ``loss_comparison`` reads."""
    runs = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            run = runs.setdefault(int(row["run"]), {"record": {"kernels": row["kernels"],
                                                               "repeat": int(row["repeat"])}, "rows": []})
            run["rows"].append({"kernels": row["kernels"], "step": int(row["step"]), "loss": float(row["loss"]),
                                "tokens_per_s": float(row["tokens_per_s"])})
    return [runs[index] for index in sorted(runs)]


def summarize(results: list[dict]) -> dict:
    """The comparison described in the module docstring (``{"speedup": None}`` unless both kernel sets ran)."""
    grouped = by_kernels(results)
    if not {"flashmoe", "local"} <= grouped.keys():
        return {"speedup": None}
    def of(kernels, repeat):
        return [r for r in grouped[kernels] if r["record"]["repeat"] == repeat]

    repeats = sorted({r["record"]["repeat"] for r in results})
    per_repeat = [{"repeat": repeat, **_pair(of("flashmoe", repeat), of("local", repeat))}
                  for repeat in repeats if of("flashmoe", repeat) and of("local", repeat)]
    spread = {}
    for kernels, runs in grouped.items():
        losses = [r["record"]["final_loss"] for r in runs]
        spread[kernels] = (max(losses) - min(losses)) / _mean(losses) if len(losses) > 1 else None
    gap = loss_gap(grouped)
    return {**_pair(grouped["flashmoe"], grouped["local"]), "per_repeat": per_repeat, "final_loss_spread": spread,
            "loss_gap_max": max(abs(g) for g in gap), "loss_gap_window": WINDOW, "loss_gap_steps": len(gap),
            "loss_spikes": {f"{r['record']['kernels']} repeat {r['record']['repeat']}": loss_spikes(r["rows"])
                            for r in results},
            "loss_comparison": loss_comparison(results)}


def plot(path: Path, head: dict, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, rate_axis, gap_axis) = plt.subplots(1, 3, figsize=(17, 4.5))
    for result in results:
        rows, record = result["rows"], result["record"]
        label = f"{record['kernels']} (repeat {record['repeat']})"
        loss_axis.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=label, linewidth=1)
        rate_axis.plot([r["step"] for r in rows], [r["tokens_per_s"] for r in rows], label=label, linewidth=1)
    grouped = by_kernels(results)
    if {"flashmoe", "local"} <= grouped.keys():
        gap = loss_gap(grouped)
        gap_axis.plot(range(len(gap)), [100 * g for g in gap], color="black")
        for bound in (-1, 1):
            gap_axis.axhline(bound, color="red", linestyle="--", linewidth=0.8)
    loss_axis.set(xlabel="step", ylabel="loss", title="language-model loss")
    rate_axis.set(xlabel="step", ylabel="tokens/s", title="throughput (all ranks)")
    gap_axis.set(xlabel="step", ylabel="%", title=f"loss, flashmoe / local - 1 ({WINDOW}-step means over repeats)")
    for axis in (loss_axis, rate_axis):
        axis.legend(fontsize=8)
    for axis in (loss_axis, rate_axis, gap_axis):
        axis.grid(alpha=0.3)
    model = head["model"]
    figure.suptitle(f"Megatron-core GPT-MoE ({model['parameters'] / 1e6:.0f}M parameters, "
                    f"{model['active_parameters'] / 1e6:.0f}M active) on {head['gpu']}, commit {head['commit']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    print(json.dumps(loss_comparison(read_csv(Path(sys.argv[1]))), indent=1))
