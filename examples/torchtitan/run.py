"""Train each model with TorchTitan's default kernels and with ours (same seed, same data) and compare.

    PYTHONPATH=src:examples/torchtitan python examples/torchtitan/run.py --model qwen3_moe --gpus 1 --steps 300

Runs ``torchrun --nproc-per-node GPUS -m torchtitan.train --module flashmoe_jobs --config {model}_{titan,flash}``
(extra TorchTitan flags after ``--``), reads TorchTitan's per-step log lines (loss, memory, tps, tflops, mfu) and
writes ``results/torchtitan/{model}_{gpus}gpu.csv``, ``.png`` (loss curves) and ``.json`` (final loss, mean tokens/s
and MFU after the first 10% of steps, peak memory, and ours over TorchTitan's).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)\s+"
                  r"tflops:\s*([\d.,]+)\s+mfu:\s*([\d.]+)%")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def train(config: str, gpus: int, steps: int, extra: list[str]) -> list[dict]:
    command = ["torchrun", f"--nproc-per-node={gpus}", "-m", "torchtitan.train", "--module", "flashmoe_jobs",
               "--config", config, "--training.steps", str(steps), "--debug.seed", "0",
               "--metrics.log_freq", "1", *extra]
    print(" ".join(command), flush=True)
    proc = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    log = ANSI.sub("", proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.stderr.write(log[-6000:])
        raise SystemExit(f"{config} failed (exit {proc.returncode})")
    rows = [dict(step=int(m[1]), loss=float(m[2]), memory_gib=float(m[3]), tps=int(m[4].replace(",", "")),
                 tflops=float(m[5].replace(",", "")), mfu=float(m[6])) for m in LINE.finditer(log)]
    return list({r["step"]: r for r in rows}.values())  # rank 0's line per step


def summary(rows: list[dict]) -> dict:
    steady = [r for r in rows if r["step"] > max(1, len(rows) // 10)]
    return dict(final_loss=rows[-1]["loss"], tokens_per_s=sum(r["tps"] for r in steady) / len(steady),
                mfu_percent=sum(r["mfu"] for r in steady) / len(steady),
                peak_memory_gib=max(r["memory_gib"] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama_100m", "qwen3_moe"], required=True)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="results/torchtitan")
    parser.add_argument("extra", nargs="*", help="TorchTitan flags for both runs (after --)")
    args = parser.parse_args()
    runs = {kind: train(f"{args.model}_{kind}", args.gpus, args.steps, args.extra) for kind in ("titan", "flash")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{args.model}_{args.gpus}gpu"
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["kernels", "step", "loss", "memory_gib", "tps", "tflops", "mfu"])
        writer.writeheader()
        for kind, rows in runs.items():
            writer.writerows({"kernels": kind, **r} for r in rows)
    result = {kind: summary(rows) for kind, rows in runs.items()}
    result["speedup_tokens_per_s"] = result["flash"]["tokens_per_s"] / result["titan"]["tokens_per_s"]
    result["final_loss_ratio"] = result["flash"]["final_loss"] / result["titan"]["final_loss"]
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, rows in runs.items():
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows],
                label=f"{kind} ({result[kind]['tokens_per_s']:,.0f} tokens/s)")
    ax.set(xlabel="step", ylabel="loss", title=f"{args.model}, {args.gpus} GPU(s)")
    ax.legend()
    fig.savefig(f"{stem}.png", dpi=120, bbox_inches="tight")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
