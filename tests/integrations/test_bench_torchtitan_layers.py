"""The TorchTitan layer benchmark (benchmarks/tools/bench_torchtitan_moe_layer.py) at its tiny size on the CPU:
every case runs both modules on its own model's batch and length and lands in its JSON."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")
from supported import skip_module_unless_supported  # noqa: E402

skip_module_unless_supported("torchtitan")
TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "tools" / "bench_torchtitan_moe_layer.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("bench_torchtitan_moe_layer", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_tiny_layers_run_on_cpu(tool, tmp_path):
    tool.main(["--size", "tiny", "--device", "cpu", "--calls", "1", "--no-profile", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "torchtitan_layers.json").read_text())
    cases = {(r["model"], r["layer"]) for r in report["results"]}
    assert cases == {("qwen3_moe", "masks"), ("qwen3_moe", "attention"), ("qwen3_moe", "attention_step"),
                     ("qwen3_moe", "moe"), ("llama_100m", "masks"), ("llama_100m", "attention"),
                     ("llama_100m", "attention_step")}
    assert all(r["titan_ms"] > 0 and r["ours_ms"] > 0 and r["ours_host_ms"] > 0 for r in report["results"])


def test_cases_flag_runs_only_the_named_cases(tool, tmp_path):
    tool.main(["--size", "tiny", "--device", "cpu", "--calls", "1", "--no-profile", "--out", str(tmp_path),
               "--cases", "qwen3_moe/moe"])
    report = json.loads((tmp_path / "torchtitan_layers.json").read_text())
    assert [(r["model"], r["layer"]) for r in report["results"]] == [("qwen3_moe", "moe")]
    with pytest.raises(ValueError, match="--cases: unknown qwen3_moe/mlp"):
        tool.main(["--size", "tiny", "--device", "cpu", "--out", str(tmp_path), "--cases", "qwen3_moe/mlp"])


def test_tiny_models_differ_in_batch_and_length(tool):
    """Two shapes, so a case handed another model's masks or inputs fails on the CPU as on the GPU."""
    specs = tool._specs("tiny", tool._titan_modules())
    assert len({batch for _, batch, _, _ in specs.values()}) == len(specs)
    assert len({seq_len for _, _, seq_len, _ in specs.values()}) == len(specs)


@pytest.mark.parametrize("batch, seq_len", [(2, 48), (3, 64), (2, 80)])
def test_cpu_flex_refuses_a_mask_of_other_shape(tool, batch, seq_len):
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, q, k: q >= k, 2, 1, 64, 64, device="cpu")
    q, k, v = (torch.randn(batch, 2, seq_len, 8) for _ in range(3))
    with pytest.raises(ValueError, match="block_mask"):
        tool._dense_flex(q, k, v, block_mask=block_mask, scale=None, enable_gqa=False, return_aux=None)
    q, k, v = (torch.randn(2, 2, 64, 8, dtype=torch.float64) for _ in range(3))
    out, _ = tool._dense_flex(q, k, v, block_mask=block_mask, scale=None, enable_gqa=False, return_aux=None)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
