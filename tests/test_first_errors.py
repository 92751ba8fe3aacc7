"""What a newcomer meets first: a missing optional package or a bad option is one line (exit status 2) said before
any work starts, not a traceback after the data has loaded or the benchmark has run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashmoe_science.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"


def _without(module: str, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where ``import <module>`` fails as if it were not installed."""
    prelude = f"import sys; sys.path.insert(0, {str(SRC)!r}); sys.modules[{module!r}] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300)


def test_import_without_triton_says_what_to_install():
    child = _without("triton", "import flashmoe_science")
    assert child.returncode != 0
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: flashmoe-science needs triton") and 'pip install "triton' in last


def test_supercon_train_without_the_science_extra_fails_before_any_training(tmp_path):
    code = ("from flashmoe_science.cli import main; "
            f"sys.exit(main(['supercon', 'train', '--quick', '--out', {str(tmp_path / 'run')!r}]))")
    child = _without("sklearn", code)
    assert child.returncode == 2, child.stderr[-2000:]
    assert child.stderr.strip().count("\n") == 0 and ".[science]" in child.stderr
    assert "formulas read" not in child.stdout  # said before the data loads


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_supercon_device_cuda_without_cuda_is_one_line(device, tmp_path, capsys):
    assert main(["supercon", "train", "--quick", "--device", device, "--out", str(tmp_path / "run")]) == 2
    captured = capsys.readouterr()
    assert f"--device {device}: not usable here" in captured.err and captured.err.count("\n") == 1
    assert "formulas read" not in captured.out


def test_supercon_device_of_another_kind_is_one_line(tmp_path, capsys):
    assert main(["supercon", "train", "--quick", "--device", "meta", "--out", str(tmp_path / "run")]) == 2
    assert "--device meta: the supercon commands run on cpu or cuda" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["a_file", "a_file/below"])
def test_bench_out_that_cannot_be_a_folder_fails_before_the_benchmark(where, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / where
    assert main(["bench", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"flashmoe-science: error: --out {out}: ") and captured.err.count("\n") == 1
    assert "shapes x" not in captured.out  # nothing was timed


def test_supercon_out_that_is_a_file_fails_at_once(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    assert main(["supercon", "bench", "--model", "missing.pt", "--out", str(tmp_path / "a_file")]) == 2
    assert "a file of that name is in the way" in capsys.readouterr().err


NO_CUDA = "there is no CUDA device here (torch.cuda.is_available() is False); use --device cpu"


def test_bench_device_cuda_without_cuda_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--device", "cuda", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"flashmoe-science: error: --device cuda: {NO_CUDA}\n"
    assert captured.out == ""  # nothing was timed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_train_example_device_cuda_without_cuda_is_one_line(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "train_gpt_moe.py"
    child = subprocess.run([sys.executable, str(example), "--config", "tiny", "--device", "cuda", "--out",
                            str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert child.returncode == 2 and child.stdout == ""  # before the corpus and tokenizer
    assert child.stderr == f"train_gpt_moe.py: error: --device cuda: {NO_CUDA}\n"


def test_bfloat16_cpu_tensors_are_refused_before_the_interpreter_runs_a_kernel(monkeypatch):
    """Under TRITON_INTERPRET=1 the Triton kernels take CPU tensors, but the interpreter multiplies bfloat16 tl.dot
    operands as raw bits (triton-lang/triton#11584): attention (forward and backward), decode and the MoE layer
    (few and many tokens) refuse bfloat16 by name before any kernel runs."""
    from flashmoe_science import flash_attention_decode, flash_attention_science
    from flashmoe_science.attention.triton.backend import TritonBackward
    from flashmoe_science.moe.api import fused_moe

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the planners read it per call; no kernel runs below
    q = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q is bfloat16 on the CPU: Triton's interpreter"):
        flash_attention_science(q, q, q, backend="triton")
    with pytest.raises(TypeError, match="q is bfloat16 on the CPU"):
        TritonBackward(None).run(q, q, q, q, None, q, None, q, q, q, None, 0.25, False, False)
    cache = torch.randn(1, 32, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q is bfloat16 on the CPU"):
        flash_attention_decode(torch.randn(1, 1, 2, 16, dtype=torch.bfloat16), cache, cache,
                               torch.tensor([32], dtype=torch.int32), backend="triton")
    w1, w2 = torch.randn(4, 64, 32, dtype=torch.bfloat16), torch.randn(4, 32, 32, dtype=torch.bfloat16)
    for tokens in (2, 256):
        x = torch.randn(tokens, 32, dtype=torch.bfloat16)
        with pytest.raises(TypeError, match="x is bfloat16 on the CPU"):
            fused_moe(x, w1, w2, torch.randn(tokens, 4), 2, backend="triton")
