"""The documents agree with the data and speak of the code only.

- docs/benchmarks.md and the README's headline table are what benchmarks/tools/benchmarks_doc.py generates from
  benchmarks/results/ (rerun the script after publishing a run).
- README.md stays a first hour's read: at most 300 lines.
- No file of the repository narrates how the work was organised (numbered rounds, work sessions, references to an
  issue tracker): a comment or a document says why in terms of the code and its measurements.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
NARRATION = re.compile(r"\b(session|sessions)\b|the brief|the issue|issue #?\d+|round \d+", re.IGNORECASE)
CHECKED = ("src", "docs", "README.md", "tests", "benchmarks/tools", "examples")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml", ".cfg", ".rst", ".yaml", ".yml"}


def _benchmarks_doc():
    spec = importlib.util.spec_from_file_location("benchmarks_doc", ROOT / "benchmarks/tools/benchmarks_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_doc_and_readme_headline_are_generated_from_the_results():
    assert _benchmarks_doc().main(["--check"]) == 0, (
        "docs/benchmarks.md or README.md's headline table is stale: run python benchmarks/tools/benchmarks_doc.py"
    )


def test_readme_is_at_most_300_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def _text_files():
    for name in CHECKED:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            if file.suffix in TEXT_SUFFIXES and "__pycache__" not in file.parts and file != Path(__file__).resolve():
                yield file


def test_no_file_narrates_how_the_work_was_organised():
    hits = []
    for file in _text_files():
        for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
            match = NARRATION.search(line)
            if match:
                hits.append(f"{file.relative_to(ROOT)}:{number}: {match.group(0)!r}: {line.strip()[:100]}")
    assert not hits, "narration instead of code and measurements:\n" + "\n".join(hits)


def test_a_varlen_run_beside_fa4_renders_with_ours_over_fa4(tmp_path):
    """A published varlen run with FlashAttention-4's `fa4-varlen` gets its column and the ours / FA4 ratio, forward
    and backward, in docs/benchmarks.md's masks-and-packed-sequences table (a synthetic run in a temporary folder)."""
    case = "long tail: 49 seqs 64..1626, 16384 tokens, causal"
    speeds = {("fwd", "flashmoe-varlen"): 300.0, ("fwd", "fa4-varlen"): 200.0,
              ("bwd", "flashmoe-varlen"): 150.0, ("bwd", "fa4-varlen"): 200.0, ("fwd", "sdpa-nested"): 20.0}
    records = [{"op": "attention-features", "suite": "varlen", "case": case, "pass": pass_, "backend": backend,
                "dtype": "bfloat16", "flops": 1e12, "ms": 1e3 / tflops, "tflops": tflops, "note": ""}
               for (pass_, backend), tflops in speeds.items()]
    path = tmp_path / "nvidia-h200-2026-01-01-abcdef0-varlen.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "torch": "2.11.0", "flash_attn_4": "4.0.0b36",
                                "commit": "abcdef0", "date": "2026-01-01", "records": records}))
    text = _benchmarks_doc().render_file(path)
    assert "FlashAttention-4 4.0.0b36" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| case"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert "fa4-varlen" in columns and "flashmoe-varlen / fa4-varlen" in columns
    ratio_at = columns.index("flashmoe-varlen / fa4-varlen")
    ratios = {cells[1]: cells[ratio_at] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                                      for line in lines if line.startswith(f"| {case}"))}
    assert ratios == {"fwd": "1.50", "bwd": "0.75"}


def test_a_multi_gpu_run_is_headed_with_its_gpu_count(tmp_path):
    """A run on several GPUs records the device's name; its file name (`<gpu>-xN-<date>-...`) carries the count,
    which the heading adds unless the name already says it."""
    doc = _benchmarks_doc()
    records = [{"op": "megatron-train", "gpus": 4, "kernels": "flashmoe", "tokens_per_s": 1.0}]
    headings = {}
    for name, gpu in (("nvidia-h200-x4-2026-01-01-abcdef0-megatron", "NVIDIA H200"),
                      ("nvidia-h200-x4-2026-01-02-abcdef0-torchtitan", "NVIDIA H200 x4 (NVLink, NCCL)"),
                      ("nvidia-h200-2026-01-03-abcdef0-megatron", "NVIDIA H200")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"gpu": gpu, "torch": "2.11.0", "commit": "abcdef0", "date": "2026-01-01",
                                    "records": records}))
        headings[name] = doc.render_file(path).splitlines()[2]
    assert headings["nvidia-h200-x4-2026-01-01-abcdef0-megatron"].startswith("NVIDIA H200 x4, ")
    assert headings["nvidia-h200-x4-2026-01-02-abcdef0-torchtitan"].startswith("NVIDIA H200 x4 (NVLink, NCCL), ")
    assert headings["nvidia-h200-2026-01-03-abcdef0-megatron"].startswith("NVIDIA H200, ")
