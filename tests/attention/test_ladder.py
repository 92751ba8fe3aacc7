"""The ladder's rungs (attention/ladder/) against the float64 oracle, and its benchmark (bench/ladder.py).

Three groups:
* in this process: the cpu rung on every case, the shared input checks, the registry, naive_gpu's memory refusal,
  the bytes model;
* under TRITON_INTERPRET=1, in a child pytest (tests/interpreter_driver.py; the variable must be set before triton
  is first imported, see test_triton_interpreter.py): the Triton rungs at tiny sizes, and the benchmark's CPU run
  with them. To see those cases: `TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest tests/attention/test_ladder.py`;
* `gpu`-marked: every rung this GPU runs, and the refusal of a naive problem too large for the GPU.

The rungs compute in float32 whatever the input dtype, so they are held to the rule every kernel meets: error vs
float64 at most 2 x PyTorch's own error in the input dtype plus a small slack (helpers.assert_out_close).
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from flashmoe_science.attention.ladder import RUNGS, rung, unavailable
from flashmoe_science.attention.ladder import naive_gpu
from helpers import assert_out_close, dtype_id, make_qkv
from interpreter_driver import interpreter_suite, run_marked_suite

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
in_process = pytest.mark.skipif(IN_INTERPRETER, reason="runs in the parent process, not under the interpreter")
interpreted = pytest.mark.skipif(not IN_INTERPRETER, reason="runs in the TRITON_INTERPRET=1 child process of this file")

LENGTHS = (1, 37, 130)
HEAD_DIMS = (16, 64)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_RUNGS = [r.name for r in RUNGS if "interpreter" in r.devices]


def _check(name, b, h, lq, lk, d, causal, dtype, device="cpu", softmax_scale=None):
    q, k, v = (t.to(device) for t in make_qkv((b, h, lq, d), (b, h, lk, d), dtype))
    out = rung(name).attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert out.device == q.device
    assert_out_close(out.cpu(), q.cpu(), k.cpu(), v.cpu(), causal, softmax_scale)


# ----------------------------------------------------------------------------------------------------------------
# In this process
# ----------------------------------------------------------------------------------------------------------------
@in_process
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("length", LENGTHS)
def test_cpu_rung(length, causal, d, dtype):
    _check("cpu", 2, 3, length, length, d, causal, dtype)


@in_process
def test_cpu_rung_cross_lengths_and_scale():
    _check("cpu", 1, 2, 20, 45, 24, True, torch.float32, softmax_scale=0.3)
    _check("cpu", 1, 2, 45, 20, 24, True, torch.float32)  # 25 rows see no key: zeros


@in_process
def test_registry_order_and_lookup():
    assert [r.name for r in RUNGS] == ["cpu", "naive_gpu", "tiled_fma", "tiled_tensor_cores", "hopper"]
    assert all(r.idea and r.devices for r in RUNGS)
    with pytest.raises(ValueError, match="naive_gpu"):
        rung("naive")


@in_process
def test_unavailable_on_this_cpu_process():
    cpu = torch.device("cpu")
    assert unavailable(rung("cpu"), cpu) is None
    assert "TRITON_INTERPRET" in unavailable(rung("tiled_fma"), cpu)
    assert "Hopper" in unavailable(rung("hopper"), cpu)


@in_process
@pytest.mark.parametrize("name", [r.name for r in RUNGS])
def test_every_rung_checks_its_inputs(name):
    attention = rung(name).attention
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="q must be 4-D"):
        attention(q[0], q, q)
    with pytest.raises(ValueError, match="k must be"):
        attention(q, torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16))
    with pytest.raises(ValueError, match="k and v"):
        attention(q, q, torch.randn(1, 2, 9, 16))
    with pytest.raises(TypeError, match="one dtype"):
        attention(q, q.half(), q.half())
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        attention(q.double(), q.double(), q.double())
    with pytest.raises(ValueError, match="unit stride"):
        attention(q.transpose(-1, -2), q, q)
    with pytest.raises(TypeError, match="softmax_scale"):
        attention(q, q, q, softmax_scale="0.5")


@in_process
def test_cpu_rung_refuses_gpu_tensors():
    q = torch.randn(1, 1, 4, 16, device="meta")
    with pytest.raises(ValueError, match="CPU tensors"):
        rung("cpu").attention(q, q, q)


@in_process
def test_naive_refusal_names_length_and_bytes():
    q = torch.empty(2, 8, 1, 128).expand(2, 8, 65536, 128)  # (B, H, L, D) without the memory
    needed = 2 * 8 * 65536 * 65536 * 4
    assert naive_gpu.scores_bytes(q, q) == needed
    naive_gpu.check_scores_fit(q, q, needed)  # exactly fits
    with pytest.raises(ValueError, match=rf"L = 65536 x 65536 .* needs {needed} bytes \(256\.0 GiB\)") as error:
        naive_gpu.check_scores_fit(q, q, needed - 1)
    assert len(f"ValueError: {error.value}") <= 160  # the bench keeps the first 160 characters of a stop's reason


@in_process
def test_bytes_model_covers_every_rung_and_counts_the_scores():
    from flashmoe_science.bench.attention import AttentionShape
    from flashmoe_science.bench.ladder import BYTES_MODELS, bytes_moved

    assert set(BYTES_MODELS) == {r.name for r in RUNGS}
    shape = AttentionShape(2, 16, 1024, 1024, 128, False)
    io = 2 * 2 * 16 * 128 * (2 * 1024 + 2 * 1024)
    assert bytes_moved("tiled_fma", shape, torch.bfloat16) == io
    assert bytes_moved("naive_gpu", shape, torch.bfloat16) == io + 24 * 2 * 16 * 1024 * 1024
    assert bytes_moved("hopper", shape, torch.bfloat16) == io + 4 * 2 * 16 * 1024


@in_process
def test_gpu_grid_is_the_token_budget():
    from flashmoe_science.bench.ladder import gpu_series

    full, quick = gpu_series(quick=False), gpu_series(quick=True)
    assert len(full) == 4 and len(quick) == 2
    for series in full:
        assert [s.Lq for s in series.shapes] == [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
        assert all(s.B * s.Lq == max(16384, s.Lq) and (s.H, s.D) == (16, 128) for s in series.shapes)


@in_process
@pytest.mark.slow
@interpreter_suite(__file__, timeout=600)
def test_ladder_under_the_interpreter_in_subprocess(request):
    print(f"TRITON_INTERPRET=1 child: {run_marked_suite(request)}")


# ----------------------------------------------------------------------------------------------------------------
# Under TRITON_INTERPRET=1 (the child): tiny sizes, fp16 and fp32. Not bf16: the interpreter (numpy has no bfloat16)
# truncates float32 to bf16 on a store instead of rounding (a 1-ulp error where PyTorch's is half an ulp), and its
# bf16 tl.dot is broken (test_triton_interpreter.py); the GPU test covers bf16.
# ----------------------------------------------------------------------------------------------------------------
# (B, H, Lq, Lk, D): every length and head dim, batch and head indices > 0, Lq != Lk both ways (dead causal rows)
INTERPRETER_SHAPES = [(2, 2, 1, 1, 16), (1, 2, 37, 37, 64), (1, 1, 130, 130, 16), (2, 2, 20, 45, 24), (1, 1, 45, 20, 24)]


@interpreted
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", INTERPRETER_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", TRITON_RUNGS)
def test_triton_rung_under_interpreter(name, shape, causal):
    for dtype in (torch.float16, torch.float32):
        if name == "tiled_tensor_cores" and shape[2] == 130:
            continue  # the Triton kernel's own interpreter suite covers it at length; this checks the wiring
        _check(name, *shape, causal, dtype)


@interpreted
def test_triton_rungs_take_a_softmax_scale():
    for name in TRITON_RUNGS:
        _check(name, 1, 2, 20, 33, 16, True, torch.float32, softmax_scale=0.2)


@interpreted
def test_bench_runs_on_the_cpu(tmp_path, capsys):
    from flashmoe_science.bench.ladder import CPU_SHAPES, run_from_cli

    args = argparse.Namespace(out=str(tmp_path), quick=True, no_plot=True, commit="test")
    assert run_from_cli(args) == 0
    printed = capsys.readouterr().out
    assert "tiled_fma/naive_gpu" in printed and "a smoke test, not a measurement" in printed
    (path,) = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    assert result["suite"] == "ladder" and result["commit"] == "test"
    ran = {(r["backend"], r["Lq"], r["causal"]) for r in result["records"]}
    assert ran == {(name, shape[2], causal) for name in ["cpu", *TRITON_RUNGS] for shape in CPU_SHAPES
                   for causal in (False, True)}
    assert all(r["op"] == "attention" and r["pass"] == "fwd" and r["ms"] > 0 and r["bytes"] > 0
               for r in result["records"])
    # the rungs not run here; a loaded machine may also note a slow call (a stop past the shapes measured)
    assert {s["backend"] for s in result["stopped"] if s["L"] is None} == {"hopper"}


# ----------------------------------------------------------------------------------------------------------------
# On a GPU
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", [r.name for r in RUNGS if r.name != "cpu"])
def test_gpu_rung(name, causal):
    device = torch.device("cuda")
    reason = unavailable(rung(name), device)
    if reason is not None:
        pytest.skip(reason)
    dtypes = (torch.float16, torch.bfloat16) if name == "hopper" else DTYPES
    for dtype in dtypes:
        for b, h, lq, lk, d in [(2, 3, 1, 1, 16), (2, 3, 37, 37, 64), (1, 4, 130, 130, 16), (1, 2, 45, 300, 64),
                                (1, 2, 300, 45, 64), (1, 2, 1000, 1000, 128)]:
            _check(name, b, h, lq, lk, d, causal, dtype, device)


@pytest.mark.gpu
def test_gpu_naive_refuses_scores_that_do_not_fit():
    q = torch.randn(1, 64, 1, 128, device="cuda", dtype=torch.bfloat16).expand(1, 64, 1 << 20, 128)
    with pytest.raises(ValueError, match=r"L = 1048576 x 1048576 .* bytes .* free on the GPU"):
        rung("naive_gpu").attention(q, q, q)


# ----------------------------------------------------------------------------------------------------------------
# benchmarks/tools/ladder_doc.py: docs/ladder.md's measured sections from a result file
# ----------------------------------------------------------------------------------------------------------------
@in_process
def test_ladder_doc_fills_every_marked_section(request, monkeypatch, tmp_path):
    import importlib.util

    root = request.config.rootpath
    monkeypatch.syspath_prepend(str(root / "benchmarks" / "tools"))
    spec = importlib.util.spec_from_file_location("ladder_doc", root / "benchmarks" / "tools" / "ladder_doc.py")
    ladder_doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ladder_doc)

    tflops = {"cpu": 0.5, "naive_gpu": 20.0, "tiled_fma": 30.0, "tiled_tensor_cores": 300.0, "hopper": 600.0}
    records = [dict(op="attention", B=16384 // L, H=16, Lq=L, Lk=L, D=128, causal=False, dtype="bf16", backend=name,
                    ms=1.0, tflops=value * (1 + L / 4096), peak_mem_mib=None if name == "cpu" else 64.0,
                    device="cpu" if name == "cpu" else "cuda")
               for L in (512, 1024) for name, value in tflops.items() if not (name == "naive_gpu" and L == 1024)]
    stopped = [{"backend": "naive_gpu", "series": "bf16 non-causal", "L": 1024, "reason": "ValueError: too big"}]
    result = dict(gpu="NVIDIA H200", commit="abc1234", date="2026-01-01", torch="2.x", triton="3.x", suite="ladder",
                  stopped=stopped, records=records)
    doc = (root / "docs" / "ladder.md").read_text()
    filled = ladder_doc.filled_doc(doc, result, tmp_path / "nvidia-h200.json")

    assert "_Measured: filled by" not in filled and "_Empty until a GPU run" not in filled
    assert "| 512 | 32 | 0.56 | 22.5 | 33.8 | 337.5 | 675.0 | 40.00 | 1.50 | 10.00 | 2.00 |" in filled
    assert "| 1024 | 16 | 0.62 | n/a | 37.5 | 375.0 | 750.0 | n/a | n/a | 10.00 | 2.00 |" in filled
    assert "Measured on the host CPU of the NVIDIA H200 machine: bf16 non-causal: 0.56–0.62 TFLOP/s" in filled
    assert "1.50–1.50x naive_gpu (geometric mean 1.50x over L = 512–512)" in filled
    assert "Stopped (bf16 non-causal, at L = 1024): ValueError: too big." in filled
    assert ladder_doc.filled_doc(filled, result, tmp_path / "nvidia-h200.json") == filled  # refilling is stable
    with pytest.raises(ValueError, match="ladder:table"):
        ladder_doc.fill("no markers here", "table", "x")
