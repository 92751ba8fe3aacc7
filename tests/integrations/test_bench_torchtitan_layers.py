"""The TorchTitan layer benchmark (benchmarks/tools/bench_torchtitan_moe_layer.py) at its tiny size on the CPU:
every case runs both modules and lands in its JSON."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "tools" / "bench_torchtitan_moe_layer.py"


def test_tiny_layers_run_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_torchtitan_moe_layer", TOOL)
    tool = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, tool)  # its dataclass looks its module up there
    spec.loader.exec_module(tool)
    tool.main(["--size", "tiny", "--device", "cpu", "--calls", "1", "--no-profile", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "torchtitan_layers.json").read_text())
    cases = {(r["model"], r["layer"]) for r in report["results"]}
    assert cases == {("qwen3_moe", "masks"), ("qwen3_moe", "attention"), ("qwen3_moe", "moe"),
                     ("llama_100m", "masks"), ("llama_100m", "attention")}
    assert all(r["titan_ms"] > 0 and r["ours_ms"] > 0 for r in report["results"])
