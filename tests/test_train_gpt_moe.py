"""examples/train_gpt_moe.py on the CPU with its tiny config: ours and the PyTorch build, eager and compiled
(aot_eager), from one seed on the same batches, give the same losses (both run PyTorch references in float32 here),
and the CSV, summary and plot are written; the tiny config's CPU defaults; the plot title's parameter count."""

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("tqdm")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt_moe.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_tiny_training_runs_match(tmp_path):
    example = load_example()
    summary = example.main(["--config", "tiny", "--steps", "3", "--device", "cpu", "--compile-backend", "aot_eager",
                            "--corpus-packages", "numpy", "--max-corpus-chars", "60000", "--out", str(tmp_path)])
    runs = {run["run"]: run for run in summary["runs"]}
    assert set(runs) == {"ours", "torch", "ours compiled", "torch compiled"}
    with open(tmp_path / "train_gpt_moe.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * 3
    losses = {}
    for row in rows:
        losses.setdefault(int(row["step"]), []).append(float(row["loss"]))
    for step, values in losses.items():
        assert max(values) - min(values) < 1e-4 * max(values), (step, values)
    assert summary["eager_final_loss_rel_diff"] < 1e-4 and summary["compiled_final_loss_rel_diff"] < 1e-4
    assert json.loads((tmp_path / "summary.json").read_text())["config"]["layers"] == 2
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_tiny_defaults_fit_a_cpu():
    args = load_example().parse_args(["--config", "tiny", "--device", "cpu"])
    assert (args.steps, args.max_corpus_chars, args.compile_backend, args.threads) == (200, 1_000_000, "aot_eager", 1)
    args = load_example().parse_args(["--config", "tiny", "--device", "cpu", "--steps", "7"])
    assert args.steps == 7 and args.warmup_steps == 1


def test_parameter_count_in_the_title():
    format_count = load_example().format_count
    assert [format_count(n) for n in (107_353_344, 2_633_313, 259_745, 85_873, 999)] == \
        ["107M", "2.63M", "260K", "85.9K", "999"]


def test_bad_arguments():
    example = load_example()
    with pytest.raises(SystemExit):
        example.parse_args(["--runs", "ours,jax"])
    with pytest.raises(SystemExit):
        example.parse_args(["--steps", "5", "--warmup-steps", "5"])
    with pytest.raises(SystemExit):
        example.parse_args(["--steps", "0"])
