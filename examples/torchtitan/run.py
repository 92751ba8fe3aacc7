"""Train each model with TorchTitan's default kernels and with ours (same seed, same data) and compare.

    PYTHONPATH=src python examples/torchtitan/run.py --model qwen3_moe --gpus 1 --steps 300

Runs ``torchrun --nproc-per-node GPUS examples/torchtitan/train.py --module flashmoe_jobs --config
{model}_{titan,flash}`` (``--ours flash,flash_titan_dispatch``: more of ours; extra TorchTitan flags after ``--``),
reads TorchTitan's per-step log lines (loss, memory, tokens/s, TFLOPS, MFU of rank 0) and writes
``{out}/{model}_{gpus}gpu.csv``, ``.png`` (loss curves), ``.json`` (final loss, mean tokens/s and MFU after the first
10% of steps, peak memory, ours over TorchTitan's, the torch and GPU) and each run's log. A run stopped by
``--timeout`` keeps the steps it logged (``"timed_out": true``).

``--repeats N`` runs every job N times, interleaved (TorchTitan's first in even repeats, ours first in odd ones), so a
host whose speed drifts over minutes weighs on both kernel sets alike: on one H100 the same job's tokens/s moved by
up to 40% for tens of steps at a time, in both kernel sets' runs. The JSON then gives each run's tokens/s
(``tokens_per_s_repeats``), their mean (``tokens_per_s``) and the ratio of each repeat (``speedup_repeats``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+)\s+grad_norm:\s*([\d.]+).*?memory:\s*(-?[\d.]+)GiB.*?"
                  r"tps:\s*([\d,]+)\s+tflops:\s*([\d.,]+)\s+mfu:\s*([\d.]+)%")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def train(config: str, gpus: int, steps: int, extra: list[str], log_path: Path, timeout: float | None, *,
          launcher: Path = HERE / "train.py", module: str = "flashmoe_jobs") -> dict:
    """One TorchTitan run (``launcher`` under torchrun, job ``module.config``); its rows per step (TorchTitan's
    metrics of rank 0) and whether it finished."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               str(launcher), "--module", module, "--config", config, "--training.steps", str(steps), "--debug.seed", "0",
               "--metrics.log_freq", "1", *extra]
    print(" ".join(command), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    # a process group of its own: a timeout stops torchrun and every worker it started
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, timed_out = proc.communicate(timeout=timeout)[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun passes it on to the workers
        try:
            output = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0]
        timed_out = True
    returncode = proc.returncode
    log = ANSI.sub("", output)
    log_path.write_text(log)
    rows = [dict(step=int(m[1]), loss=float(m[2]), grad_norm=float(m[3]), memory_gib=float(m[4]),
                 tps=int(m[5].replace(",", "")), tflops=float(m[6].replace(",", "")), mfu=float(m[7]))
            for m in LINE.finditer(log)]
    rows = list({r["step"]: r for r in rows}.values())  # every rank logs; keep one line per step
    if not timed_out and returncode != 0:
        sys.stderr.write(log[-6000:])
        raise SystemExit(f"{config} failed (exit {returncode}); log: {log_path}")
    if not rows:
        raise SystemExit(f"{config} logged no step before {'its timeout' if timed_out else 'exiting'}; log: {log_path}")
    return dict(rows=rows, timed_out=timed_out)


def summary(run: dict) -> dict:
    rows = run["rows"]
    steady = [r for r in rows if r["step"] > max(1, len(rows) // 10)] or rows
    return dict(steps=len(rows), timed_out=run["timed_out"], final_loss=rows[-1]["loss"],
                tokens_per_s=sum(r["tps"] for r in steady) / len(steady),
                mfu_percent=sum(r["mfu"] for r in steady) / len(steady),
                peak_memory_gib=max(r["memory_gib"] for r in rows))


def compare(runs: dict[str, list[dict]], ours: list[str]) -> dict:
    """Each kernel set's summary over its repeats (``runs[kind]``: one ``train`` result per repeat), and each of ours
    against TorchTitan's: the ratio of mean tokens/s, the ratio per repeat, and the loss ratio at the last step both
    first runs reached."""
    result = {}
    for kind, repeats in runs.items():
        each = [summary(run) for run in repeats]
        rates = [s["tokens_per_s"] for s in each]
        result[kind] = dict(each[0], tokens_per_s=sum(rates) / len(rates),
                            mfu_percent=sum(s["mfu_percent"] for s in each) / len(each),
                            peak_memory_gib=max(s["peak_memory_gib"] for s in each),
                            timed_out=any(s["timed_out"] for s in each))
        if len(repeats) > 1:
            result[kind]["tokens_per_s_repeats"] = rates
    for kind in ours:  # the first of ours under the keys a single comparison has always had
        first, titan_first = runs[kind][0]["rows"], runs["titan"][0]["rows"]
        common = min(len(first), len(titan_first))
        keys = ("speedup_tokens_per_s", "loss_ratio_at_common_step") if kind == ours[0] else \
            (f"{kind}_speedup_tokens_per_s", f"{kind}_loss_ratio_at_common_step")
        result[keys[0]] = result[kind]["tokens_per_s"] / result["titan"]["tokens_per_s"]
        result[keys[1]] = dict(step=common, ratio=first[common - 1]["loss"] / titan_first[common - 1]["loss"])
        if len(runs[kind]) > 1:
            result[keys[0].replace("tokens_per_s", "repeats")] = [
                a / b for a, b in zip(result[kind]["tokens_per_s_repeats"], result["titan"]["tokens_per_s_repeats"])]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama_100m", "qwen3_moe"], required=True)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each job, interleaved (default 1)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run (default: none)")
    parser.add_argument("--out", default="results/torchtitan")
    parser.add_argument("--ours", default="flash",
                        help="our jobs, comma-separated: {model}_NAME in flashmoe_jobs (default flash; "
                        "flash_titan_dispatch: our kernels behind TorchTitan's EP dispatcher)")
    parser.add_argument("extra", nargs="*", help="TorchTitan flags for both runs (after --)")
    args = parser.parse_args()
    if args.gpus < 1 or args.steps < 1 or args.repeats < 1:
        raise ValueError(f"--gpus, --steps and --repeats must be >= 1, got {args.gpus}, {args.steps} and "
                         f"{args.repeats}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch_compat

    torch_compat.install()  # before any TorchTitan import
    from local_text import LocalTextDataLoader, write_docstring_corpus

    data = LocalTextDataLoader.Config()
    if not Path(data.dataset_path).exists():  # once here, not in every rank of both runs
        print(f"writing {data.dataset_path}", flush=True)
        write_docstring_corpus(Path(data.dataset_path), data.max_chars)
    stem = out / f"{args.model}_{args.gpus}gpu"
    ours = args.ours.split(",")
    jobs = {"titan": f"{args.model}_titan", **{kind: f"{args.model}_{kind}" for kind in ours}}
    runs = {kind: [] for kind in jobs}
    for repeat in range(args.repeats):
        order = list(jobs) if repeat % 2 == 0 else list(jobs)[::-1]
        for kind in order:
            log = Path(f"{stem}_{kind}.log" if args.repeats == 1 else f"{stem}_{kind}_r{repeat}.log")
            runs[kind].append(train(jobs[kind], args.gpus, args.steps, args.extra, log, args.timeout))
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["kernels", "repeat", "step", "loss", "grad_norm", "memory_gib", "tps",
                                               "tflops", "mfu"])
        writer.writeheader()
        for kind, repeats in runs.items():
            for repeat, run in enumerate(repeats):
                writer.writerows({"kernels": kind, "repeat": repeat, **r} for r in run["rows"])
    import torch

    result = compare(runs, ours)
    result["setup"] = dict(model=args.model, gpus=args.gpus, steps=args.steps, repeats=args.repeats,
                           extra=args.extra, jobs=jobs, torch=torch.__version__,
                           device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, repeats in runs.items():
        ax.plot([r["step"] for r in repeats[0]["rows"]], [r["loss"] for r in repeats[0]["rows"]],
                label=f"{kind} ({result[kind]['tokens_per_s']:,.0f} tokens/s)")
    ax.set(xlabel="step", ylabel="loss", title=f"{args.model}, {args.gpus} GPU(s), {result['setup']['device']}")
    ax.legend()
    fig.savefig(f"{stem}.png", dpi=120, bbox_inches="tight")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
