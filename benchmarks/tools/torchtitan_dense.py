"""TorchTitan's dense Llama job on our attention against its Flex defaults: interleaved repeats (one process per
run) and the first step of a fresh process on an empty Triton cache, after `warmup`, and Flex's.

The job is examples/torchtitan's (``flashmoe_jobs.{model}_titan`` / ``_flash``; default ``llama_100m``: ~90M, 12
layers, 16 x 2048 tokens a step of packed documents, byte tokens of a local text, bf16, eager) run through
``examples/torchtitan/run.py``'s ``train`` and compared by its ``compare``. The runs, in order, each a new process:

- repeat 0: TorchTitan's on empty Triton and Inductor caches (Flex's first step compiles and autotunes its
  kernels), then ours on an empty Triton cache;
- `warmup` of the job's attention cases (`integrations.torchtitan.warmup_cases`) into another empty cache, timed;
- repeat 1: ours on that cache (its first step after warmup), then TorchTitan's (its caches warm);
- later repeats alternate the order again, on warm caches.

A run's first-step time is read from TorchTitan's own log lines: from "Training starts" to the line of step 1 (the
first batch, forward, backward and optimizer step, compiles included); its steady rate is run.py's (the mean of
the steps after the first 10%), with the median and the 10th/90th percentiles beside it. ``--deadline`` bounds the
whole measurement: a run gets at most what is left (TorchTitan's first, cold, run the most) and keeps the steps
it logged; no run starts with less than a minute left. Writes ``{out}/torchtitan_dense.json`` (records as
benchmarks/results/ keeps them, the comparison, the first steps), ``{out}/runs.log`` (every run's log) and
``{out}/steps.csv`` (every logged step), rewritten after each run.

    PYTHONPATH=src python benchmarks/tools/torchtitan_dense.py --out $OUT --steps 100 --repeats 3
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "torchtitan"
STAMP = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
                   r".*?(Training starts at step|step:\s*(\d+)\s+loss)")
KERNELS = {"titan": "TorchTitan defaults (flex attention)", "flash": "flashmoe (varlen attention)"}
MIN_RUN_S = 60


def _stamps(log: str) -> tuple[float | None, dict[int, float]]:
    """(the time TorchTitan logged "Training starts", {step: the time its metrics line was logged}), in seconds."""
    start, steps = None, {}
    for match in STAMP.finditer(log):
        seconds = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if match[3] is None:
            start = seconds
        else:
            steps.setdefault(int(match[3]), seconds)
    return start, steps


def first_steps(log: str, launched: float, count: int = 5) -> dict:
    """The first-step times of one run's log: ``setup_s`` (process launch to "Training starts": imports, model,
    data), ``first_step_s`` (to step 1's line), ``step_s`` (steps 2..count, each from the line before) and
    ``slow_steps`` (later steps over 5 times the median step, as [step, seconds]: a kernel compiled mid-run)."""
    start, steps = _stamps(log)
    if start is None or 1 not in steps:
        return dict(setup_s=None if start is None else start - launched, first_step_s=None, step_s=[],
                    slow_steps=[])
    times = {i: steps[i] - steps[i - 1] for i in sorted(steps) if i > 1 and i - 1 in steps}
    typical = statistics.median(times.values()) if times else 0.0
    return dict(setup_s=start - launched, first_step_s=steps[1] - start,
                step_s=[times[i] for i in range(2, count + 1) if i in times],
                slow_steps=[[i, round(t, 3)] for i, t in times.items() if i > count and t > 5 * typical])


def spread(rows: list[dict]) -> dict:
    """The steady steps' tokens/s (after the first 10%, as run.summary): median and 10th / 90th percentiles."""
    steady = [r["tps"] for r in rows if r["step"] > max(1, len(rows) // 10)] or [r["tps"] for r in rows]
    if len(steady) < 2:
        return dict(tokens_per_s_median=steady[0], tokens_per_s_p10=steady[0], tokens_per_s_p90=steady[0])
    deciles = statistics.quantiles(steady, n=10)
    return dict(tokens_per_s_median=statistics.median(steady), tokens_per_s_p10=deciles[0],
                tokens_per_s_p90=deciles[-1])


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _caches(root: Path, name: str) -> dict:
    return {"TRITON_CACHE_DIR": str(root / name / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(root / name / "inductor")}


def _warmup_child(model: str) -> None:
    """In a process of its own (its Triton cache from the environment): `warmup` of the job's attention cases."""
    sys.path.insert(0, str(EXAMPLES))
    import torch_compat

    torch_compat.install()
    import flashmoe_jobs

    from flashmoe_science.integrations.torchtitan import warmup_cases
    from flashmoe_science.warmup import warmup

    job = getattr(flashmoe_jobs, f"{model}_flash")()
    cases = warmup_cases(job.model_spec.model, seq_len=job.training.seq_len, batch=job.training.local_batch_size)
    for case, seconds in warmup(cases):
        print(f"{seconds:7.1f} s  {case.describe()}", flush=True)


def _warmup(model: str, env: dict, timeout: float) -> dict:
    """`_warmup_child` in a new process: its wall time, exit status (None: stopped at ``timeout``) and its lines."""
    start = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, __file__, "--warmup-child", model], env={**os.environ, **env},
                                capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as stopped:
        output = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else stopped.stdout or ""
        return dict(seconds=time.perf_counter() - start, exit=None, cases=output.strip().splitlines())
    seconds = time.perf_counter() - start
    print(result.stdout + result.stderr[-3000:], flush=True)
    return dict(seconds=seconds, exit=result.returncode, cases=result.stdout.strip().splitlines())


def _versions() -> dict:
    import importlib.metadata

    import torch
    import triton

    return dict(gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                triton=triton.__version__, torchtitan=importlib.metadata.version("torchtitan"),
                date=datetime.date.today().isoformat(), commit=os.environ.get("FLASHMOE_COMMIT", "unknown"))


class Measurement:
    """The runs so far and what they add up to, written out after each run."""

    def __init__(self, args, out: Path):
        self.args, self.out, self.versions = args, out, _versions()
        self.runs = {"titan": [], "flash": []}
        self.records, self.warmup = [], None
        self.logs = out / "runs.log"
        self.logs.write_text("")
        self.write()

    def add(self, kind: str, cache: str, run: dict, first: dict, log: Path, process_s: float) -> None:
        import run as titan_run

        repeat = len(self.runs[kind])
        self.runs[kind].append(run)
        summary = titan_run.summary(run)
        self.records.append(dict(
            op="torchtitan-train", model=self.args.model, gpus=1, kernels=KERNELS[kind], repeat=repeat,
            triton_cache=cache, steps=summary["steps"], stopped_by_timeout=summary["timed_out"],
            tokens_per_s=round(summary["tokens_per_s"]), **{k: round(v) for k, v in spread(run["rows"]).items()},
            mfu_percent=round(summary["mfu_percent"], 1), peak_memory_gib=summary["peak_memory_gib"],
            final_loss=summary["final_loss"], first_step_s=_rounded(first["first_step_s"]),
            steps_2_to_5_s=[round(s, 3) for s in first["step_s"]], slow_steps=first["slow_steps"],
            setup_s=_rounded(first["setup_s"]),
            process_s=round(process_s, 1), extra=self.args.extra))
        with self.logs.open("a") as f:
            f.write(f"===== {kind} repeat {repeat} (triton cache: {cache}) =====\n{log.read_text()}\n")
        self.write()

    def comparison(self) -> dict:
        import run as titan_run

        pairs = min(len(self.runs["titan"]), len(self.runs["flash"]))
        if pairs == 0:
            return {}
        result = titan_run.compare({kind: runs[:pairs] for kind, runs in self.runs.items()}, ["flash"])
        ratios = result.get("speedup_repeats", [result["speedup_tokens_per_s"]])
        losses = []
        for ours, titan in zip(self.runs["flash"][:pairs], self.runs["titan"][:pairs]):
            common = min(len(ours["rows"]), len(titan["rows"]))
            losses.append(ours["rows"][common - 1]["loss"] / titan["rows"][common - 1]["loss"])
        return dict(repeats=pairs, speedup_mean_rate=result["speedup_tokens_per_s"], speedup_per_repeat=ratios,
                    speedup_min=min(ratios), speedup_max=max(ratios), loss_ratio_per_repeat=losses,
                    titan_tokens_per_s=result["titan"]["tokens_per_s"],
                    flash_tokens_per_s=result["flash"]["tokens_per_s"])

    def write(self) -> None:
        first = {f"{r['kernels']}, {r['triton_cache']} cache": r["first_step_s"]
                 for r in self.records if r["triton_cache"] != "warm"}
        data = dict(**self.versions, setup=dict(model=self.args.model, steps=self.args.steps,
                                              repeats=self.args.repeats, extra=self.args.extra),
                    comparison=self.comparison(), first_step_s=first, warmup=self.warmup, records=self.records)
        (self.out / "torchtitan_dense.json").write_text(json.dumps(data, indent=1))
        with (self.out / "steps.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["kernels", "repeat", "step", "loss", "grad_norm", "memory_gib",
                                                   "tps", "tflops", "mfu"])
            writer.writeheader()
            for kind, runs in self.runs.items():
                for repeat, run in enumerate(runs):
                    writer.writerows({"kernels": kind, "repeat": repeat, **r} for r in run["rows"])


def _plan(repeats: int) -> list[tuple[str, str]]:
    """(kind, Triton cache) per run, in order: the module docstring's."""
    plan = [("titan", "empty"), ("flash", "empty"), ("warmup", ""), ("flash", "after warmup"), ("titan", "warm")]
    for repeat in range(2, repeats):
        order = ("titan", "flash") if repeat % 2 == 0 else ("flash", "titan")
        plan += [(kind, "warm") for kind in order]
    return plan if repeats > 1 else plan[:2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup-child", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="llama_100m", help="flashmoe_jobs' model (jobs {model}_titan/_flash)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kernel set, interleaved (default 3)")
    parser.add_argument("--deadline", type=float, default=480, help="seconds for all runs (default 480)")
    parser.add_argument("--corpus", default=None, help="the job's text (written first if missing; default: a "
                        "temporary file)")
    parser.add_argument("--out", help="folder for the JSON, the logs and the steps (required but for --warmup-child)")
    parser.add_argument("extra", nargs="*", help="TorchTitan flags for every run (after --), e.g. --compile.enable")
    args = parser.parse_args(argv)
    if args.warmup_child:
        _warmup_child(args.warmup_child)
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.steps < 1 or args.repeats < 1:
        raise ValueError(f"--steps and --repeats must be >= 1, got {args.steps} and {args.repeats}")
    began = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="titan-dense-"))
    sys.path.insert(0, str(EXAMPLES))
    import torch_compat

    torch_compat.install()  # before any TorchTitan import
    import run as titan_run
    from local_text import LocalTextDataLoader, write_docstring_corpus

    corpus = Path(args.corpus or root / "corpus.txt")
    if not corpus.exists():
        write_docstring_corpus(corpus, LocalTextDataLoader.Config().max_chars)
    extra = ["--dataloader.dataset_path", str(corpus), "--dump_folder", str(root / "outputs"), *args.extra]
    measurement = Measurement(args, out)
    for kind, cache in _plan(args.repeats):
        left = args.deadline - (time.perf_counter() - began)
        if left < MIN_RUN_S:
            print(f"deadline: {left:.0f} s left, {kind} ({cache}) not run", flush=True)
            break
        if kind == "warmup":
            measurement.warmup = _warmup(args.model, _caches(root, "warmed"), left)
            measurement.write()
            continue
        # TorchTitan's runs share one pair of caches (its first run fills them); ours: one left empty for the
        # cold run, the warmed one for the others
        os.environ.update(_caches(root, "titan" if kind == "titan" else "flash-cold" if cache == "empty"
                                  else "warmed"))
        log = root / f"{kind}-{len(measurement.runs[kind])}.log"
        launched, start = time.time(), time.perf_counter()
        try:
            run = titan_run.train(f"{args.model}_{kind}", 1, args.steps, extra, log, left)
        except SystemExit as failed:  # a run that failed or logged no step: its log, then the next run
            print(failed, flush=True)
            with measurement.logs.open("a") as f:
                f.write(f"===== {kind} ({cache} cache) FAILED: {failed} =====\n"
                        f"{log.read_text() if log.exists() else ''}\n")
            continue
        measurement.add(kind, cache, run, first_steps(log.read_text(), launched), log, time.perf_counter() - start)
        print(json.dumps(measurement.records[-1]), flush=True)
    print(json.dumps(measurement.comparison(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
