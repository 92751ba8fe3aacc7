#!/usr/bin/env python
"""Fill docs/ladder.md's measured sections from a `flashmoe-science bench --suite ladder` JSON file.

    python benchmarks/tools/ladder_doc.py benchmarks/results/<gpu>-<date>-<commit>.json [--doc docs/ladder.md]

Only the marked sections are rewritten; the rest of the doc is left as it is:
- between `<!-- ladder:table:begin -->` and `<!-- ladder:table:end -->`: where the numbers come from (GPU, commit,
  date, versions), one table per series (dtype, causal) with every rung's TFLOP/s per L and each rung's gain over
  the rung below, the peak memory per rung and L, and where rungs stopped and why;
- between `<!-- ladder:gain:<rung>:begin -->` and `<!-- ladder:gain:<rung>:end -->` in each rung's section: the
  rung's measured TFLOP/s and its gain over the rung below, per series (range over the lengths both ran, and the
  geometric mean).
Numbers are printed as recorded; the only arithmetic is the ratios between rungs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

try:
    import flashmoe_science  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from results_table import markdown_table  # noqa: E402  (this folder)

from flashmoe_science.attention.ladder import RUNGS  # noqa: E402
from flashmoe_science.bench.report import format_number, geomean, ratio  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "ladder.md"
NAMES = [r.name for r in RUNGS]
BELOW = dict(zip(NAMES[1:], NAMES))  # rung -> the rung below it


def _series_key(record: dict) -> tuple[str, bool]:
    return record["dtype"], record["causal"]


def _series_label(key: tuple[str, bool]) -> str:
    return f"{key[0]} {'causal' if key[1] else 'non-causal'}"


def _by_series(records: list[dict]) -> dict[tuple[str, bool], dict[int, dict[str, dict]]]:
    """{(dtype, causal): {L: {rung: record}}}, series and lengths in the order of the run."""
    table: dict[tuple[str, bool], dict[int, dict[str, dict]]] = {}
    for record in records:
        table.setdefault(_series_key(record), {}).setdefault(record["Lq"], {})[record["backend"]] = record
    return table


def _source_line(result: dict, path: Path) -> str:
    versions = ", ".join(f"{name} {result[name]}" for name in ("torch", "triton", "cuda") if result.get(name))
    line = f"Measured on {result['gpu']} at commit `{result['commit']}`, {result['date']} ({versions}); `{path.name}`."
    if result["records"]:
        first = result["records"][0]
        line += (f" B·L = {first['B'] * first['Lq']}, H = {first['H']}, D = {first['D']}; TFLOP/s count "
                 "4·B·H·L²·D, halved when causal.")
    return line


def measured_tables(result: dict, path: Path) -> str:
    """The table section: source, one TFLOP/s table per series, peak memory, and the stops."""
    parts = [_source_line(result, path)]
    for key, lengths in _by_series(result["records"]).items():
        names = [n for n in NAMES if any(n in by_rung for by_rung in lengths.values())]
        gains = [(upper, lower) for lower, upper in zip(names, names[1:])]
        rows = [[str(L), str(next(iter(by_rung.values()))["B"])]
                + [format_number(by_rung[n]["tflops"]) if n in by_rung else "n/a" for n in names]
                + [format_number(ratio(by_rung.get(u, {}).get("tflops"), by_rung.get(lo, {}).get("tflops")), 2)
                   for u, lo in gains]
                for L, by_rung in lengths.items()]
        headers = ["L", "B", *names, *(f"{u} / {lo}" for u, lo in gains)]
        parts.append(f"**TFLOP/s, {_series_label(key)}** (a / b: rung a's TFLOP/s over rung b's)\n\n"
                     + markdown_table(headers, rows, text_columns=0))
    memory = _by_series([r for r in result["records"] if r.get("peak_mem_mib") is not None])
    for key, lengths in list(memory.items())[:1]:  # peak memory barely depends on the dtype or the mask
        names = [n for n in NAMES if any(n in by_rung for by_rung in lengths.values())]
        rows = [[str(L)] + [format_number(by_rung[n]["peak_mem_mib"]) if n in by_rung else "n/a" for n in names]
                for L, by_rung in lengths.items()]
        parts.append(f"**Peak GPU memory beyond the inputs, MiB, {_series_label(key)}**\n\n"
                     + markdown_table(["L", *names], rows, text_columns=0))
    stops = result.get("stopped") or []
    if stops:
        parts.append("Where rungs stopped:\n\n" + "\n".join(
            f"- {s['backend']} ({s['series']}): " + (f"at L = {s['L']}: " if s.get("L") else "not run: ") + s["reason"]
            for s in stops))
    return "\n\n".join(parts)


def gain_sentence(result: dict, rung: str) -> str:
    """The rung's measured TFLOP/s and gain over the rung below, one clause per series."""
    clauses = []
    for key, lengths in _by_series(result["records"]).items():
        ours = {L: by_rung[rung]["tflops"] for L, by_rung in lengths.items() if rung in by_rung}
        if not ours:
            continue
        clause = (f"{_series_label(key)}: {format_number(min(ours.values()))}–{format_number(max(ours.values()))} "
                  f"TFLOP/s (L = {min(ours)}–{max(ours)})")
        below = BELOW.get(rung)
        gains = {L: ratio(t, lengths[L].get(below, {}).get("tflops")) for L, t in ours.items()} if below else {}
        gains = {L: g for L, g in gains.items() if g is not None}
        if gains:
            clause += (f", {format_number(min(gains.values()), 2)}–{format_number(max(gains.values()), 2)}x "
                       f"{below} (geometric mean {format_number(geomean(gains.values()), 2)}x over L = "
                       f"{min(gains)}–{max(gains)})")
        clauses.append(clause)
    stops = [s for s in result.get("stopped") or [] if s["backend"] == rung]
    on_host = result["gpu"] != "cpu" and any(r["backend"] == rung and r.get("device") == "cpu"
                                             for r in result["records"])
    where = f"on the host CPU of the {result['gpu']} machine" if on_host else f"on {result['gpu']}"
    text = f"Measured {where}: " + "; ".join(clauses) + "." if clauses else f"Not measured {where}."
    if stops:
        text += " " + " ".join(f"Stopped ({s['series']}" + (f", at L = {s['L']}" if s.get("L") else "")
                               + f"): {s['reason']}." for s in stops)
    return text


def fill(doc: str, name: str, content: str) -> str:
    """`doc` with the text between `<!-- ladder:<name>:begin -->` and `<!-- ladder:<name>:end -->` replaced."""
    pattern = re.compile(rf"(<!-- ladder:{re.escape(name)}:begin -->\n).*?(\n<!-- ladder:{re.escape(name)}:end -->)",
                         re.DOTALL)
    if not pattern.search(doc):
        raise ValueError(f"the doc has no section marked <!-- ladder:{name}:begin/end -->")
    return pattern.sub(lambda m: m.group(1) + content + m.group(2), doc)


def filled_doc(doc: str, result: dict, path: Path) -> str:
    doc = fill(doc, "table", measured_tables(result, path))
    for rung in NAMES:
        doc = fill(doc, f"gain:{rung}", gain_sentence(result, rung))
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path, help="a ladder JSON from `flashmoe-science bench --suite ladder`")
    parser.add_argument("--doc", type=Path, default=DOC, help=f"the doc to fill (default {DOC})")
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    if result.get("suite") != "ladder":
        print(f"{args.result}: not a ladder result (its envelope has no \"suite\": \"ladder\")", file=sys.stderr)
        return 2
    args.doc.write_text(filled_doc(args.doc.read_text(), result, args.result))
    print(f"filled {args.doc} from {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
