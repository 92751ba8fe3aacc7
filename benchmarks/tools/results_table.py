#!/usr/bin/env python
"""Markdown tables from a `flashmoe-science bench` JSON file (docs/benchmarks.md is built from these).

    python benchmarks/tools/results_table.py benchmarks/results/<file>.json          # attention: one table per pass
    python benchmarks/tools/results_table.py --moe benchmarks/results/<file>.json    # the MoE layer benchmark

Attention: one row per shape (B, H, L, D, causal), TFLOP/s of flashmoe, fa4, sdpa-cudnn, sdpa-flash and flex, then
flashmoe's ratio to each baseline (FA4 = FlashAttention-4, cuDNN, FA2 = sdpa-flash); one table per pass (fwd, bwd); then the geometric mean
of those ratios per (D, causal) over the FlashAttention-3 grid (B·L = 16384, H·D = 2048), or over all shapes when the
file has none on the grid (a CPU run). Backends or baselines missing from the file are left out; `--backends` and
`--baselines` choose them explicitly.

MoE (`--moe`): one row per (model, T), TFLOP/s of flashmoe, torch-grouped-mm and torch-loop, flashmoe's ratio to
each; one table per pass.

The numbers are printed as recorded (nothing is recomputed); "n/a" marks a backend that has no record for that row
(unsupported, skipped or failed in that run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Mapping, Sequence

try:
    import flashmoe_science  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from flashmoe_science.bench.attention import (
    BACKEND_ORDER,
    OURS,
    PASSES,
    geomean_ratios,
    shape_of,
    summary_records,
)
from flashmoe_science.bench.report import NOT_AVAILABLE, format_number, ordered_columns, pivot, ratio

ATTENTION_COLUMNS = ("flashmoe", "fa4", "sdpa-cudnn", "sdpa-flash", "flex")
ATTENTION_BASELINES = ("fa4", "sdpa-cudnn", "sdpa-flash")
MOE_COLUMNS = ("flashmoe", "torch-grouped-mm", "torch-loop")
MOE_BASELINES = ("torch-grouped-mm", "torch-loop")
PASS_TITLES = {"fwd": "Forward", "bwd": "Backward"}
SHORT_NAMES = {"fa4": "FA4", "sdpa-cudnn": "cuDNN", "sdpa-flash": "FA2", "sdpa-efficient": "efficient", "sdpa-math": "math",
               "torch-grouped-mm": "grouped-mm", "torch-loop": "loop"}


# --------------------------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------------------------
def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 1) -> str:
    """A GitHub Markdown table; the first `text_columns` columns left-aligned, the rest (numbers) right-aligned."""
    align = ["---" if index < text_columns else "---:" for index in range(len(headers))]
    lines = [headers, align, *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def ratio_cell(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:.2f}"


def ratio_label(baseline: str) -> str:
    return f"{OURS} / {SHORT_NAMES.get(baseline, baseline)}"


def environment_line(data: Mapping, records: Sequence[Mapping], path: Path) -> str:
    dtypes = ", ".join(sorted({str(r.get("dtype")) for r in records})) or "?"
    versions = ", ".join(
        f"{label} {data[key]}"
        for key, label in (("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"), ("cudnn", "cuDNN"),
                              ("flash_attn_4", "FlashAttention-4"))
        if data.get(key)
    )
    timer = "time.perf_counter medians" if data.get("gpu") == "cpu" else "medians of triton.testing.do_bench"
    sustained = sorted({r["warmup_ms"] for r in records if r.get("warmup_ms", 0) >= 1000})
    if sustained:  # bench moe's large cases: timed in the power-capped steady state (report.gpu_median_ms)
        timer += f" (rows whose records carry warmup_ms {sustained[0]}: after {sustained[0]} ms of back-to-back calls)"
    return (
        f"{data.get('gpu', '?')}, {data.get('date', '?')}, commit `{data.get('commit', '?')}`; {versions}; "
        f"{dtypes}; TFLOP/s, {timer}. Source: `{path.name}`."
    )


def present_backends(records: Sequence[Mapping]) -> list[str]:
    return ordered_columns((r["backend"] for r in records), BACKEND_ORDER)


def choose(requested: Sequence[str] | None, defaults: Sequence[str], present: Sequence[str], ours: bool) -> list[str]:
    """`requested` as given; else the defaults that occur in the file; if none of them does (e.g. a CPU run without
    cuDNN or FA2), every backend that occurs (without ours when choosing baselines)."""
    if requested:
        return list(requested)
    chosen = [name for name in defaults if name in present and (ours or name != OURS)]
    if any(name != OURS for name in chosen):
        return chosen
    others = [name for name in present if name != OURS]
    return ([OURS] if ours and OURS in present else []) + others


# --------------------------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------------------------
def shape_key(record: Mapping) -> tuple:
    return (record["B"], record["H"], record.get("Hkv", record["H"]), record["Lq"], record["Lk"], record["D"],
            bool(record["causal"]))


def shape_cells(key: tuple) -> list[str]:
    B, H, Hkv, Lq, Lk, D, causal = key
    heads = str(H) if Hkv == H else f"{H} (kv {Hkv})"
    length = str(Lq) if Lq == Lk else f"{Lq} × {Lk}"
    return [str(B), heads, length, str(D), "yes" if causal else "no"]


def attention_pass_table(records: Sequence[Mapping], columns: Sequence[str], baselines: Sequence[str]) -> str:
    # the FlashAttention-3 grid first (by D, causal, L), then any other shapes (e.g. B=4 H=8 D=64)
    order = lambda r: (not shape_of(r).on_fa3_grid, r["D"], r["causal"], r["Lq"], r["Lk"], -r["B"])  # noqa: E731
    by_shape = pivot(sorted(records, key=order), shape_key)
    headers = ["B", "H", "L", "D", "causal", *columns, *map(ratio_label, baselines)]
    rows = [
        shape_cells(key)
        + [format_number(values.get(column)) for column in columns]
        + [ratio_cell(ratio(values.get(OURS), values.get(baseline))) for baseline in baselines]
        for key, values in by_shape.items()
    ]
    return markdown_table(headers, rows, text_columns=0)


def attention_summary_table(records: Sequence[Mapping], baselines: Sequence[str]) -> tuple[str, str]:
    chosen, description = summary_records(records)
    summary = geomean_ratios(chosen, baselines)
    headers = ["pass", "D", "causal", "shapes", *map(ratio_label, baselines)]
    rows = [
        [pass_, str(D), "yes" if causal else "no", str(entry["shapes"])]
        + [ratio_cell(entry[baseline]) for baseline in baselines]
        for (D, causal, pass_), entry in summary.items()
    ]
    return markdown_table(headers, rows, text_columns=1), description


def attention_markdown(data: Mapping, path: Path, backends=None, baselines=None) -> str:
    records = [r for r in data.get("records", []) if r.get("op", "attention") == "attention"]
    if not records:
        raise SystemExit(f"{path}: no attention records (for the MoE benchmark use --moe)")
    present = present_backends(records)
    columns = choose(backends, ATTENTION_COLUMNS, present, ours=True)
    ratio_to = choose(baselines, ATTENTION_BASELINES, present, ours=False)
    dtypes = list(dict.fromkeys(r.get("dtype") for r in records))
    passes = ordered_columns((r["pass"] for r in records), PASSES)

    parts = [environment_line(data, records, path)]
    for dtype in dtypes:
        for pass_ in passes:
            chosen = [r for r in records if r["pass"] == pass_ and r.get("dtype") == dtype]
            if not chosen:
                continue
            title = PASS_TITLES.get(pass_, pass_) + (f", {dtype}" if len(dtypes) > 1 else "")
            parts.append(f"**{title}** (TFLOP/s; {NOT_AVAILABLE}: no record for that backend and shape)\n\n"
                         + attention_pass_table(chosen, columns, ratio_to))
        if ratio_to:
            table, description = attention_summary_table([r for r in records if r.get("dtype") == dtype], ratio_to)
            dtype_note = f", {dtype}" if len(dtypes) > 1 else ""
            parts.append(f"**Geometric mean of {OURS}'s TFLOP/s ratios over {description}{dtype_note}**\n\n{table}")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------------------------------------------------
# MoE
# --------------------------------------------------------------------------------------------------------------------
def _model_name(record: Mapping) -> str:
    return str(record.get("model") or record.get("config") or f"E{record.get('E')}-k{record.get('top_k')}")


# HBM bandwidth of the H200, the ceiling of the few-token rows (the layer reads its routed experts' weights once)
WEIGHT_READ_GBPS = 4300.0


def moe_decode_table(records: Sequence[Mapping], columns: Sequence[str], models: Sequence[str]) -> str:
    """Few-token forward records with ``weight_gbps``: per (model, T, timing), each backend's GB/s of expert
    weights and ours as a share of WEIGHT_READ_GBPS."""
    chosen = sorted((r for r in records if r.get("weight_gbps") is not None),
                    key=lambda r: (models.index(_model_name(r)), r["T"], r.get("timing", "eager")))
    by_row = pivot(chosen, lambda r: (_model_name(r), r["T"], r.get("timing", "eager")), value_key="weight_gbps")
    headers = ["model", "T", "timing", *columns, f"{OURS} / {WEIGHT_READ_GBPS / 1000:.1f} TB/s"]
    rows = [
        [model, str(T), timing]
        + [format_number(values.get(column), digits=0) for column in columns]
        + [ratio_cell(ratio(values.get(OURS), WEIGHT_READ_GBPS))]
        for (model, T, timing), values in by_row.items()
    ]
    return markdown_table(headers, rows, text_columns=3)


def moe_markdown(data: Mapping, path: Path, backends=None, baselines=None) -> str:
    all_records = [r for r in data.get("records", []) if r.get("op") == "moe"]
    if not all_records:
        raise SystemExit(f"{path}: no records with \"op\": \"moe\" (run `flashmoe-science bench moe`)")
    records = [r for r in all_records if r.get("timing", "eager") == "eager"]  # (older files have no timing)
    present = ordered_columns((r["backend"] for r in records), MOE_COLUMNS)
    models = list(dict.fromkeys(map(_model_name, records)))  # in the file's order
    columns = choose(backends, MOE_COLUMNS, present, ours=True)
    ratio_to = choose(baselines, MOE_BASELINES, present, ours=False)
    passes = ordered_columns((r["pass"] for r in records), PASSES)

    parts = [environment_line(data, records, path)]
    for pass_ in passes:
        chosen = sorted((r for r in records if r["pass"] == pass_), key=lambda r: (models.index(_model_name(r)), r["T"]))
        by_row = pivot(chosen, lambda r: (_model_name(r), r["T"]))
        headers = ["model", "T", *columns, *map(ratio_label, ratio_to)]
        rows = [
            [model, str(T)]
            + [format_number(values.get(column)) for column in columns]
            + [ratio_cell(ratio(values.get(OURS), values.get(baseline))) for baseline in ratio_to]
            for (model, T), values in by_row.items()
        ]
        parts.append(f"**MoE layer, {PASS_TITLES.get(pass_, pass_).lower()}** (TFLOP/s of the expert GEMMs; "
                     f"{NOT_AVAILABLE}: no record)\n\n" + markdown_table(headers, rows, text_columns=1))
    if any(r.get("weight_gbps") is not None for r in all_records):
        parts.append("**MoE layer, few tokens: expert-weight read bandwidth** (GB/s: bytes of the experts the tokens "
                     "are routed to, read once, per second of the forward; cuda-graph: the call captured in a CUDA "
                     "graph and replayed, the GPU's time alone; eager: launched from Python each call, which "
                     "includes host time where the host is the slower side)\n\n"
                     + moe_decode_table(all_records, columns, models))
    configs = {}
    for r in records:
        configs.setdefault(_model_name(r), r)
    parts.append("Models: " + "; ".join(
        f"{name}: E={r.get('E')}, top_k={r.get('top_k')}, d_model={r.get('d_model')}, d_ff={r.get('d_ff')}"
        for name, r in configs.items()
    ) + ".")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------------------------------------------------
def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="a results file written by `flashmoe-science bench`")
    parser.add_argument("--moe", action="store_true", help='tables for the MoE records ("op": "moe")')
    parser.add_argument("--backends", type=_comma_list, help="TFLOP/s columns, comma-separated (default: "
                        f"{','.join(ATTENTION_COLUMNS)}; with --moe {','.join(MOE_COLUMNS)})")
    parser.add_argument("--baselines", type=_comma_list, help="ratio columns: flashmoe / each of these (default: "
                        f"{','.join(ATTENTION_BASELINES)}; with --moe {','.join(MOE_BASELINES)})")
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.json.read_text())
    except (OSError, json.JSONDecodeError) as error:
        parser.error(f"cannot read {args.json}: {error}")
    if data.get("commit") in (None, "", "unknown"):
        print(f"warning: {args.json} records no commit; rerun the bench with --commit <sha> (or FLASHMOE_COMMIT) "
              "so the table can name it", file=sys.stderr)
    render = moe_markdown if args.moe else attention_markdown
    print(render(data, args.json, args.backends, args.baselines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
