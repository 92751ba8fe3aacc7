"""The TorchTitan dense-job measurement (benchmarks/tools/torchtitan_dense.py): the first-step times it reads from
TorchTitan's log lines, the run order (interleaved, cold caches first, warmup before ours' second run), and the whole
measurement on CPU ranks (TorchTitan's trainer through tests/integrations/torchtitan_cpu.py's tiny jobs)."""

import functools
import importlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
from supported import skip_module_unless_supported  # noqa: E402

skip_module_unless_supported("torchtitan")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks" / "tools"), str(ROOT / "examples" / "torchtitan")]
tool = importlib.import_module("torchtitan_dense")

LOG = """[titan] 2026-11-28 10:00:00,000 - root - INFO - Building model
[titan] 2026-11-28 10:00:05,500 - root - INFO - Training starts at step 1
[titan] 2026-11-28 10:01:45,750 - root - INFO - step:  1  loss:  5.60  grad_norm:  3.1  memory:  9.00GiB(6%)  tps: 327
[titan] 2026-11-28 10:01:45,900 - root - INFO - step:  2  loss:  5.10  grad_norm:  2.1  memory:  9.00GiB(6%)  tps: 9
[titan] 2026-11-28 10:01:46,000 - root - INFO - step:  3  loss:  4.90  grad_norm:  2.0  memory:  9.00GiB(6%)  tps: 9
"""


def test_first_steps_from_the_log_lines():
    import datetime

    launched = datetime.datetime(2026, 11, 28, 9, 59, 58).timestamp()
    first = tool.first_steps(LOG, launched)
    assert first["setup_s"] == pytest.approx(7.5)
    assert first["first_step_s"] == pytest.approx(100.25)
    assert first["step_s"] == pytest.approx([0.15, 0.1])
    assert first["slow_steps"] == []
    assert tool.first_steps("no training yet", launched) == dict(setup_s=None, first_step_s=None, step_s=[],
                                                                 slow_steps=[])
    # a step past the fifth that takes over 5 times the median: a kernel compiled mid-run
    lines = [f"[titan] 2026-11-28 10:02:{second:02d},000 - root - INFO - step: {step:2}  loss:  4.0"
             for step, second in zip(range(4, 10), (0, 1, 2, 3, 13, 14))]
    assert tool.first_steps(LOG + "\n".join(lines), launched)["slow_steps"] == [[8, 10.0]]


def test_run_order_interleaves_after_the_cold_runs():
    assert tool._plan(3) == [("titan", "empty"), ("flash", "empty"), ("warmup", ""), ("flash", "after warmup"),
                             ("titan", "warm"), ("titan", "warm"), ("flash", "warm")]
    assert tool._plan(1) == [("titan", "empty"), ("flash", "empty")]


def test_spread_of_the_steady_steps():
    rows = [dict(step=i + 1, tps=t) for i, t in enumerate([1] + [100] * 5 + [200] * 4)]  # step 1 left out
    got = tool.spread(rows)
    assert got == dict(tokens_per_s_median=100, tokens_per_s_p10=100, tokens_per_s_p90=200)


@pytest.mark.slow
def test_measurement_on_cpu_ranks(tmp_path, monkeypatch):
    # two repeats of the tiny Llama jobs (ours and TorchTitan's), 3 steps each; the warmup needs CUDA and fails here,
    # which the measurement records and goes past
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))))
    launcher = ROOT / "tests" / "integrations" / "torchtitan_cpu.py"
    monkeypatch.setenv("PYTHONPATH", f"{launcher.parent}:{ROOT / 'src'}")
    run = importlib.import_module("run")
    monkeypatch.setattr(run, "train", functools.partial(run.train, launcher=launcher, module="torchtitan_cpu"))
    tool.main(["--model", "llama", "--steps", "3", "--repeats", "2", "--corpus", str(corpus),
               "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "torchtitan_dense.json").read_text())
    assert [(r["kernels"].split()[0], r["triton_cache"]) for r in report["records"]] == [
        ("TorchTitan", "empty"), ("flashmoe", "empty"), ("flashmoe", "after warmup"), ("TorchTitan", "warm")]
    assert all(r["steps"] == 3 and r["first_step_s"] > 0 for r in report["records"])
    assert report["warmup"]["exit"] != 0
    comparison = report["comparison"]
    assert comparison["repeats"] == 2 and len(comparison["speedup_per_repeat"]) == 2
    assert comparison["loss_ratio_per_repeat"] == pytest.approx([1.0, 1.0], rel=1e-3)
    assert len(report["first_step_s"]) == 3
    assert (tmp_path / "out" / "runs.log").read_text().count("=====") == 8
