"""examples/megatron/train_gpt_moe.py on two gloo CPU ranks (data and expert parallel), tiny: both kernel sets train
from the same weights on the same batches to the same losses (both run PyTorch references in float32 here), and
the records, CSV and plot are written."""

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
               "--out", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads((tmp_path / "megatron-train.json").read_text())
    records = {record["kernels"]: record for record in document["records"]}
    assert set(records) == {"flashmoe", "local"}
    for record in records.values():
        assert record["op"] == "megatron-train" and record["gpus"] == 0 and record["steps"] == 4
        assert (record["dp"], record["ep"], record["etp"]) == (2, 2, 1)
        assert record["tokens_per_s"] > 0
    assert records["flashmoe"]["final_loss"] == pytest.approx(records["local"]["final_loss"], rel=1e-5)
    with open(tmp_path / "megatron-train.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 4
    by_step = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), []).append(float(row["loss"]))
    for step, losses in by_step.items():
        assert losses[0] == pytest.approx(losses[1], rel=1e-5), step
    assert (tmp_path / "megatron-train.png").stat().st_size > 0
