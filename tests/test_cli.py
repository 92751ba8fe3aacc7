"""The `flashmoe-science` command and the benchmark harness's arithmetic (CPU; a few seconds)."""

import io
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flashmoe_science import cli
from flashmoe_science.bench import attention as attention_bench
from flashmoe_science.bench import report
from flashmoe_science.bench.attention import AttentionShape
from flashmoe_science.errors import CommandError

SRC = Path(__file__).resolve().parents[1] / "src"

ENVELOPE_FIELDS = {"gpu", "torch", "triton", "cuda", "cudnn", "python", "commit", "date", "records"}
ATTENTION_RECORD_FIELDS = {
    "op", "pass", "B", "H", "Hkv", "Lq", "Lk", "D", "causal", "dtype", "backend", "ms", "tflops", "peak_mem_mib",
}


def _only_json(folder):
    files = sorted(folder.glob("*.json"))
    assert len(files) == 1, files
    return files[0], json.loads(files[0].read_text())


# --------------------------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------------------------
def test_info_prints_versions_and_dispatch(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    assert "python" in out and "triton" in out and "cuDNN" in out
    assert "non-causal" in out and "causal" in out
    from flashmoe_science.integrations import versions

    for name in versions.INTEGRATIONS:  # each integration's framework: its release and whether it is in range
        line = next(line for line in out.splitlines() if line.startswith(f"integration {name} "))
        assert line.endswith(versions.status(name))
    if not torch.cuda.is_available():
        assert "no CUDA GPU found" in out and "the PyTorch reference" in out and "TRITON_INTERPRET=1" in out
        from flashmoe_science.architectures import ARCHITECTURES

        for architecture in ARCHITECTURES:  # one line each: they need their GPU, and there is none
            line = next(line for line in out.splitlines() if line.startswith(architecture.title))
            assert "available" not in line and architecture.arch in line and "no CUDA GPU" in line


def test_info_survives_a_failing_describe_dispatch(monkeypatch, capsys):
    from flashmoe_science.attention import api

    def broken(*args, **kwargs):
        raise RuntimeError("dispatch exploded")

    monkeypatch.setattr(api, "describe_dispatch", broken)
    assert cli.main(["info"]) == 0
    assert "dispatch exploded" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_bench_quick_on_cpu_writes_json_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHMOE_COMMIT", "abc1234")
    assert cli.main(["bench", "--quick", "--out", str(tmp_path), "--pass", "fwd,bwd", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "No CUDA GPU found" in out and "not a speed claim" in out and "ours/math" in out
    assert "spread" in out and "2 rounds" in out

    path, result = _only_json(tmp_path)
    assert path.name == f"cpu-{result['date']}-abc1234.json"
    assert ENVELOPE_FIELDS <= result.keys()
    assert result["gpu"] == "cpu" and result["commit"] == "abc1234" and result["torch"] == torch.__version__
    records = result["records"]
    assert {(r["backend"], r["pass"]) for r in records} == {
        (backend, pass_) for backend in ("flashmoe", "sdpa-math") for pass_ in ("fwd", "bwd")
    }
    for record in records:
        assert ATTENTION_RECORD_FIELDS <= record.keys()
        assert record["op"] == "attention" and record["dtype"] == "fp32"
        assert record["ms"] > 0 and record["tflops"] > 0
        assert len(record["ms_rounds"]) == 2
        assert record["ms_min"] <= record["ms"] <= record["ms_max"] and record["spread"] >= 0
    assert path.with_suffix(".png").exists()


def test_bench_never_overwrites_a_result(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMOE_COMMIT", "abc1234")
    for _ in range(2):
        assert cli.main(["bench", "--no-plot", "--out", str(tmp_path), "--shapes", "1x1x64x16",
                         "--backends", "sdpa-math"]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(names) == 2 and names[1].endswith("-abc1234.json") and names[0].endswith("-abc1234-2.json")


def test_bench_keeps_partial_results_until_it_completes(tmp_path, monkeypatch, capsys):
    """A run interrupted midway (Ctrl-C, a time limit) leaves `<stem>.partial.json` with every shape measured so far
    and names it; a rerun keeps it (its own partial file is `<stem>-2.partial.json`, removed when it completes)."""
    from flashmoe_science.bench import attention as attention_bench

    monkeypatch.setenv("FLASHMOE_COMMIT", "abc1234")
    measured = attention_bench._measure_backend
    calls = []

    def killed_on_second_shape(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt  # what a timeout's signal looks like from inside
        return measured(*args, **kwargs)

    monkeypatch.setattr(attention_bench, "_measure_backend", killed_on_second_shape)
    assert cli.main(["bench", "--no-plot", "--out", str(tmp_path), "--shapes", "1x1x64x16,1x1x32x16",
                     "--backends", "sdpa-math"]) == cli.EXIT_INTERRUPTED
    (partial,) = tmp_path.glob("*.json")
    assert partial.name.endswith("-abc1234.partial.json")
    last = capsys.readouterr().err.splitlines()[-1]  # after the progress bars
    assert last == f"flashmoe-science: interrupted; what it measured is in {partial}"
    result = json.loads(partial.read_text())
    assert result["partial"] is True and ENVELOPE_FIELDS <= result.keys()
    assert {r["Lq"] for r in result["records"]} == {64}

    monkeypatch.setattr(attention_bench, "_measure_backend", measured)
    assert cli.main(["bench", "--no-plot", "--out", str(tmp_path), "--shapes", "1x1x64x16",
                     "--backends", "sdpa-math"]) == 0
    assert f"-abc1234-2.partial.json until the run completes" in capsys.readouterr().out
    assert sorted(p.name.split("-")[-1] for p in tmp_path.glob("*.json")) == ["abc1234.json", "abc1234.partial.json"]
    assert partial.exists() and json.loads(partial.read_text()) == result


def test_bench_rejects_bad_arguments_in_one_line(capsys):
    for argv in (["bench", "--pass", "sideways"], ["bench", "--backends", "nope"], ["bench", "--shapes", "4x8"],
                 ["bench", "--models", "nope"], ["nonsense"]):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("flashmoe-science: error: ") and "--help" in line


def test_the_feature_suites_refuse_the_flags_they_do_not_read(capsys):
    assert cli.main(["bench", "--suite", "packed", "--pass", "bwd", "--no-plot"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("flashmoe-science: error: bench --suite packed: --pass apply to")


def test_missing_extra_names_the_pip_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    assert cli.main(["bench", "--no-plot"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == 'flashmoe-science: error: tqdm is not installed: pip install "flashmoe-science[cli]"'


def test_command_errors_are_one_line_and_debug_shows_the_traceback(capsys):
    assert cli.main(["bench", "attention", "--models", "mixtral-8x7b"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("flashmoe-science: error: bench attention: --models")
    with pytest.raises(CommandError, match="--models"):
        cli.main(["--debug", "bench", "attention", "--models", "mixtral-8x7b"])


def test_interrupt_exits_130_with_one_line(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_info", interrupted)
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err == "flashmoe-science: interrupted\n"


def test_top_level_help_says_what_the_tool_is(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "attention and Mixture-of-Experts kernels" in out and "--debug" in out
    for command in ("info", "bench", "supercon", "Examples:"):
        assert command in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusals")
@pytest.mark.parametrize("argv, words", [
    (["bench", "decode"], "bench decode"),
    (["bench", "--suite", "decode"], "bench decode"),
    (["bench", "--dtype", "fp8"], "--dtype fp8"),
    (["bench", "--dtype", "bf16"], "--dtype bf16"),
    (["bench", "--suite", "distributed"], "torchrun"),
])
def test_gpu_only_benchmarks_stop_on_a_cpu(argv, words, tmp_path, capsys):
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert words in line and ("CUDA GPU" in line)
    assert not list(tmp_path.iterdir())


def test_import_pulls_no_plotting_or_progress_library():
    """`import flashmoe_science` (and its kernels and layers) works without the `cli` extra and loads neither
    matplotlib nor tqdm (torch itself imports tqdm where it is installed, so only what our import adds counts)."""
    code = textwrap.dedent("""
        import sys
        import torch
        sys.modules["matplotlib"] = sys.modules["tqdm"] = None  # not installed
        before = set(sys.modules)
        import flashmoe_science, flashmoe_science.nn, flashmoe_science.distributed, flashmoe_science.integrations.hf
        added = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("matplotlib", "tqdm"))
        assert sys.modules["matplotlib"] is None and sys.modules["tqdm"] is None
        assert not added, added
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]


def test_bench_moe_rounds_record_the_median(monkeypatch):
    """bench moe --rounds: the whole sweep repeated, each case's median time (and its TFLOP/s) recorded."""
    from flashmoe_science.bench import moe as moe_bench

    times = iter([3.0, 1.0, 9.0, 2.0, 5.0, 4.0])  # rounds of (flashmoe, torch-loop) at one (model, T, pass)
    monkeypatch.setattr(moe_bench, "MODELS", {"tiny": dict(num_experts=4, top_k=2, d_model=64, d_ff=32)})
    monkeypatch.setattr(moe_bench, "CPU_TOKENS", (16,))
    monkeypatch.setattr(moe_bench, "CPU_SHRINK", 1)
    monkeypatch.setattr(moe_bench, "PASSES", ("fwd",))
    monkeypatch.setattr(moe_bench, "_measure", lambda *args, **kwargs: next(times))
    records = moe_bench.run_moe_bench(rounds=3)
    assert [(r["backend"], r["ms"], r["ms_rounds"], r["warmup_ms"]) for r in records] == [
        ("flashmoe", 5.0, [3.0, 9.0, 5.0], 25), ("torch-loop", 2.0, [1.0, 2.0, 4.0], 25)]
    flops = moe_bench.expert_gemm_flops(16, 2, 64, 32, "fwd")
    assert records[0]["tflops"] == pytest.approx(flops / 5e-3 / 1e12, rel=1e-3)
    with pytest.raises(ValueError, match="rounds"):
        moe_bench.run_moe_bench(rounds=0)


def test_bench_moe_writes_envelope_and_table(tmp_path, monkeypatch, capsys):
    def run_moe_bench(quick, progress, on_case_done, rounds, models):
        assert rounds == cli.DEFAULT_ROUNDS
        progress.set_total(2)
        records = []
        for backend, ms in (("flashmoe", 1.0), ("loop", 2.0)):
            records.append({"op": "moe", "T": 4096, "E": 8, "top_k": 2, "d_model": 4096, "d_ff": 14336,
                            "pass": "fwd", "backend": backend, "ms": ms, "tflops": 100.0 / ms})
            progress.update(desc=backend)
            on_case_done(records)
        return records

    from flashmoe_science.bench import moe as moe_bench

    monkeypatch.setattr(moe_bench, "run_moe_bench", run_moe_bench)
    monkeypatch.setenv("FLASHMOE_COMMIT", "abc1234")
    assert cli.main(["bench", "moe", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "loop" in out and "100.0" in out and "50.0" in out
    _, result = _only_json(tmp_path)
    assert ENVELOPE_FIELDS <= result.keys() and len(result["records"]) == 2


# --------------------------------------------------------------------------------------------------------------------
# a backend that fails is n/a, never a crash
# --------------------------------------------------------------------------------------------------------------------
def test_failing_backend_is_skipped_not_fatal():
    def prepare_broken(shape, device):
        def attend(q, k, v):
            raise RuntimeError("no kernel for this shape")

        return attend

    backends = {**attention_bench.BACKENDS, "broken": attention_bench.Backend("broken", prepare_broken)}
    skips = attention_bench.SkipLog()
    progress = report.Progress(stream=io.StringIO())
    records = attention_bench.run_attention_bench(
        [AttentionShape(1, 1, 32, 32, 16, causal=False)], ["sdpa-math", "broken"], ["fwd", "bwd"],
        torch.device("cpu"), torch.float32, attention_bench.cpu_median_ms, progress, skips, backends=backends,
    )
    assert {r["backend"] for r in records} == {"sdpa-math"}
    assert skips.entries[("broken", "fwd")][0] == 1 and "no kernel" in skips.entries[("broken", "bwd")][1]
    assert progress.count == progress.total == 4
    table = attention_bench.attention_table(records, ("sdpa-math",), backend_names=["sdpa-math", "broken"])
    header, _rule, *rows = table.splitlines()[1:]
    assert "broken" in header and len(rows) == 2
    assert all(row.split()[-2:] == ["n/a", "n/a"] for row in rows)  # broken never ran; without ours, no ratio


def test_rounds_record_the_median_of_repeated_sweeps():
    times = iter([3.0, 1.0, 9.0, 2.0, 5.0, 4.0])  # sweep 1: shape A, shape B; sweep 2: A, B; sweep 3: A, B

    def timer(fn, grad_to_none=None):
        fn()
        return next(times)

    shapes = [AttentionShape(1, 1, 32, 32, 16, causal=False), AttentionShape(1, 1, 32, 32, 16, causal=True)]
    progress = report.Progress(stream=io.StringIO())
    seen = []
    records = attention_bench.run_attention_bench(
        shapes, ["sdpa-math"], ["fwd"], torch.device("cpu"), torch.float32, timer, progress,
        on_shape_done=lambda so_far: seen.append([r["ms"] for r in so_far]), rounds=3,
    )
    assert [r["causal"] for r in records] == [False, True]
    assert [r["ms_rounds"] for r in records] == [[3.0, 9.0, 5.0], [1.0, 2.0, 4.0]]
    assert [r["ms"] for r in records] == [5.0, 2.0]
    flops = attention_bench.attention_flops(shapes[0], "fwd")
    assert records[0]["tflops"] == report.round_significant(flops / 5.0e-3 / 1e12)
    assert progress.count == progress.total == 6
    assert seen[-1] == [5.0, 2.0] and len(seen) == 6
    with pytest.raises(ValueError, match="rounds"):
        attention_bench.run_attention_bench(shapes, ["sdpa-math"], ["fwd"], torch.device("cpu"), torch.float32,
                                            timer, progress, rounds=0)


def test_rounds_flag_takes_positive_integers_only(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--rounds", "0"])
    assert "positive integer" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# arithmetic
# --------------------------------------------------------------------------------------------------------------------
def test_attention_flops_follow_the_flashattention_convention():
    shape = AttentionShape(B=4, H=8, Lq=2048, Lk=2048, D=64, causal=False)
    assert attention_bench.attention_flops(shape, "fwd") == 4 * 4 * 8 * 2048 * 2048 * 64
    causal = AttentionShape(B=4, H=8, Lq=2048, Lk=2048, D=64, causal=True)
    assert attention_bench.attention_flops(causal, "fwd") == 2 * 4 * 8 * 2048 * 2048 * 64
    assert attention_bench.attention_flops(causal, "bwd") == 2.5 * attention_bench.attention_flops(causal, "fwd")
    cross = AttentionShape(B=1, H=2, Lq=100, Lk=300, D=32, causal=False)
    assert attention_bench.attention_flops(cross, "fwd") == 4 * 2 * 100 * 300 * 32
    # cudnn at 0.0818 ms on the B=4, H=8, L=2048, D=64 shape is ~420 TFLOP/s
    assert report.tflops(attention_bench.attention_flops(shape, "fwd"), 0.0818) == pytest.approx(420.0, abs=0.5)


def test_ratio_and_geomean():
    assert report.ratio(300.0, 400.0) == 0.75
    assert report.ratio(None, 400.0) is None and report.ratio(300.0, None) is None and report.ratio(1.0, 0.0) is None
    assert report.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert report.geomean([0.5, None, 2.0]) == pytest.approx(1.0)
    assert report.geomean([None]) is None and report.geomean([]) is None


def test_geomean_summary_per_head_dim_causal_and_pass():
    def record(backend, L, D, causal, tflops):
        return {"op": "attention", "pass": "fwd", "B": 16384 // L, "H": 2048 // D, "Hkv": 2048 // D, "Lq": L,
                "Lk": L, "D": D, "causal": causal, "backend": backend, "tflops": tflops}

    records = [
        record("flashmoe", 1024, 64, False, 200.0), record("sdpa-cudnn", 1024, 64, False, 400.0),
        record("flashmoe", 4096, 64, False, 400.0), record("sdpa-cudnn", 4096, 64, False, 200.0),
        record("sdpa-flash", 4096, 64, False, 100.0),
        record("flashmoe", 1024, 64, True, 300.0), record("sdpa-cudnn", 1024, 64, True, 100.0),
        # not on the FA3 grid (B*L != 16384): left out of the summary
        {**record("flashmoe", 2048, 64, False, 1.0), "B": 4, "H": 8, "Hkv": 8},
        {**record("sdpa-cudnn", 2048, 64, False, 999.0), "B": 4, "H": 8, "Hkv": 8},
    ]
    chosen, _ = attention_bench.summary_records(records)
    summary = attention_bench.geomean_ratios(chosen, ("sdpa-cudnn", "sdpa-flash"))
    assert summary[(64, False, "fwd")]["sdpa-cudnn"] == pytest.approx(1.0)  # sqrt(0.5 * 2)
    assert summary[(64, False, "fwd")]["sdpa-flash"] == pytest.approx(4.0)
    assert summary[(64, False, "fwd")]["shapes"] == 2
    assert summary[(64, True, "fwd")]["sdpa-cudnn"] == pytest.approx(3.0)
    assert summary[(64, True, "fwd")]["sdpa-flash"] is None


def test_round_significant_and_format_number():
    assert report.round_significant(456.789) == 456.8
    assert report.round_significant(0.000123456) == 0.0001235
    assert report.format_number(None) == "n/a"
    assert report.format_number(420.04) == "420.0"
    assert report.format_number(0.0421) == "0.042"


# --------------------------------------------------------------------------------------------------------------------
# shapes, names, metadata
# --------------------------------------------------------------------------------------------------------------------
def test_shape_grids():
    full = attention_bench.gpu_shapes(quick=False)
    grid = [s for s in full if s.on_fa3_grid]
    assert len(grid) == 3 * 6 * 2 and len(full) == len(grid) + 3 * 2
    assert all(s.B * s.Lq == 16384 and s.H * s.D == 2048 for s in grid)
    assert AttentionShape(4, 8, 2048, 2048, 64, True) in full
    quick = attention_bench.gpu_shapes(quick=True)
    assert set(quick) < set(full) and len(quick) == 10


def test_parse_shape():
    assert attention_bench.parse_shape("4x8x2048x64") == [
        AttentionShape(4, 8, 2048, 2048, 64, False), AttentionShape(4, 8, 2048, 2048, 64, True)]
    assert attention_bench.parse_shape("1X2x100x300x32")[0] == AttentionShape(1, 2, 100, 300, 32, False)
    for bad in ("4x8x2048", "4x8xLx64", "0x8x2048x64"):
        with pytest.raises(ValueError):
            attention_bench.parse_shape(bad)


def test_result_file_names():
    assert report.slugify("NVIDIA H200") == "nvidia-h200"
    assert report.slugify("NVIDIA GeForce RTX 4090 (laptop)") == "nvidia-geforce-rtx-4090-laptop"
    assert report.result_stem("NVIDIA H200", "2026-11-21", "5cb4110") == "nvidia-h200-2026-11-21-5cb4110"
    assert report.result_stem("cpu", "2026-11-21", "unknown") == "cpu-2026-11-21-unknown"


def test_commit_precedence(monkeypatch):
    monkeypatch.setenv("FLASHMOE_COMMIT", "fromenv")
    assert report.resolve_commit("explicit") == "explicit"
    assert report.resolve_commit(None) == "fromenv"
    monkeypatch.delenv("FLASHMOE_COMMIT")
    commit = report.resolve_commit(None)  # git in a checkout, "unknown" in a copy without .git
    assert commit == "unknown" or all(c in "0123456789abcdef" for c in commit)


def test_cudnn_version_decoding(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert report.cudnn_version() == "9.19.0"
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8907)
    assert report.cudnn_version() == "8.9.7"
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None)
    assert report.cudnn_version() is None


def test_progress_bar_text():
    stream = io.StringIO()
    with report.Progress(total=4, desc="attention", stream=stream, log_interval_s=math.inf) as progress:
        progress.update(desc="first")
        progress.update(n=3, desc="rest")
        text = progress.render()
        assert "attention" in text and "4/4" in text and "100%" in text and "rest" in text
    # not a terminal: the bar at the start, then once at the end, no refresh in between
    assert stream.getvalue().count("/4") == 2 and "first" not in stream.getvalue()
    unknown_total = report.Progress(desc="moe", stream=io.StringIO())
    unknown_total.update()
    assert "1 done" in unknown_total.render()
    unknown_total.set_total(8)  # the benchmarks set their total once the grid is known: then "1/8" and a time left
    assert "1/8" in unknown_total.render() and "12%" in unknown_total.render()


def test_attention_flops_count_the_visible_pairs_of_a_bottom_right_mask():
    # Lq=2, Lk=4, causal bottom-right: query 0 sees 3 keys, query 1 sees 4 -> 7 pairs
    shape = AttentionShape(B=1, H=1, Lq=2, Lk=4, D=8, causal=True)
    assert attention_bench.attention_flops(shape, "fwd") == 4.0 * 7 * 8
    # Lq > Lk: the first Lq - Lk queries see nothing
    shape = AttentionShape(B=1, H=1, Lq=5, Lk=2, D=8, causal=True)
    assert attention_bench.attention_flops(shape, "fwd") == 4.0 * (0 + 0 + 0 + 1 + 2) * 8


def test_bench_shapes_error_names_the_problem(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--shapes", ","])
    assert "comma-separated list" in capsys.readouterr().err


def test_bench_writes_to_a_user_folder_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--no-plot", "--rounds", "1", "--shapes", "1x1x32x16", "--backends", "sdpa-math"]) == 0
    assert len(list((tmp_path / "flashmoe-results").glob("*.json"))) == 1


def test_spread_column_and_noisy_flag():
    records = [
        report.median_over_rounds([{"backend": "a", "L": 1, "ms": ms} for ms in (1.0, 1.02, 0.99)], lambda r, ms: 0),
        report.median_over_rounds([{"backend": "a", "L": 2, "ms": ms} for ms in (1.0, 1.5, 1.1)], lambda r, ms: 0),
    ]
    assert records[0]["spread"] == pytest.approx(0.03) and records[1]["spread"] == pytest.approx(0.45)
    assert (records[1]["ms_min"], records[1]["ms"], records[1]["ms_max"]) == (1.0, 1.1, 1.5)
    table = report.records_table(records, row_fields=("L",), value_key="ms")
    assert [line.split()[-1] for line in table.splitlines()[2:]] == ["3%", "45%!"]
    note = report.noise_note(records)
    assert "3 rounds" in note and "noisy machine: 1 of 2 cases" in note
    assert report.noise_note([{"ms": 1.0}]) == ""


def test_bench_moe_rejects_attention_only_options(capsys):
    assert cli.main(["bench", "moe", "--shapes", "4x8x2048x64"]) == 2
    assert "--shapes" in capsys.readouterr().err


def test_gpu_median_ms_windows(monkeypatch):
    """report.gpu_median_ms: do_bench's short warm-up, or with sustained=True SUSTAINED_WARMUP_MS of back-to-back
    calls; bench moe picks the window per case by its FLOPs, the same for every backend."""
    pytest.importorskip("triton")
    import triton.testing

    from flashmoe_science.bench import moe as moe_bench
    from flashmoe_science.bench import report

    calls = []

    def fake_do_bench(fn, warmup, rep, grad_to_none=None, return_mode="mean"):
        calls.append((warmup, rep))
        return 1.5

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    assert report.gpu_median_ms(lambda: None) == 1.5 and calls == [(report.SHORT_WARMUP_MS, 100)]
    assert report.gpu_median_ms(lambda: None, sustained=True) == 1.5
    assert calls[-1] == (report.SUSTAINED_WARMUP_MS, report.SUSTAINED_REP_MS)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    mixtral_4096 = moe_bench.expert_gemm_flops(4096, 2, 4096, 14336, "fwd")
    qwen3_256 = moe_bench.expert_gemm_flops(256, 8, 2048, 768, "bwd")
    assert moe_bench.sustained_window(mixtral_4096, "eager", cuda)
    assert not moe_bench.sustained_window(mixtral_4096, "cuda-graph", cuda)
    assert not moe_bench.sustained_window(mixtral_4096, "eager", cpu)
    assert not moe_bench.sustained_window(qwen3_256, "eager", cuda)


def test_bench_moe_models_picks_models_and_rejects_unknown(monkeypatch):
    from flashmoe_science.bench import moe as moe_bench

    monkeypatch.setattr(moe_bench, "MODELS", {"tiny": dict(num_experts=4, top_k=2, d_model=64, d_ff=32),
                                              "other": dict(num_experts=4, top_k=1, d_model=64, d_ff=32)})
    monkeypatch.setattr(moe_bench, "CPU_TOKENS", (16,))
    monkeypatch.setattr(moe_bench, "CPU_SHRINK", 1)
    monkeypatch.setattr(moe_bench, "PASSES", ("fwd",))
    monkeypatch.setattr(moe_bench, "_measure", lambda *args, **kwargs: 1.0)
    records = moe_bench.run_moe_bench(models=["other"])
    assert {r["model"] for r in records} == {"other"}
    with pytest.raises(ValueError, match="models: unknown nope"):
        moe_bench.run_moe_bench(models=["nope"])


def test_bench_attention_refuses_models(capsys):
    assert cli.main(["bench", "attention", "--models", "mixtral-8x7b"]) == 2
    assert "--models applies to the MoE benchmark" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke test")
@pytest.mark.slow
def test_bench_varlen_quick_on_cpu_times_the_padded_hf_batch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHMOE_COMMIT", "abc1234")
    assert cli.main(["bench", "--suite", "varlen", "--quick", "--no-plot", "--rounds", "1",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "hf/sdpa-padded" in out
    assert "sdpa-cudnn-padded" not in out  # no ratio column for a backend the run did not have (cuDNN: CUDA only)
    _, result = _only_json(tmp_path)
    padded = {(r["backend"], r["pass"]) for r in result["records"] if r["case"].startswith("HF padded")}
    assert padded == {(backend, pass_) for backend in ("flashmoe-hf", "sdpa-padded") for pass_ in ("fwd", "bwd")}


def test_padded_hf_batch_contenders_agree_on_the_real_tokens():
    """The padded batch's contenders compute one attention: ours (packed real tokens) and transformers' sdpa with its
    (B, 1, L, L) mask agree on every real query row, forward and gradients, against a float64 SDPA per sequence."""
    from flashmoe_science.bench import features

    case = next(c for c in features.feature_cases(["varlen"], True, torch.device("cpu"), torch.float64)
                if c.name.startswith("HF padded"))
    lengths = features.padded_batch_lengths(features.PADDED_ROWS, 512 // features.CPU_SHRINK,
                                            4096 // features.CPU_SHRINK)
    inputs = case.contenders["flashmoe-hf"].make_inputs()
    real = torch.arange(inputs[0].shape[1]) < torch.tensor(lengths)[:, None]
    dout = torch.randn_like(inputs[0]) * real[..., None, None]
    expected = torch.zeros_like(inputs[0])
    for row, n in enumerate(lengths):
        q, k, v = (t[row, :n].transpose(0, 1) for t in inputs)
        expected[row, :n] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
    grads = {}
    for name in ("flashmoe-hf", "sdpa-padded"):
        q, k, v = (t.clone().requires_grad_(True) for t in inputs)
        out = case.contenders[name].attend(q, k, v)
        torch.testing.assert_close(out[real], expected[real])
        out.backward(dout)
        grads[name] = [t.grad[real] for t in (q, k, v)]
    for ours, theirs in zip(grads["flashmoe-hf"], grads["sdpa-padded"]):
        torch.testing.assert_close(ours, theirs)
