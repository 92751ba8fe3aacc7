"""Sweep backward tile configs on the GPU beside cuDNN and FlashAttention-2: the data behind tiles.backward_tiles.

    PYTHONPATH=src:benchmarks/tools python benchmarks/tools/sweep_attention_backward_tiles.py --out $OUT/run [--cases BxHxLxD,...] [--budget-s 180]
    PYTHONPATH=src:benchmarks/tools python benchmarks/tools/sweep_attention_backward_tiles.py --offline     # no GPU: sm_90 registers, spills, smem

Per case (bf16, non-causal and causal) it times the backward of sdpa-cudnn and sdpa-flash as the benchmark does
(bench/attention.py: one forward, then `out.backward(dout, retain_graph=True)` under `cuda_median_ms`), and ours
called directly through `triton.bwd.attention_backward` (no autograd) for every candidate of
- the fused path: the dK/dV kernel with dQ fused (with the preprocess and dQ convert: the whole backward);
- the two-pass path: the dK/dV kernel alone and the dQ kernel alone (each with the preprocess); the best pair is
  then timed together, as a whole two-pass backward.
The heuristic's own tiles (`backward_tiles`) are always among the candidates and marked. Every config records its
time, TFLOP/s, its error against SDPA's gradients (max |ours - sdpa| / max |sdpa|), and registers, spills and shared
memory of its main kernel; a config that does not fit (OutOfResources) or fails is recorded with the reason.

Before any timing, every kernel is compiled in parallel worker processes with the specialisation its launch will
ask for; the workers write Triton's cache, so the launches below only load. Prints a table; writes sweep_bwd.json
under --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import time

import torch
import triton

from flashmoe_science.attention.triton import bwd as triton_bwd
from flashmoe_science.attention.tiles import (
    AttentionTiles,
    BackwardTiles,
    backward_smem_bytes,
    backward_tiles,
    padded_head_dim,
)
from flashmoe_science.device import device_traits

DEFAULT_CASES = "4x16x4096x64,4x16x4096x128,4x8x4096x256,16x16x1024x128"

# (block_m, block_n, num_warps, num_stages) per kernel and padded head dim: around the offline picks (registers
# <= 255 with little spilling in the sm_90 builds), the wider tiles that spill, and 4-warp variants. (At D=256
# one stage spills 400+ bytes/thread in the dK/dV kernels: deeper pipelines are tried instead.)
CANDIDATES = {
    "fused": {
        64: [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 1), (64, 128, 8, 2), (16, 128, 8, 2), (32, 64, 4, 2),
             (64, 64, 4, 2), (32, 128, 4, 2)],
        128: [(32, 128, 8, 2), (32, 128, 4, 2), (16, 128, 8, 2), (16, 128, 8, 3), (64, 64, 8, 2), (64, 64, 4, 2),
              (32, 64, 4, 2), (32, 64, 8, 2)],
        256: [(16, 64, 8, 2), (16, 64, 8, 3), (16, 64, 8, 4), (32, 64, 8, 2), (32, 64, 8, 3), (32, 32, 4, 2),
              (16, 32, 4, 2), (16, 32, 4, 3)],
    },
    "dkdv": {
        64: [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 1), (64, 128, 8, 2), (16, 128, 8, 2), (32, 64, 4, 2),
             (64, 64, 4, 2), (32, 128, 4, 2)],
        128: [(32, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (16, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2),
              (32, 64, 4, 3), (32, 64, 8, 2)],
        256: [(16, 64, 8, 2), (16, 64, 8, 3), (32, 64, 4, 2), (32, 64, 8, 2), (16, 64, 4, 2), (32, 32, 4, 2),
              (16, 32, 4, 2), (64, 32, 4, 2)],
    },
    "dq": {
        64: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2),
             (64, 32, 4, 3)],
        128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3),
              (64, 128, 8, 2)],
        256: [(64, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (64, 16, 4, 2), (128, 64, 8, 1),
              (32, 64, 4, 2)],
    },
}
KERNELS = ["fused", "dkdv", "dq"]  # --kernels narrows it
DTYPE = torch.bfloat16
SM90 = ("cuda", 90, 32)


def parse_case(text: str) -> tuple[int, int, int, int]:
    b, h, length, d = map(int, text.lower().split("x"))
    return b, h, length, d


def candidates(kernel: str, head_dim: int, default: AttentionTiles | None) -> list[AttentionTiles]:
    """The candidate tiles of `kernel`, the heuristic's `default` first (None: the heuristic does not use it)."""
    tiles = ([default] if default is not None else []) + [
        AttentionTiles(*c) for c in CANDIDATES[kernel][padded_head_dim(head_dim)]]
    return list(dict.fromkeys(tiles))


def _in_every_slot(tiles: AttentionTiles) -> BackwardTiles:
    """`tiles` for each backward kernel: a run reads only its own kernel's slot."""
    return BackwardTiles(dkdv=tiles, dq=tiles, fused=tiles)


def _gradients_wanted(kernel: str) -> tuple[bool, bool]:
    """(dQ, dK/dV) for a run of `kernel`: both for a whole backward ("fused", "two-pass"), each two-pass kernel
    alone its own, the preprocess alone neither."""
    wanted = {"fused": (True, True), "two-pass": (True, True), "dkdv": (False, True), "dq": (True, False),
              "preprocess": (False, False)}
    return wanted[kernel]


# --------------------------------------------------------------------------------------------------------------------
# Compiling without launching: the launches attention_backward would make, compiled for a target (no GPU needed)
# --------------------------------------------------------------------------------------------------------------------
class _RecordingKernel:
    """Stands in for a @triton.jit kernel: records `kernel[grid](*args, **kwargs)` instead of launching."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.fn, args, kwargs))

        return launch


def recorded_launches(case, causal: bool, kernel: str, tiles: AttentionTiles, dtype=None) -> list:
    """[(jit function, args, kwargs)] of one `attention_backward` call, on meta tensors of the case's shape (the
    same dtypes, strides and 16-byte alignment as the real call, so the same specialisation)."""
    b, h, length, d = case
    dtype = dtype or DTYPE
    names = [n for n in dir(triton_bwd) if n.startswith("_bwd_") and n.endswith("_kernel")]
    launches: list = []
    originals = {n: getattr(triton_bwd, n) for n in names}
    try:
        for n in names:
            setattr(triton_bwd, n, _RecordingKernel(originals[n], launches))
        q = torch.empty(b, h, length, d, dtype=dtype, device="meta")
        lse = torch.empty(b, h, length, device="meta")
        want_dq, want_dkdv = _gradients_wanted(kernel)
        dq = torch.empty_like(q) if want_dq else None
        dk, dv = (torch.empty_like(q), torch.empty_like(q)) if want_dkdv else (None, None)
        dq_accum = torch.empty(b, h, length, padded_head_dim(d), device="meta") if kernel == "fused" else None
        triton_bwd.attention_backward(q, q, q, q, lse, q, torch.empty_like(lse), dq, dk, dv, causal, d**-0.5,
                                      _in_every_slot(tiles), dq_accum)
    finally:
        for n in names:
            setattr(triton_bwd, n, originals[n])
    return launches


def compile_launch(fn, args, kwargs, target):
    """Compile one recorded launch for `target` exactly as `JITFunction.run` would (same specialisation, options
    and cache key: a later real launch of the same call loads the result from Triton's cache)."""
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


MAIN_KERNEL = {"fused": "_bwd_dkdv_kernel", "dkdv": "_bwd_dkdv_kernel", "dq": "_bwd_dq_kernel"}


def compile_job(job: dict) -> dict:
    """Worker: compile every launch of one (case, causal, kernel, tiles) call; resources of the main kernel."""
    from triton.backends.compiler import GPUTarget

    from sass_tools import cuobjdump

    target = GPUTarget(*job["target"])
    started = time.perf_counter()
    result = {**job}
    try:
        for fn, args, kwargs in recorded_launches(job["case"], job["causal"], job["kernel"],
                                                  AttentionTiles(*job["tiles"])):
            compiled = compile_launch(fn, args, kwargs, target)
            if fn.__name__ == MAIN_KERNEL.get(job["kernel"]):
                usage = cuobjdump(compiled.asm["cubin"], "-res-usage")
                sass = cuobjdump(compiled.asm["cubin"], "-sass")
                fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
                result.update(regs=int(fields.get("REG", -1)), stack_bytes=int(fields.get("STACK", -1)),
                              ldl=sass.count("LDL"), stl=sass.count("STL"), hgmma=sass.count("HGMMA"),
                              hmma=sass.count("HMMA"), smem=compiled.metadata.shared)
    except Exception as error:  # noqa: BLE001 - reported per config
        result["compile_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    result["compile_s"] = round(time.perf_counter() - started, 2)
    return result


def compile_all(jobs: list[dict], workers: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")  # no CUDA state in the workers: they only compile
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return list(pool.map(compile_job, jobs))


def compile_jobs(cases, target, traits) -> list[dict]:
    """One job per distinct (kernel, head dim, causal, tiles); lengths are runtime values, so the first case of
    each head dim stands for the others (their strides specialise alike: all multiples of 16)."""
    jobs, seen = [], set()
    for case in cases:
        d = case[3]
        for causal in (False, True):
            defaults = backward_tiles(d, DTYPE, causal, traits)
            for kernel in KERNELS:
                for tiles in candidates(kernel, d, getattr(defaults, kernel)):
                    key = (kernel, d, causal, tiles)
                    if key not in seen:
                        seen.add(key)
                        jobs.append({"case": case, "causal": causal, "kernel": kernel,
                                     "tiles": tuple(tiles.as_dict().values())[:4], "target": target})
    return jobs


def offline_report(cases) -> None:
    """sm_90 builds of every candidate, without a GPU: registers, spill stack, shared memory."""
    from flashmoe_science.device import DeviceTraits

    hopper = DeviceTraits(capability=(9, 0), sm_count=132, smem_per_block=232448)  # H100/H200
    jobs = compile_jobs(cases, SM90, hopper)
    started = time.perf_counter()
    results = compile_all(jobs, max(1, os.cpu_count() or 1))
    print(f"{len(jobs)} sm_90 builds in {time.perf_counter() - started:.0f} s ({DTYPE})")
    print(f"{'kernel':6} {'D':>4} {'causal':6} {'tile (m x n, warps, stages)':28} {'regs':>4} {'stack B':>7} "
          f"{'LDL/STL':>8} {'smem KiB':>8} {'model KiB':>9} {'HGMMA/HMMA':>10} default")
    for r in sorted(results, key=lambda r: (r["kernel"], r["case"][3], r["causal"])):
        d = r["case"][3]
        tiles = AttentionTiles(*r["tiles"])
        is_default = getattr(backward_tiles(d, DTYPE, r["causal"], hopper), r["kernel"]) == tiles
        shape = f"{tiles.block_m}x{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}"
        model = backward_smem_bytes(tiles, d, 2, r["kernel"]) / 1024
        if "compile_error" in r:
            print(f"{r['kernel']:6} {d:>4} {str(r['causal']):6} {shape:28} {r['compile_error'][:60]}")
            continue
        print(f"{r['kernel']:6} {d:>4} {str(r['causal']):6} {shape:28} {r['regs']:>4} {r['stack_bytes']:>7} "
              f"{r['ldl']:>3}/{r['stl']:<4} {r['smem'] / 1024:>8.1f} {model:>9.1f} {r['hgmma']:>5}/{r['hmma']:<4} "
              f"{'*' if is_default else ''}")


# --------------------------------------------------------------------------------------------------------------------
# Timing on the GPU
# --------------------------------------------------------------------------------------------------------------------
def sweep(cases, out_dir: str, budget_s: float, device: torch.device = torch.device("cuda")) -> None:
    import torch.nn.functional as F

    from flashmoe_science.attention.api import flash_attention_science
    from flashmoe_science.bench.attention import (
        BACKENDS,
        AttentionShape,
        _measure_backward,
        attention_flops,
        cuda_median_ms,
    )

    started = time.perf_counter()
    traits = device_traits(device)
    target = triton.runtime.driver.active.get_current_target()
    jobs = compile_jobs(cases, (target.backend, target.arch, target.warp_size), traits)
    compiled = compile_all(jobs, min(16, os.cpu_count() or 1))
    resources = {(r["kernel"], r["case"][3], r["causal"], tuple(r["tiles"])): r for r in compiled}
    print(f"compiled {len(jobs)} configs in {time.perf_counter() - started:.0f} s "
          f"({sum('compile_error' in r for r in compiled)} failed)", flush=True)

    results = []
    for b, h, length, d in cases:
        for causal in (False, True):
            shape = AttentionShape(b, h, length, length, d, causal)
            flops = attention_flops(shape, "bwd")
            q, k, v, dout = (torch.randn(b, h, length, d, device=device, dtype=DTYPE) for _ in range(4))
            row = {"B": b, "H": h, "L": length, "D": d, "causal": causal, "baselines": {}, "configs": []}

            for name in ("sdpa-cudnn", "sdpa-flash"):
                backend = BACKENDS[name]
                try:
                    with backend.context():
                        ms, _ = _measure_backward(backend.prepare(shape, device), q, k, v, dout, cuda_median_ms,
                                                  device)
                    row["baselines"][name] = {"ms": ms, "tflops": flops / ms / 1e9}
                except Exception as error:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
                    row["baselines"][name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}

            # SDPA's gradients: the reference each config's error is measured against
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            ref = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=causal), leaves, dout)
            with torch.no_grad():
                out, lse = flash_attention_science(q, k, v, causal=causal, return_lse=True)
            delta = torch.empty_like(lse)
            grads = {"dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v)}
            dq_accum = torch.empty(b, h, length, padded_head_dim(d), device=device, dtype=torch.float32)

            def run(kernel: str, tiles: AttentionTiles | BackwardTiles):
                want_dq, want_dkdv = _gradients_wanted(kernel)
                bt = tiles if isinstance(tiles, BackwardTiles) else _in_every_slot(tiles)
                return triton_bwd.attention_backward(
                    q, k, v, out, lse, dout, delta, grads["dq"] if want_dq else None,
                    grads["dk"] if want_dkdv else None, grads["dv"] if want_dkdv else None, causal, d**-0.5, bt,
                    dq_accum if kernel == "fused" else None)

            def error_vs_sdpa(kernel: str) -> float:
                want_dq, want_dkdv = _gradients_wanted(kernel)
                pairs = ([(grads["dq"], ref[0])] if want_dq else []) + (
                    [(grads["dk"], ref[1]), (grads["dv"], ref[2])] if want_dkdv else [])
                return max(((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item()
                           for g, r in pairs)

            def measure(kernel: str, tiles) -> dict:
                rec = {"kernel": kernel}
                if isinstance(tiles, AttentionTiles):
                    rec.update(tiles.as_dict())
                    rec.update({key: value for key, value in resources.get(
                        (kernel, d, causal, tuple(tiles.as_dict().values())[:4]), {}).items()
                        if key in ("regs", "stack_bytes", "ldl", "stl", "hgmma", "hmma", "compile_error")})
                if time.perf_counter() - started > budget_s:
                    return {**rec, "skipped": "time budget"}
                try:
                    for g in grads.values():  # poisoned: an element a config never writes shows up as NaN error
                        g.fill_(float("nan"))
                    kernels = run(kernel, tiles)
                    main = kernels.get("dkdv", kernels.get("dq"))
                    if main is not None:
                        rec.update(n_regs=getattr(main, "n_regs", None), n_spills=getattr(main, "n_spills", None),
                                   smem=main.metadata.shared)
                    if kernel != "preprocess":
                        rec["err_vs_sdpa"] = error_vs_sdpa(kernel)
                    rec["ms"] = cuda_median_ms(lambda: run(kernel, tiles))
                    rec["tflops"] = flops / rec["ms"] / 1e9
                except Exception as error:  # noqa: BLE001 - OutOfResources (shared memory) and the like
                    rec["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                return rec

            defaults = backward_tiles(d, DTYPE, causal, traits)
            for kernel in KERNELS:
                for tiles in candidates(kernel, d, getattr(defaults, kernel)):
                    rec = measure(kernel, tiles)
                    rec["default"] = tiles == getattr(defaults, kernel)
                    row["configs"].append(rec)

            def best(kernel: str) -> dict | None:
                timed = [r for r in row["configs"] if r["kernel"] == kernel and "ms" in r]
                return min(timed, key=lambda r: r["ms"]) if timed else None

            pre = measure("preprocess", defaults)
            row["preprocess_ms"] = pre.get("ms")
            best_dkdv, best_dq = best("dkdv"), best("dq")
            if best_dkdv and best_dq:
                pair = BackwardTiles(dkdv=_tiles_of(best_dkdv), dq=_tiles_of(best_dq), fused=defaults.fused)
                row["two_pass_best"] = {**measure("two-pass", pair), "tiles": pair.as_dict()}
            row["two_pass_default"] = measure("two-pass", defaults)
            row["fused_default"] = next((r for r in row["configs"] if r["kernel"] == "fused" and r["default"]), None)
            row["fused_best"] = best("fused")
            results.append(row)
            print_row(row)
            del q, k, v, dout, out, lse, delta, grads, dq_accum, ref, leaves
            if device.type == "cuda":
                torch.cuda.empty_cache()

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "sweep_bwd.json")
    with open(path, "w") as f:
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else str(device)
        json.dump({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                   "elapsed_s": time.perf_counter() - started, "compile": compiled, "results": results}, f, indent=1,
                  default=str)
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s in all)")


def _tiles_of(rec: dict) -> AttentionTiles:
    return AttentionTiles(rec["block_m"], rec["block_n"], rec["num_warps"], rec["num_stages"])


def _tile_label(r: dict) -> str:
    return f"{r['block_m']}x{r['block_n']} w{r['num_warps']} s{r['num_stages']}{'*' if r.get('default') else ''}"


def print_row(row: dict) -> None:
    base = row["baselines"]
    cudnn_ms = base.get("sdpa-cudnn", {}).get("ms")

    def vs_cudnn(ms):
        return f"{cudnn_ms / ms:.2f}x" if cudnn_ms and ms else "n/a"

    print(f"\nB{row['B']} H{row['H']} L{row['L']} D{row['D']} causal={row['causal']}: "
          + " ".join(f"{n} {v['tflops']:.0f} TF ({v['ms']:.3f} ms)" if "ms" in v else f"{n} {v['error'][:60]}"
                     for n, v in base.items()), flush=True)
    for label, key in (("fused default", "fused_default"), ("fused best", "fused_best"),
                       ("two-pass default", "two_pass_default"), ("two-pass best pair", "two_pass_best")):
        r = row.get(key)
        if r and "ms" in r:
            if "block_m" in r:
                tiles = _tile_label(r)
            elif "tiles" in r:
                tiles = " + ".join(f"{k} {_tile_label(r['tiles'][k])}" for k in ("dkdv", "dq"))
            else:
                tiles = ""
            print(f"  {label:19} {r['tflops']:6.0f} TF/s {r['ms']:8.3f} ms  {vs_cudnn(r['ms'])} cuDNN  {tiles}",
                  flush=True)
    # dkdv and dq rows time one kernel (plus the preprocess): their TF/s would not be the backward's
    print(f"  {'kernel':6} {'tile':16} {'ms':>8} {'TF/s':>6} {'regs':>4} {'spill':>5} {'smem':>7} {'err':>8}",
          flush=True)
    for r in sorted(row["configs"], key=lambda r: (r["kernel"], r.get("ms", float("inf")))):
        if "ms" in r:
            tflops = f"{r['tflops']:6.0f}" if r["kernel"] == "fused" else f"{'':6}"
            print(f"  {r['kernel']:6} {_tile_label(r):16} {r['ms']:8.3f} {tflops} "
                  f"{r.get('n_regs') or 0:>4} {r.get('n_spills') or 0:>5} {r.get('smem') or 0:>7} "
                  f"{r.get('err_vs_sdpa', float('nan')):8.1e}", flush=True)
        else:
            reason = r.get("error") or r.get("skipped") or r.get("compile_error")
            print(f"  {r['kernel']:6} {_tile_label(r):16} {reason}"[:160], flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--kernels", default=",".join(KERNELS), help="subset of fused,dkdv,dq to time")
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="stop timing new configs after this many seconds (the whole run stays < 4 min)")
    parser.add_argument("--offline", action="store_true", help="compile for sm_90 and report resources; no GPU")
    args = parser.parse_args()
    cases = [parse_case(c) for c in args.cases.split(",")]
    KERNELS[:] = args.kernels.split(",")
    if args.offline:
        offline_report(cases)
        return
    sweep(cases, args.out, args.budget_s)


if __name__ == "__main__":
    main()
