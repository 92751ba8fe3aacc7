"""Everything a benchmark run reports, independent of what was measured.

The bench modules (`bench.attention`, `bench.moe`) produce *records*: flat dicts, one per measurement. This module
turns them into the things a person reads or keeps: a progress bar while they run, a table and ratio summaries on
screen, a JSON file with the environment it ran in, and a PNG plot.

Numbers follow the FlashAttention convention: TFLOP/s = FLOPs / time, FLOPs counted by the bench module.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Hashable, Iterable, Mapping, Sequence, TextIO

import torch

from flashmoe_science.errors import CommandError

# Where every benchmark command writes unless --out says otherwise: a folder of the user's, never beside the
# published runs in benchmarks/results.
DEFAULT_OUT = "flashmoe-results"

NOT_AVAILABLE = "n/a"


# --------------------------------------------------------------------------------------------------------------------
# Progress bar
# --------------------------------------------------------------------------------------------------------------------
class Progress:
    """The progress bar every benchmark shares: tqdm on stderr, with the name of the step that just ran beside it.

    Interface (what `bench.moe.run_moe_bench(quick, progress)` receives):

        progress = Progress(total=84, desc="attention")
        progress.set_total(84)                   # if the number of steps is only known later; None = unknown
        progress.update(desc="fwd L=2048 flex")  # after each finished step; `desc` names what just ran
        progress.update(n=3)                     # several steps at once (e.g. a skipped group)
        progress.close()                         # ends the bar; also done by `with Progress(...) as progress:`

    On a terminal the bar redraws in place. When the stream is not a terminal (a log file, a remote run whose output
    is captured) it refreshes at most every `log_interval_s` seconds, so logs stay short.
    """

    def __init__(self, total: int | None = None, desc: str = "", stream: TextIO | None = None,
                 log_interval_s: float = 10.0):
        from tqdm import tqdm

        stream = stream if stream is not None else sys.stderr
        interactive = bool(getattr(stream, "isatty", lambda: False)())
        self._bar = tqdm(total=total, desc=desc or None, file=stream, ascii=not interactive, leave=True,
                         dynamic_ncols=interactive, mininterval=0.1 if interactive else log_interval_s,
                         maxinterval=math.inf, bar_format=self._format(total))

    @property
    def count(self) -> int:
        return self._bar.n

    @property
    def total(self) -> int | None:
        return self._bar.total

    @staticmethod
    def _format(total: int | None) -> str | None:
        """tqdm's bar (count of total, rate, time left) once the total is known; before, the count so far."""
        return None if total else "{desc}: {n} done, {elapsed}{postfix}"

    def set_total(self, total: int | None) -> None:
        self._bar.total = total
        self._bar.bar_format = self._format(total)
        self._bar.refresh()

    def update(self, n: int = 1, desc: str | None = None) -> None:
        if desc is not None:
            self._bar.set_postfix_str(desc[:60], refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def render(self) -> str:
        """The bar as one line of text."""
        return str(self._bar)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


NOISY_SPREAD = 0.10  # a case whose rounds' times spread more than this (relative to their median) is flagged


def median_over_rounds(per_round: Sequence[dict], scale_rates: Callable[[dict, float], None]) -> dict:
    """One record from a case's records of repeated sweeps (in run order): the first round's, with ``ms`` the median
    of the rounds' times, ``ms_rounds`` each round's, ``ms_min``/``ms_max`` their range and ``spread`` that range
    over the median; ``scale_rates(record, ms)`` rewrites the record's rates (TFLOP/s, GB/s) for the median time.
    A single round comes back unchanged."""
    record = dict(per_round[0])
    if len(per_round) > 1:
        times = [r["ms"] for r in per_round]
        record["ms"] = round_significant(statistics.median(times))
        record["ms_rounds"] = times
        record["ms_min"], record["ms_max"] = min(times), max(times)
        record["spread"] = round_significant((max(times) - min(times)) / record["ms"], 2) if record["ms"] else 0.0
        scale_rates(record, record["ms"])
    return record


def format_spread(spread: float | None) -> str:
    """"4%", with "!" appended above NOISY_SPREAD; "n/a" for a single round."""
    if spread is None:
        return NOT_AVAILABLE
    return f"{100 * spread:.0f}%" + ("!" if spread > NOISY_SPREAD else "")


def noise_note(records: Iterable[Mapping]) -> str:
    """What the spread column means, and a warning when some case's rounds spread past NOISY_SPREAD ("" for a
    single round)."""
    spreads = [r["spread"] for r in records if r.get("spread") is not None]
    if not spreads:
        return ""
    rounds = max(len(r["ms_rounds"]) for r in records if "ms_rounds" in r)
    note = (f"spread: (slowest - fastest) / median of the {rounds} rounds' times, the largest of the row's "
            "backends")
    noisy = sum(spread > NOISY_SPREAD for spread in spreads)
    if noisy:
        note += (f"\nnoisy machine: {noisy} of {len(spreads)} cases spread more than {100 * NOISY_SPREAD:.0f}% "
                 f"(up to {100 * max(spreads):.0f}%, rows marked !): differences smaller than that are not "
                 "measured here; rerun on an idle machine or with more --rounds")
    return note


# --------------------------------------------------------------------------------------------------------------------
# Timing on the GPU in the sustained state
# --------------------------------------------------------------------------------------------------------------------
# A layer that keeps the H200's tensor cores busy for milliseconds runs at its 700 W cap, and the power controller
# takes seconds to settle: measured with 25 ms of warm-up, whichever backend follows a lighter stretch runs part of
# its window at a higher clock. At Mixtral T=4096 the
# torch._grouped_mm backward read 11.3-11.9 ms with 25 ms of warm-up depending on the order, and 11.8-11.9 after 3 s
# of back-to-back calls (its clock 1770 -> 1590 MHz), ours 9.1-9.5 and 9.5-9.7. Training runs in that settled
# state, so large problems are timed there. The caller decides per problem, not per backend, so that every backend
# of a comparison gets the same window.
SHORT_WARMUP_MS = 25
SUSTAINED_WARMUP_MS = 3000
SUSTAINED_REP_MS = 500


def gpu_median_ms(fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None,
                  sustained: bool = False) -> float:
    """Median ms of ``fn`` by triton.testing.do_bench (L2 flushed before each call): after SHORT_WARMUP_MS of warm-up,
    or with ``sustained`` after SUSTAINED_WARMUP_MS of back-to-back calls (the power-capped steady state)."""
    from triton.testing import do_bench

    if sustained:
        return float(do_bench(fn, warmup=SUSTAINED_WARMUP_MS, rep=SUSTAINED_REP_MS, grad_to_none=grad_to_none,
                              return_mode="median"))
    return float(do_bench(fn, warmup=SHORT_WARMUP_MS, rep=100, grad_to_none=grad_to_none, return_mode="median"))


def graph_replay(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured in a CUDA graph after two warm-up calls on a side stream (compiles, caches); returns the replay,
    which repeats the captured kernels on the same tensors: how serving engines and compiled steps run them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# --------------------------------------------------------------------------------------------------------------------
# Environment and GPU metadata
# --------------------------------------------------------------------------------------------------------------------
def gpu_name() -> str:
    """Name of the first CUDA device, or "cpu" when there is none."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def cudnn_version() -> str | None:
    """cuDNN as "major.minor.patch" (torch reports an integer whose encoding changed with cuDNN 9)."""
    try:
        number = torch.backends.cudnn.version()
    except Exception:  # a build without cuDNN may raise instead of returning None
        return None
    if not number:
        return None
    if number >= 90000:  # cuDNN 9+: major*10000 + minor*100 + patch
        major, rest = divmod(number, 10000)
    else:  # cuDNN <= 8: major*1000 + minor*100 + patch
        major, rest = divmod(number, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def gpu_properties(device_index: int = 0) -> dict | None:
    """What the kernels' tile heuristics depend on, for `flashmoe-science info`; None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device_index)
    smem_optin = getattr(props, "shared_memory_per_block_optin", None)
    if smem_optin is None:  # older torch: ask Triton's driver, which reads the same CUDA attribute
        try:
            import triton

            smem_optin = triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
        except Exception:
            smem_optin = None
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "smem_per_block_optin_bytes": smem_optin,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "memory_bytes": props.total_memory,
    }


def resolve_commit(explicit: str | None = None) -> str:
    """The commit a result belongs to: `--commit`, else $FLASHMOE_COMMIT, else git, else "unknown".

    The GPU machine receives a copy of the tree without .git, so there the caller passes the commit explicitly.
    """
    if explicit:
        return explicit
    from_env = os.environ.get("FLASHMOE_COMMIT", "").strip()
    if from_env:
        return from_env
    try:
        completed = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = completed.stdout.strip()
    return commit if completed.returncode == 0 and commit else "unknown"


def today_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def software_versions() -> dict[str, str | None]:
    return {
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda,
        "cudnn": cudnn_version(),
        "python": platform.python_version(),
    }


def short_error(error: BaseException) -> str:
    """An error in one line: its type and its message's first line, at most 160 characters."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message}"[:160]


def fa3_import_error() -> str | None:
    """Why vLLM's FlashAttention-3 build (`vllm.vllm_flash_attn`, its `_vllm_fa3_C` library) does not import here,
    or None."""
    try:
        from vllm.vllm_flash_attn import flash_attn_interface
    except Exception as error:  # not installed, or its CUDA libraries do not load
        return f"vllm.vllm_flash_attn (vLLM's FlashAttention-3) does not import: {short_error(error)}"
    if not getattr(flash_attn_interface, "FA3_AVAILABLE", False):
        reason = getattr(flash_attn_interface, "FA3_UNAVAILABLE_REASON", None) or "FA3_AVAILABLE is False"
        return f"vllm.vllm_flash_attn has no FlashAttention-3 library here: {str(reason)[:160]}"
    return None


def peer_versions() -> dict[str, str]:
    """Versions of the installed peers a run may measure beside ours (FlashAttention-4: `bench.attention`'s `fa4`;
    vLLM, whose FlashAttention-3 build is its `fa3`, where that build imports: vLLM is imported only when installed);
    a peer that is not installed has no key."""
    versions = {}
    for key, distribution in (("flash_attn_4", "flash-attn-4"), ("vllm", "vllm")):
        try:
            versions[key] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    if "vllm" in versions and fa3_import_error() is not None:
        del versions["vllm"]
    return versions


def environment_metadata(commit: str) -> dict:
    """The JSON envelope's fields: where and with what the numbers were measured."""
    return {"gpu": gpu_name(), **software_versions(), **peer_versions(), "commit": commit, "date": today_utc()}


# --------------------------------------------------------------------------------------------------------------------
# JSON results
# --------------------------------------------------------------------------------------------------------------------
def slugify(text: str) -> str:
    """Lowercase, every run of non-alphanumerics becomes one '-': "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def result_stem(gpu: str, date: str, commit: str) -> str:
    """File name without extension: `<gpu-slug>-<YYYY-MM-DD>-<commit>`."""
    return f"{slugify(gpu)}-{date}-{slugify(commit)}"


def check_out_dir(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` as a Path, made if missing, once a file can be written in it; else a CommandError naming
    ``--out``. Commands call it before any work, so a bad ``--out`` (a file, a read-only place) fails at once instead
    of when the first result is saved."""
    path = Path(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except FileExistsError:
        raise CommandError(f"--out {out_dir}: a file of that name is in the way (--out names a folder)") from None
    except OSError as error:
        raise CommandError(f"--out {out_dir}: cannot write there ({error.strerror or error})") from None
    return path


def unused_result_path(out_dir: Path, stem: str, suffix: str = ".json") -> Path:
    """`<out_dir>/<stem>.json`, or `<stem>-2.json`, `-3`, ... if taken: a second run never overwrites measured data."""
    path = out_dir / f"{stem}{suffix}"
    number = 2
    while path.exists():
        path = out_dir / f"{stem}-{number}{suffix}"
        number += 1
    return path


class PartialResults:
    """`<out_dir>/<stem>.partial.json` (`-2`, `-3`, ... where an earlier run's is there: that one is kept),
    rewritten with every record so far after each completed step, so a run that is interrupted or killed (a time
    limit on a shared GPU) still leaves what it measured. `finish` removes it once the full result is written;
    `PartialResults.left` lists the ones written and not finished, which the command names on Ctrl-C."""

    left: list[Path] = []

    def __init__(self, out_dir: str | os.PathLike, envelope: dict):
        self.envelope = envelope
        stem = result_stem(envelope["gpu"], envelope["date"], envelope["commit"])
        self.path = unused_result_path(Path(out_dir), stem, ".partial.json")

    def __call__(self, records: list[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({**self.envelope, "partial": True, "records": records}, indent=1) + "\n")
        if self.path not in PartialResults.left:
            PartialResults.left.append(self.path)

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.path in PartialResults.left:
            PartialResults.left.remove(self.path)


def write_results(out_dir: str | os.PathLike, envelope: dict, records: list[dict]) -> Path:
    """Write `{**envelope, "records": records}` as JSON and return the file's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = unused_result_path(out_dir, result_stem(envelope["gpu"], envelope["date"], envelope["commit"]))
    path.write_text(json.dumps({**envelope, "records": records}, indent=1) + "\n")
    return path


# --------------------------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------------------------
def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing (a backend that did not run) or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive values present; None if there are none."""
    present = [value for value in values if value is not None and value > 0]
    if not present:
        return None
    return math.exp(sum(math.log(value) for value in present) / len(present))


def round_significant(value: float, digits: int = 4) -> float:
    """Round to `digits` significant digits: keeps 0.000123 TFLOP/s (a CPU run) as well as 456.7 (a GPU run)."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def format_number(value: float | None, digits: int = 1) -> str:
    """`digits` decimals; values below 1 get `digits + 1` significant digits instead, so small numbers stay visible."""
    if value is None:
        return NOT_AVAILABLE
    if 0 < abs(value) < 1:
        return f"{value:.{digits + 1}g}"
    return f"{value:.{digits}f}"


# --------------------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------------------
def pivot(
    records: Iterable[Mapping],
    row_key: Callable[[Mapping], Hashable],
    column_key: str = "backend",
    value_key: str = "tflops",
) -> dict[Hashable, dict[str, float]]:
    """{row: {column: value}}, rows in order of first appearance (e.g. one row per shape, one column per backend)."""
    table: dict[Hashable, dict[str, float]] = {}
    for record in records:
        table.setdefault(row_key(record), {})[record[column_key]] = record[value_key]
    return table


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain aligned text table; the first column is left-aligned, the others right-aligned (they hold numbers)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(cell).ljust(width) if index == 0 else str(cell).rjust(width)
            for index, (cell, width) in enumerate(zip(cells, widths))
        )

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def records_table(
    records: Sequence[Mapping],
    row_fields: Sequence[str],
    columns: Sequence[str] = (),
    column_key: str = "backend",
    value_key: str = "tflops",
    extra_columns: Mapping[str, Callable[[dict[str, float]], str]] | None = None,
) -> str:
    """One row per distinct combination of `row_fields`, one column per `column_key` value holding `value_key`
    ("n/a" where that combination has no record), then `extra_columns`, each computed from the row's
    {column: value} (e.g. a ratio between two backends), and, for repeated rounds, the row's largest ``spread``.
    `columns` are always shown, in that order, even if they
    have no record at all (a backend that failed everywhere); other values that occur follow them."""
    extra_columns = dict(extra_columns or {})
    row_of = lambda r: tuple(r.get(name) for name in row_fields)  # noqa: E731
    by_row = pivot(records, row_of, column_key, value_key)
    columns = list(dict.fromkeys([*columns, *(r[column_key] for r in records)]))
    spreads: dict[tuple, float] = {}
    for record in records:
        if record.get("spread") is not None:
            spreads[row_of(record)] = max(spreads.get(row_of(record), 0.0), record["spread"])
    rows = [
        [_cell(value) for value in row]
        + [format_number(values.get(column)) for column in columns]
        + [compute(values) for compute in extra_columns.values()]
        + ([format_spread(spreads.get(row))] if spreads else [])
        for row, values in by_row.items()
    ]
    return format_table([*row_fields, *columns, *extra_columns, *(["spread"] if spreads else [])], rows)


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return NOT_AVAILABLE if value is None else str(value)


def ordered_columns(present: Iterable[str], preferred_order: Sequence[str]) -> list[str]:
    """The columns that occur, in `preferred_order` first, any others after in order of appearance."""
    present = list(dict.fromkeys(present))
    return [name for name in preferred_order if name in present] + [
        name for name in present if name not in preferred_order
    ]


# --------------------------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------------------------
Series = dict[str, list[tuple[float, float]]]  # line label -> [(x, y), ...]


def plot_panels(
    path: str | os.PathLike,
    panels: Mapping[str, Series],
    xlabel: str,
    ylabel: str,
    suptitle: str = "",
    columns: int = 3,
    log2_x: bool = True,
) -> Path | None:
    """One subplot per panel title, one line per series, saved as PNG; None (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a GPU node
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return None
    if not panels:
        return None
    columns = min(columns, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for axis, (title, series) in zip(axes.flat, panels.items()):
        for label, points in series.items():
            points = sorted(points)
            axis.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
        if log2_x:
            axis.set_xscale("log", base=2)
        axis.set_title(title)
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    if suptitle:
        figure.suptitle(suptitle)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
