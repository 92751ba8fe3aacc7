"""examples/megatron/train_gpt_moe.py on two gloo CPU ranks (data and expert parallel), tiny, two interleaved
repeats: both kernel sets train from the same weights on the same batches to the same losses in every repeat (both
run PyTorch references in float32 here), and the records, the comparison, the CSV and the plot are written; the
comparison's loss spikes; examples/megatron/step_diff.py's one-step, layer-by-layer comparison on one rank."""

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
from supported import skip_module_unless_supported  # noqa: E402

skip_module_unless_supported("megatron")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "megatron" / "train_gpt_moe.py"
STEP_DIFF = EXAMPLE.with_name("step_diff.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tiny_run_on_two_cpu_ranks(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), str(EXAMPLE), "--size", "tiny", "--steps", "4", "--warmup", "1", "--ep", "2",
               "--repeats", "2", "--out", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((tmp_path / "megatron-train.json").read_text())
    records = document["records"]
    assert [(r["kernels"], r["repeat"]) for r in records] == [("flashmoe", 0), ("local", 0), ("local", 1),
                                                              ("flashmoe", 1)]
    for record in records:
        assert record["op"] == "megatron-train" and record["gpus"] == 0 and record["steps"] == 4
        assert (record["dp"], record["ep"], record["etp"]) == (2, 2, 1)
        assert record["tokens_per_s"] > 0
        assert record["final_loss"] == pytest.approx(records[0]["final_loss"], rel=1e-5)
    summary = document["summary"]
    assert [pair["repeat"] for pair in summary["per_repeat"]] == [0, 1]
    assert summary["final_loss_ratio"] == pytest.approx(1, rel=1e-5)
    assert summary["loss_gap_max"] < 1e-5 and summary["loss_gap_steps"] == 4
    assert summary["loss_spikes"] == {f"{k} repeat {r}": [] for k in ("flashmoe", "local") for r in (0, 1)}
    with open(tmp_path / "megatron-train.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * 4
    by_step = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), []).append(float(row["loss"]))
    for step, losses in by_step.items():
        assert losses == pytest.approx([losses[0]] * 4, rel=1e-5), step
    assert (tmp_path / "megatron-train.png").stat().st_size > 0


def test_step_diff_on_one_cpu_rank(tmp_path):
    """examples/megatron/step_diff.py, tiny, float32 on one gloo rank: ours and the local spec against the local
    spec in float64 from the same weights, layer by layer. Both run PyTorch references here, so both sit at float32
    rounding; the settings and parameter groups agree but for the two swapped modules, and ours drawn by its own
    spec from the seed equals the local model's weights."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(_free_port())}
    command = [sys.executable, str(STEP_DIFF), "--size", "tiny", "--dtype", "float32", "--out", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "megatron-step-diff.json").read_text())
    assert report["initial_weights"]["copied"] == {"max_abs": 0.0, "differing": []}
    assert report["initial_weights"]["drawn_by_own_spec"] == {"max_abs": 0.0, "differing": []}
    summary = report["summary"]
    assert set(summary["settings_differ"]) == {"core_attention", "experts"}
    assert summary["param_settings_differ"] == []
    assert summary["loss"]["flashmoe"] == pytest.approx(summary["loss"]["reference"], rel=1e-6)
    assert summary["loss"]["local"] == pytest.approx(summary["loss"]["reference"], rel=1e-6)
    for kernels in ("flashmoe", "local"):
        assert summary["activations_max_rel"][kernels] < 1e-5
        assert summary["grads_max_rel"][kernels] < 1e-5
        assert summary["routing_differs_max"][kernels] == 0
        assert summary["flipped_max"][kernels] == 0
    names = set(report["flashmoe"]["grads"])
    assert names == set(report["local"]["grads"]) and "decoder.layers.0.mlp.experts.weight1" in names
    assert {"layer0.core_attention", "layer1.mlp", "layer1.router", "logits"} <= set(report["flashmoe"]["activations"])
    records = report["records"]
    assert [(r["op"], r["kernels"]) for r in records] == [("megatron-step-diff", "flashmoe"),
                                                          ("megatron-step-diff", "local")]
    assert all(r["initial_weights_equal"] and abs(r["loss_error"]) < 1e-5 for r in records)


def test_loss_spikes_against_the_median_before():
    sys.path.insert(0, str(EXAMPLE.parent))
    from train_outputs import SPIKE, WINDOW, loss_spikes

    losses = [8.0 + 0.1 * (step % 3) for step in range(30)]
    losses[WINDOW + 2] = 8.1 * SPIKE * 1.01  # over SPIKE x the median before (8.1)
    losses[WINDOW + 9] = 8.1 * SPIKE * 0.99  # under it
    rows = [{"step": step, "loss": loss} for step, loss in enumerate(losses)]
    assert loss_spikes(rows) == [[WINDOW + 2, losses[WINDOW + 2]]]


def test_loss_comparison_at_matched_steps(tmp_path):
    """flashmoe against local per repeat and each kernel set's repeat 1 against its repeat 0, over the steps from
    FIRST_STEP that both runs reached (a run stopped early is compared over its own steps, not its last ten against
    the other's), the same from the written CSV."""
    import random

    sys.path.insert(0, str(EXAMPLE.parent))
    from train_outputs import FIRST_STEP, WINDOW, loss_comparison, read_csv, write_outputs

    rng = random.Random(0)
    local = [10.0 - 0.05 * step + rng.uniform(-0.3, 0.3) for step in range(50)]
    curves = {("flashmoe", 0): [0.99 * loss for loss in local[:40]],  # stopped at 40 steps, 1% lower
              ("local", 0): local, ("local", 1): local,
              ("flashmoe", 1): [loss * (1.02 if step % 2 else 0.98) for step, loss in enumerate(local)]}
    results = [{"record": {"op": "megatron-train", "kernels": kernels, "repeat": repeat, "tokens_per_s": 1000.0,
                           "final_loss": sum(losses[-10:]) / 10},
                "rows": [{"kernels": kernels, "step": step, "loss": loss, "tokens_per_s": 1000.0}
                         for step, loss in enumerate(losses)]}
               for (kernels, repeat), losses in curves.items()]
    comparison = loss_comparison(results)
    assert (comparison["first_step"], comparison["window"]) == (FIRST_STEP, WINDOW)
    first, second = comparison["per_repeat"]
    assert first["repeat"] == 0 and first["steps"] == [FIRST_STEP, 39]
    assert first["window_ratio"] == pytest.approx(0.99, rel=1e-12)
    assert first["gap_mean"] == pytest.approx(-0.01, rel=1e-9) and first["gap_mean_abs"] == pytest.approx(0.01)
    compared = range(FIRST_STEP, 50)
    assert second["steps"] == [FIRST_STEP, 49]
    assert second["gap_mean"] == pytest.approx(sum(0.02 if s % 2 else -0.02 for s in compared) / len(compared))
    assert second["gap_mean_abs"] == pytest.approx(0.02)
    window = range(50 - WINDOW, 50)
    assert second["window_ratio"] == pytest.approx(sum(curves[("flashmoe", 1)][s] for s in window)
                                                   / sum(local[s] for s in window))
    local_twice, ours_twice = comparison["repeat_to_repeat"]["local"], comparison["repeat_to_repeat"]["flashmoe"]
    assert local_twice["gap_mean_abs"] == 0 and local_twice["window_ratio"] == 1
    assert ours_twice["steps"] == [FIRST_STEP, 39]
    head = {"gpu": "cpu", "commit": "0000000", "model": {"parameters": 2e6, "active_parameters": 1e6}}
    document = write_outputs(tmp_path, head, results)
    assert document["summary"]["loss_comparison"] == comparison
    assert loss_comparison(read_csv(tmp_path / "megatron-train.csv")) == comparison
