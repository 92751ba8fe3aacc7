"""Sweep the sm_90 forward's schedule and the backward's ring for a causal sliding window on one GPU, beside the dense
causal calls a window's work items resemble: the data behind hopper/tiles.sm90_band_schedule and sm90_plan_length.

    PYTHONPATH=src python benchmarks/tools/sweep_attention_window_tiles.py --out $OUT [--cases ...] [--budget-s 150]

Cases (bf16, D=128): a causal window of 4096 keys, (4095, 0), at L=32768 H=16 and L=131072 H=4 (the `window`
suite's shapes), and the dense causal calls at B=8 L=4096 H=16 (items of the window's length, the same 4096 work
items) and B=1 L=32768 H=16 (the suite's reference). Per case:

- forward, the kernel alone (fwd_sm90.attention_forward_sm90 on preallocated out/lse) for every schedule the kernel
  takes that fits the shared memory: key tile 64/128, ring 2/3/4 stages, persistent CTAs (1 or 2 Q buffers, with or
  without overlapped items where that is safe) or one CTA per query tile; the plan's own schedule is marked. Dense
  cases run their plan's schedule only (their rules were swept before: sweep_attention_forward_tiles.py);
- backward, the kernel alone (bwd_sm90.attention_backward_sm90: preprocess, one pass, dQ conversion) with 2 and 3
  Q/dO stages (the one-pass kernel's only schedule knob: one CTA per 128 keys);
- the whole call (`flash_attention_science`, forward without grad and the backward through autograd, as
  `bench --suite window` times them).

Each is timed twice: `ms`, triton's do_bench median with the L2 flushed before every call (the benchmark's timer,
which also shows host time the GPU waits for), and `ms_stream`, the mean of 10 calls back to back between two
events (host time hidden behind the previous call). TFLOP/s count the pairs attended (bench.features: the window's
exact pairs, the FlashAttention convention for dense causal; backward 2.5x). Every forward schedule's output is
compared with the plan's (max |diff|).

Before any timing, every kernel is built by parallel worker processes that launch it once on the case's real
shapes (so Triton's cache holds each specialisation the timing asks for). Writes sweep_window.json under --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import time
from dataclasses import dataclass

import torch
import triton

from flashmoe_science.attention.hopper.tiles import sm90_cross_item_safe, sm90_smem_bytes
from flashmoe_science.attention.tiles import AttentionTiles, padded_head_dim

HEAD_DIM = 128
WINDOW = 4096  # keys a query sees, its own included: window (WINDOW - 1, 0)
DEFAULT_CASES = "window:1x16x32768,window:1x4x131072,dense:8x16x4096,dense:1x16x32768"
BACKWARD_STAGES = (2, 3)
STREAM_CALLS = 10


@dataclass(frozen=True)
class Schedule:
    """One forward launch's schedule: tiles, persistent CTAs (else one per query tile), Q buffers, overlapped items."""

    tiles: AttentionTiles
    persistent: bool
    q_buffers: int
    cross_item: bool

    def label(self) -> str:
        ctas = (f"persistent q{self.q_buffers}{' cross' if self.cross_item else ''}" if self.persistent
                else "per-tile")
        return f"{self.tiles.block_m}x{self.tiles.block_n} s{self.tiles.num_stages} {ctas}"

    def as_dict(self) -> dict:
        return {**self.tiles.as_dict(), "persistent": self.persistent, "q_buffers": self.q_buffers,
                "cross_item": self.cross_item, "label": self.label()}


def parse_case(text: str) -> tuple[str, int, int, int]:
    kind, shape = text.split(":")
    if kind not in ("window", "dense"):
        raise ValueError(f"a case is window:BxHxL or dense:BxHxL, got {text!r}")
    b, h, length = map(int, shape.lower().split("x"))
    return kind, b, h, length


def case_window(kind: str):
    return (WINDOW - 1, 0) if kind == "window" else None


def candidates(smem_per_block: int) -> list[Schedule]:
    """Every schedule the sm_90 forward takes for a right-bounded mask at D=128 that fits `smem_per_block`: two Q
    buffers and overlapped items only on persistent CTAs, overlap only with two Q buffers and a ring deep enough
    (tiles.sm90_cross_item_safe)."""
    found = []
    for block_n, stages in ((128, 2), (128, 3), (64, 2), (64, 3), (64, 4)):
        tiles = AttentionTiles(128, block_n, 8, stages, use_tma=True)
        for persistent, q_buffers, cross in ((False, 1, False), (True, 1, False), (True, 2, False), (True, 2, True)):
            if cross and not sm90_cross_item_safe(True, tiles):
                continue
            if sm90_smem_bytes(tiles, HEAD_DIM, q_buffers) <= smem_per_block:
                found.append(Schedule(tiles, persistent, q_buffers, cross))
    return found


# --------------------------------------------------------------------------------------------------------------------
# One case's tensors and launches (shared by the build workers and the timing)
# --------------------------------------------------------------------------------------------------------------------
def make_inputs(case, seed: int = 0):
    _, b, h, length = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(4)]  # q, k, v, grad_out


def planned_schedule(case, q) -> Schedule:
    """The schedule `auto` plans for this case (backend.forward_plan)."""
    from flashmoe_science.attention.hopper.backend import forward_plan
    from flashmoe_science.attention.problem import dense_problem

    plan = forward_plan(dense_problem(q, q, q, causal=True, window=case_window(case[0]))[0])
    return Schedule(plan.tiles, plan.persistent, plan.q_buffers, plan.cross_item)


def forward_launch(case, q, k, v, schedule: Schedule):
    """() -> out of one kernel launch with `schedule` (out and lse preallocated)."""
    from flashmoe_science.attention.hopper import fwd_sm90
    from flashmoe_science.attention.mask import make_mask
    from flashmoe_science.device import device_traits

    mask = make_mask(True, case_window(case[0]))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device)
    num_ctas = device_traits(q.device).sm_count if schedule.persistent else None

    def run():
        fwd_sm90.attention_forward_sm90(q, k, v, out, lse, True, HEAD_DIM**-0.5, schedule.tiles, num_ctas,
                                        schedule.q_buffers, schedule.cross_item, mask=mask)
        return out

    return run


def backward_launch(case, q, k, v, grad_out, num_stages: int):
    """() -> None: the one-pass backward's launches with `num_stages` Q/dO stages, on the planned forward's out and
    lse."""
    from flashmoe_science import flash_attention_science
    from flashmoe_science.attention.features import CallFeatures
    from flashmoe_science.attention.hopper import bwd_sm90
    from flashmoe_science.attention.mask import make_mask

    window = case_window(case[0])
    with torch.no_grad():
        out, lse = flash_attention_science(q, k, v, causal=True, window=window, return_lse=True)
    features = CallFeatures(mask=make_mask(True, window))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    dq_accum = torch.empty(*q.shape[:3], padded_head_dim(HEAD_DIM), device=q.device)

    def run():
        bwd_sm90.attention_backward_sm90(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, HEAD_DIM**-0.5,
                                         dq_accum, num_stages)

    return run


def whole_call(case):
    from flashmoe_science import flash_attention_science

    window = case_window(case[0])
    return lambda q, k, v: flash_attention_science(q, k, v, causal=True, window=window)


def build_job(job: dict) -> dict:
    """Worker: launch one kernel once on the case's shapes (Triton compiles it into the shared cache)."""
    started = time.perf_counter()
    try:
        case = job["case"]
        q, k, v, grad_out = make_inputs(case)
        if job["pass"] == "fwd":
            forward_launch(case, q, k, v, job["schedule"])()
        else:
            backward_launch(case, q, k, v, grad_out, job["num_stages"])()
        torch.cuda.synchronize()
        return {**_job_record(job), "build_s": time.perf_counter() - started}
    except Exception as error:  # noqa: BLE001 - a schedule that does not build is reported, not fatal
        return {**_job_record(job), "error": f"{type(error).__name__}: {str(error)[:300]}"}


def _job_record(job: dict) -> dict:
    """A build job as JSON: its schedule by label."""
    return {**job, "schedule": job["schedule"].label()} if "schedule" in job else dict(job)


def build_all(jobs: list[dict], workers: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")  # CUDA in the workers
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(build_job, jobs))


# --------------------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------------------
def stream_ms(fn, calls: int = STREAM_CALLS) -> float:
    """Mean ms of `calls` back-to-back calls between two events (host time hidden behind the GPU)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def timed(fn, flops: float, grad_to_none=None) -> dict:
    from flashmoe_science.bench.attention import cuda_median_ms

    ms = cuda_median_ms(fn, grad_to_none)
    streamed = stream_ms(fn)
    return {"ms": ms, "ms_stream": streamed, "tflops": flops / ms / 1e9, "tflops_stream": flops / streamed / 1e9}


def case_flops(case) -> float:
    """Forward FLOPs over the pairs attended (bench.features' conventions)."""
    from flashmoe_science.bench.features import dense_flops, window_pairs

    kind, b, h, length = case
    if kind == "window":
        return 4.0 * b * h * HEAD_DIM * window_pairs(length, WINDOW)
    return dense_flops(b, h, length, length, HEAD_DIM, True)


def whole_call_backward(case, q, k, v, grad_out, flops: float) -> dict:
    """The backward through autograd, timed as bench.features times it (out.backward with retain_graph)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = whole_call(case)(*leaves)

    def run():
        out.backward(grad_out, retain_graph=True)

    run()
    return timed(run, 2.5 * flops, grad_to_none=leaves)


def print_row(name: str, rec: dict, base: float | None = None) -> None:
    if "error" in rec:
        print(f"  {name:36} {rec['error']}", flush=True)
        return
    rel = f" {rec['tflops'] / base:5.2f}x plan" if base else ""
    err = f" err {rec['max_diff_vs_plan']:.1e}" if "max_diff_vs_plan" in rec else ""
    print(f"  {name:36} {rec['ms']:8.3f} ms {rec['tflops']:5.0f} TFLOP/s | stream {rec['ms_stream']:8.3f} ms "
          f"{rec['tflops_stream']:5.0f}{rel}{err}", flush=True)


def sweep_case(case, plan: Schedule, schedules: list[Schedule], started: float, budget_s: float) -> dict:
    """Time one case: its forward schedules (a dense case: its plan only), the backward's rings, the whole call."""
    from flashmoe_science.attention.api import describe_dispatch

    kind, b, h, length = case
    q, k, v, grad_out = make_inputs(case)
    flops = case_flops(case)
    dispatch = describe_dispatch(q, k, v, causal=True, window=case_window(kind))
    row = {"kind": kind, "B": b, "H": h, "L": length, "D": HEAD_DIM, "window": case_window(kind),
           "flops_fwd": flops, "plan": plan.as_dict(), "dispatch": dispatch.reason, "forward": [], "backward": []}
    print(f"{kind} B{b} H{h} L{length}: plan {plan.label()}", flush=True)
    with torch.no_grad():
        reference = forward_launch(case, q, k, v, plan)().clone()
        for schedule in (schedules if kind == "window" else [plan]):
            rec = schedule.as_dict() | {"planned": schedule == plan}
            if time.perf_counter() - started > budget_s:
                rec["error"] = "skipped: past --budget-s"
            else:
                try:
                    fn = forward_launch(case, q, k, v, schedule)
                    rec["max_diff_vs_plan"] = (fn().float() - reference.float()).abs().max().item()
                    rec |= timed(fn, flops)
                except Exception as error:  # noqa: BLE001 - a schedule that fails is reported, not fatal
                    rec["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            row["forward"].append(rec)
        planned_tflops = next((r["tflops"] for r in row["forward"] if r["planned"] and "tflops" in r), None)
        for rec in row["forward"]:
            print_row(f"fwd {rec['label']}{' (plan)' if rec['planned'] else ''}", rec, planned_tflops)
        call = whole_call(case)
        row["whole_fwd"] = timed(lambda: call(q, k, v), flops)
        print_row("fwd whole call", row["whole_fwd"], planned_tflops)
    for stages in BACKWARD_STAGES if kind == "window" else (None,):
        rec = {"num_stages": stages}
        if time.perf_counter() - started > budget_s:
            rec["error"] = "skipped: past --budget-s"
        else:
            try:
                rec |= timed(backward_launch(case, q, k, v, grad_out, stages), 2.5 * flops)
            except Exception as error:  # noqa: BLE001
                rec["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        row["backward"].append(rec)
        print_row(f"bwd one pass, {stages or 'default'} stages", rec)
    row["whole_bwd"] = whole_call_backward(case, q, k, v, grad_out, flops)
    print_row("bwd whole call", row["whole_bwd"])
    return row


def sweep(cases, out_dir: str, budget_s: float, workers: int) -> dict:
    from flashmoe_science.device import device_traits

    started = time.perf_counter()
    traits = device_traits(torch.device("cuda"))
    schedules = candidates(traits.smem_per_block)
    plans, jobs = {}, []
    for case in cases:
        plans[case] = planned_schedule(case, torch.empty(*case[1:], HEAD_DIM, device="cuda", dtype=torch.bfloat16))
        for schedule in (schedules if case[0] == "window" else [plans[case]]):
            jobs.append({"case": case, "pass": "fwd", "schedule": schedule})
        for stages in BACKWARD_STAGES if case[0] == "window" else (None,):
            jobs.append({"case": case, "pass": "bwd", "num_stages": stages})
    built = build_all(jobs, workers)
    failed = [b for b in built if "error" in b]
    print(f"built {len(jobs)} launches in {time.perf_counter() - started:.0f} s ({workers} workers, "
          f"{len(failed)} failed)", flush=True)
    for b in failed:
        print(f"  build failed: {b}", flush=True)

    results = [sweep_case(case, plans[case], schedules, started, budget_s) for case in cases]
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "sm_count": traits.sm_count, "seconds": time.perf_counter() - started, "builds": built,
              "results": results}
    with open(os.path.join(out_dir, "sweep_window.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"done in {report['seconds']:.0f} s: {os.path.join(out_dir, 'sweep_window.json')}", flush=True)
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="window:BxHxL or dense:BxHxL, comma separated")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="stop timing new configs after this many seconds (builds included)")
    parser.add_argument("--workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sweep([parse_case(c) for c in args.cases.split(",") if c], args.out, args.budget_s, args.workers)


if __name__ == "__main__":
    main()
