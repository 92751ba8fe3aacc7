"""examples/megatron/train_gpt_moe.py on two gloo CPU ranks (data and expert parallel), tiny, two interleaved
repeats: both kernel sets train from the same weights on the same batches to the same losses in every repeat (both
run PyTorch references in float32 here), and the records, the comparison, the CSV and the plot are written."""

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "megatron" / "train_gpt_moe.py"


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
    with open(tmp_path / "megatron-train.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * 4
    by_step = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), []).append(float(row["loss"]))
    for step, losses in by_step.items():
        assert losses == pytest.approx([losses[0]] * 4, rel=1e-5), step
    assert (tmp_path / "megatron-train.png").stat().st_size > 0
