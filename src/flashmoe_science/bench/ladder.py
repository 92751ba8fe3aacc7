"""`flashmoe-science bench --suite ladder`: every rung of `attention.ladder` on one grid, from the CPU to Hopper.

The grid (a GPU): the FlashAttention-3 paper's token budget at one head shape, B·L = 16384, H = 16, D = 128,
L = 512, 1024, ..., 16384 (B = 16384 / L), then L = 32768 and 65536 at B = 1, past the budget: there naive_gpu's
scores (4·H·L² bytes) reach 64 and 256 GiB, and it stops where they no longer fit. fp16 and bf16, non-causal and
causal (`--quick`: L = 512, 2048, 8192, non-causal). On a CPU: the cpu rung and, when the process was started
with TRITON_INTERPRET=1, the Triton rungs through the interpreter, at tiny sizes (CPU_SHAPES, float16): a smoke
test of the suite, not a measurement of the kernels.

Each (rung, L, dtype, causal) becomes a record in the attention benchmark's format (`bench.attention`:
op, pass, B, H, Hkv, Lq, Lk, D, causal, dtype, backend = the rung's name, ms, tflops, peak_mem_mib) plus
    "device": where the rung ran ("cuda", "cpu", or "interpreter"),
    "bytes": the HBM traffic of one call by the model below, "tbps": that traffic over the measured time.
The result file's envelope has the usual gpu/versions/commit/date (`report.environment_metadata`), "suite":
"ladder", and "stopped": where each rung stopped and why (one entry per rung and dtype/causal series).

How it is measured:
- time: GPU rungs by `report.gpu_median_ms` (do_bench's median, L2 flushed between calls); the cpu rung, which
  runs on CPU copies of the inputs made outside timing, by `bench.attention.cpu_median_ms`; a call slower than
  SLOW_CALL_S (after compiling) by one call alone.
- TFLOP/s: the useful forward FLOPs over the time, 4·B·H·L²·D, halved when causal (`bench.attention.
  attention_flops`): naive_gpu computes every masked score anyway and gets no credit for it.
- peak memory: the extra `torch.cuda.max_memory_allocated` of one call (`bench.attention.peak_memory_mib`;
  None on the CPU).
- a rung stops on a series (dtype, causal) where it refuses a shape (naive_gpu where its L x L float32 scores
  would not fit in free GPU memory; hopper off Hopper), fails (out of memory, ...), or where one call took longer than
  SLOW_CALL_S: longer L only take longer (FLOPs grow as L while B·L is fixed, as L² past it).

The bytes model (HBM traffic of one forward call; N = B·H heads, e = bytes per input element, scores float32;
every tensor a kernel touches counted once per kernel that reads or writes it, re-reads that L2 serves not
counted):
- naive_gpu: Q and K read and S written by kernel 1, S read three times and P written by kernel 2, P and V read
  and O written by kernel 3: 24·N·Lq·Lk + e·N·D·(2·Lq + 2·Lk).
- cpu: the same formula, in host memory: a lower bound (PyTorch's eager ops make more passes over the scores).
- tiled_fma: Q, K, V read once and O written once: e·N·D·(2·Lq + 2·Lk).
- tiled_tensor_cores, hopper: the same, plus the float32 log-sum-exp the kernels keep for the backward: + 4·N·Lq.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from flashmoe_science.attention.ladder import RUNGS, Rung, unavailable
from flashmoe_science.bench.attention import (
    DTYPE_NAMES,
    AttentionShape,
    attention_record,
    short_error,
    cpu_median_ms,
    peak_memory_mib,
)
from flashmoe_science.bench.report import (
    PartialResults,
    Progress,
    environment_metadata,
    format_number,
    gpu_median_ms,
    plot_panels,
    ratio,
    records_table,
    resolve_commit,
    round_significant,
    write_results,
)
from flashmoe_science.device import triton_interpreter_on

TOKENS = 16384  # B · L
HEADS = 16
HEAD_DIM = 128
GPU_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
LONG_LENGTHS = (32768, 65536)  # at B = 1: where the materialised scores outgrow a GPU's memory
QUICK_LENGTHS = (512, 2048, 8192)
GPU_DTYPES = (torch.float16, torch.bfloat16)
CPU_SHAPES = ((1, 1, 16, 16), (1, 1, 32, 16))  # (B, H, L, D): tiny, for the interpreter
CPU_DTYPE = torch.float16  # the interpreter's bf16 is unreliable (numpy has no bfloat16)
CPU_BUDGET_S = 0.2  # cpu_median_ms's time budget per shape
SLOW_CALL_S = 2.0  # a rung whose call took longer is timed by that call alone and stops on its series
LSE_BYTES = 4


# --------------------------------------------------------------------------------------------------------------------
# The model of bytes moved
# --------------------------------------------------------------------------------------------------------------------
def _io_bytes(shape: AttentionShape, element_bytes: int) -> int:
    """Q, K, V read and O written once."""
    return element_bytes * shape.B * shape.H * shape.D * (2 * shape.Lq + 2 * shape.Lk)


def _materialised_bytes(shape: AttentionShape, element_bytes: int) -> int:
    """24 bytes per float32 score (written, read 3x and rewritten as P by the softmax, read by P·V) plus the I/O."""
    return 24 * shape.B * shape.H * shape.Lq * shape.Lk + _io_bytes(shape, element_bytes)


def _kernel_with_lse_bytes(shape: AttentionShape, element_bytes: int) -> int:
    return _io_bytes(shape, element_bytes) + LSE_BYTES * shape.B * shape.H * shape.Lq


BYTES_MODELS: dict[str, Callable[[AttentionShape, int], int]] = {
    "cpu": _materialised_bytes,
    "naive_gpu": _materialised_bytes,
    "tiled_fma": _io_bytes,
    "tiled_tensor_cores": _kernel_with_lse_bytes,
    "hopper": _kernel_with_lse_bytes,
}


def bytes_moved(rung_name: str, shape: AttentionShape, dtype: torch.dtype) -> int:
    """HBM bytes of one forward call of the rung by the model in this module's docstring."""
    return BYTES_MODELS[rung_name](shape, torch.empty((), dtype=dtype).element_size())


# --------------------------------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Series:
    """One line of the plot per rung: a dtype and a causal flag over the lengths."""

    dtype: torch.dtype
    causal: bool
    shapes: tuple[AttentionShape, ...]

    def label(self) -> str:
        return f"{DTYPE_NAMES[self.dtype]} {'causal' if self.causal else 'non-causal'}"


def gpu_series(quick: bool) -> list[Series]:
    sizes = [(TOKENS // L, L) for L in (QUICK_LENGTHS if quick else GPU_LENGTHS)]
    sizes += [] if quick else [(1, L) for L in LONG_LENGTHS]
    return [Series(dtype, causal, tuple(AttentionShape(B, HEADS, L, L, HEAD_DIM, causal) for B, L in sizes))
            for dtype in GPU_DTYPES for causal in ((False,) if quick else (False, True))]


def cpu_series() -> list[Series]:
    return [Series(CPU_DTYPE, causal, tuple(AttentionShape(*shape[:3], shape[2], shape[3], causal)
                                            for shape in CPU_SHAPES)) for causal in (False, True)]


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Stops:
    """Where each rung stopped on each series and why: {(rung, series label): (L, reason)}, first stop only."""

    entries: dict[tuple[str, str], tuple[int | None, str]] = field(default_factory=dict)

    def note(self, rung: str, series: Series, length: int | None, reason: str) -> None:
        self.entries.setdefault((rung, series.label()), (length, reason))

    def stopped(self, rung: str, series: Series) -> bool:
        return (rung, series.label()) in self.entries

    def as_json(self) -> list[dict]:
        return [{"backend": rung, "series": label, "L": length, "reason": reason}
                for (rung, label), (length, reason) in self.entries.items()]

    def summary(self) -> str:
        lines = [f"  {rung} ({label}): " + (f"stopped at L = {length}: " if length else "not run: ") + reason
                 for (rung, label), (length, reason) in self.entries.items()]
        return "\n".join(["where the rungs stopped:", *lines]) if lines else ""


def _home(rung: Rung, device: torch.device) -> torch.device:
    """Where a rung runs in a run on `device`: the cpu rung on the host (on CPU copies of the inputs), the others
    on `device`."""
    return torch.device("cpu") if rung.devices == ("cpu",) else device


def _home_label(rung: Rung, device: torch.device) -> str:
    """The record's "device": cuda, cpu, or interpreter (a Triton rung on CPU tensors)."""
    home = _home(rung, device)
    return home.type if home.type == "cuda" or "cpu" in rung.devices else "interpreter"


def _seconds(call: Callable[[], object], device: torch.device) -> tuple[float, float | None]:
    """(wall seconds, peak MiB on a GPU) of one call, synchronised (peak_memory_mib waits for the GPU)."""
    started = time.perf_counter()
    memory = None
    if device.type == "cuda":
        memory = peak_memory_mib(call, device)
    else:
        call()
    return time.perf_counter() - started, memory


def _measure(rung: Rung, shape: AttentionShape, q, k, v, device: torch.device) -> tuple[float, float | None, str]:
    """(ms, peak MiB, where it ran) of one rung on one shape; raises what the rung raises.

    The first call compiles, refuses a shape before anything is timed, and gives the peak memory. Where it took
    longer than SLOW_CALL_S, a second call alone says whether compiling did, or the rung is that slow: then that
    call is the measurement (the timers' warm-up and repeats would cost ten such calls). Others go to the
    harness's timers."""
    where = _home_label(rung, device)
    q, k, v = (t.to(_home(rung, device)) for t in (q, k, v))
    call = lambda: rung.attention(q, k, v, causal=shape.causal)  # noqa: E731
    with torch.no_grad():
        first_s, memory = _seconds(call, q.device)
        if first_s > SLOW_CALL_S:
            first_s, _ = _seconds(call, q.device)
            if first_s > SLOW_CALL_S:
                return 1e3 * first_s, memory, where
        if q.is_cuda:
            return gpu_median_ms(call), memory, where
        # a call slower than the timer's budget is timed once more: its median would cost seconds per shape
        return cpu_median_ms(call, min_reps=1 if first_s > CPU_BUDGET_S else 3, budget_s=CPU_BUDGET_S), None, where


def run_ladder(series: Sequence[Series], device: torch.device, progress: Progress, stops: Stops,
               rungs: Sequence[Rung] = RUNGS, on_case_done: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every rung on every shape of every series; records of what ran, `stops` of what did not."""
    progress.set_total(sum(len(s.shapes) for s in series) * len(rungs))
    records: list[dict] = []
    for line in series:
        for rung in rungs:
            reason = unavailable(rung, _home(rung, device))
            if reason is not None:
                stops.note(rung.name, line, None, reason)
        for shape in line.shapes:
            q, k, v = (torch.randn(shape.B, shape.H, L, shape.D, device=device, dtype=line.dtype)
                       for L in (shape.Lq, shape.Lk, shape.Lk))
            for rung in rungs:
                if not stops.stopped(rung.name, line):
                    record = _run_one(rung, shape, line, q, k, v, device, stops)
                    if record is not None:
                        records.append(record)
                        if on_case_done is not None:
                            on_case_done(records)
                progress.update(desc=f"{line.label()} L={shape.Lq} {rung.name}")
            del q, k, v
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return records


def _run_one(rung: Rung, shape: AttentionShape, line: Series, q, k, v, device, stops: Stops) -> dict | None:
    try:
        ms, memory, where = _measure(rung, shape, q, k, v, device)
    except Exception as error:  # a refusal, out of memory, a compile failure: the rung stops, the run goes on
        stops.note(rung.name, line, shape.Lq, short_error(error))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None
    if ms > 1e3 * SLOW_CALL_S:
        stops.note(rung.name, line, shape.Lq * 2,
                   f"one call took {ms / 1e3:.1f} s at L = {shape.Lq} (> {SLOW_CALL_S:g} s); longer L take longer")
    record = attention_record(shape, "fwd", rung.name, ms, memory, None, line.dtype)
    moved = bytes_moved(rung.name, shape, line.dtype)
    record.update(device=where, bytes=moved, tbps=round_significant(moved / (ms * 1e-3) / 1e12))
    return record


# --------------------------------------------------------------------------------------------------------------------
# Tables and plot
# --------------------------------------------------------------------------------------------------------------------
def _gain_columns(names: Sequence[str]) -> dict[str, Callable[[dict[str, float]], str]]:
    """Each rung's TFLOP/s over the rung below it."""
    return {f"{upper}/{lower}": (lambda values, upper=upper, lower=lower:
                                 format_number(ratio(values.get(upper), values.get(lower)), 2))
            for lower, upper in zip(names, names[1:])}


def ladder_tables(records: Sequence[dict]) -> str:
    """TFLOP/s per rung with each rung's gain over the one below, then peak memory and the modelled TB/s."""
    names = [r.name for r in RUNGS if any(rec["backend"] == r.name for rec in records)]
    rows = ("dtype", "causal", "B", "Lq")
    return "\n\n".join([
        "TFLOP/s (upper/lower: a rung's TFLOP/s over the rung below it; n/a: not run)\n"
        + records_table(records, rows, names, extra_columns=_gain_columns(names)),
        "peak memory beyond the inputs, MiB\n" + records_table(records, rows, names, value_key="peak_mem_mib"),
        "TB/s of the modelled HBM traffic (bench/ladder.py's bytes model)\n"
        + records_table(records, rows, names, value_key="tbps"),
    ])


def plot_ladder(records: Sequence[dict], path, title: str):
    """TFLOP/s against L: one panel per (dtype, causal), one line per rung."""
    panels: dict[str, dict[str, list]] = {}
    for record in records:
        panel = f"{record['dtype']} D={record['D']} {'causal' if record['causal'] else 'non-causal'}"
        panels.setdefault(panel, {}).setdefault(record["backend"], []).append((record["Lq"], record["tflops"]))
    order = [r.name for r in RUNGS]
    panels = {title_: dict(sorted(series.items(), key=lambda item: order.index(item[0])))
              for title_, series in panels.items()}
    return plot_panels(path, panels, xlabel="sequence length L (B·L fixed)", ylabel="TFLOP/s", suptitle=title,
                       columns=2)


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------
def run_from_cli(args) -> int:
    """`flashmoe-science bench --suite ladder` (args: out, quick, no_plot, commit): prints the tables, writes the
    JSON (with "stopped") and a PNG plot beside it."""
    if torch.cuda.is_available():
        device, series = torch.device("cuda"), gpu_series(args.quick)
        print(f"the ladder on {torch.cuda.get_device_name(0)}: B·L = {TOKENS}, H = {HEADS}, D = {HEAD_DIM}, "
              f"fp16 and bf16{'' if args.quick else ', then L = 32768 and 65536 at B = 1'}; the cpu rung on CPU "
              "copies of the inputs", flush=True)
    else:
        device, series = torch.device("cpu"), cpu_series()
        triton_rungs = ("the Triton rungs through the interpreter" if triton_interpreter_on() else
                        "not the Triton rungs (start the process with TRITON_INTERPRET=1 to interpret them)")
        sizes = ", ".join("B={}, H={}, L={}, D={}".format(*shape) for shape in CPU_SHAPES)
        print(f"No CUDA GPU found: the ladder at tiny sizes only ({sizes}; float16), the cpu rung and {triton_rungs}; "
              "a smoke test, not a measurement", flush=True)
    envelope = {**environment_metadata(resolve_commit(args.commit)), "suite": "ladder"}
    partial = PartialResults(args.out, envelope)
    stops = Stops()
    with Progress(desc="ladder") as progress:
        records = run_ladder(series, device, progress, stops, on_case_done=partial)
    print()
    print(ladder_tables(records))
    if stops.entries:
        print()
        print(stops.summary())
    path = write_results(args.out, {**envelope, "stopped": stops.as_json()}, records)
    partial.finish()
    print(f"\nresults: {path}")
    if not args.no_plot and records:
        written = plot_ladder(records, path.with_suffix(".png"), title=f"the ladder, {path.stem}")
        if written is not None:
            print(f"plot:    {written}")
    return 0
