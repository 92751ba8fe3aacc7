"""A/B of the MoE backward's dx GEMM, ``dx32[token] += d(gate, up)[row] @ w1[e]``: the warp-specialised Gluon
kernel (moe/hopper/dx_sm90.py, several tile configs) against the Triton kernel the library runs
(``triton_gemm.dx_launch`` at ``choose_tiles``' tiles) and torch._grouped_mm doing the same GEMM.

    PYTHONPATH=src:scripts python scripts/ab_moe_dx_sm90.py --out $OUT          # on the H200, < 2 min
    PYTHONPATH=src:scripts python scripts/ab_moe_dx_sm90.py --offline           # sm_90 builds only, no GPU

Inputs as scripts/sweep_moe.py makes them (bench.moe._make_inputs, moe_route, sort_pairs_by_expert, and its
Buffers / PairFill: random d(gate, up) per routed pair at that pair's sorted row), except that the padding rows of
d(gate, up) are set to NaN (in a real backward they are never written): a kernel that let a padding row into dx
shows NaNs. Checks, per Gluon config: max |gluon - triton| / max |triton| (both accumulate in float32 and add into
float32: expect ~1e-7 or exact equality), and both against a float32 torch reference. Then the median time
(triton.testing.do_bench, L2 flushed before each call) of each, in TFLOP/s with FLOPs = 4 * pairs * d * F.
torch._grouped_mm is the GEMM alone on the unpadded rows in expert order (no combine: a ceiling); "gmm+combine"
adds the float32 index_add_ into (T, d) that our kernels' atomics do.

A config that hangs (a deadlock would be a kernel bug) ends the process after --hang-s seconds; the results so far
are in the JSON (written after every measurement).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import re
import sys
import time

import torch

from flashmoe_science.moe.hopper import dx_sm90 as gdx
from flashmoe_science.moe.hopper.dx_sm90 import DxConfig

CASES = ("mixtral-8x7b:4096", "qwen3-30b-a3b:4096")
# the cooperative 128x256 tile first (the one the registers were sized for), the ping-pong ones last
CONFIGS = {
    "n256s3": DxConfig(block_n=256, num_stages=3),
    "n256s4": DxConfig(block_n=256, num_stages=4),
    "n128s3": DxConfig(block_n=128, num_stages=3),
    "n128s4": DxConfig(block_n=128, num_stages=4),
    "n128s5": DxConfig(block_n=128, num_stages=5),
    "n128s4p": DxConfig(block_n=128, num_stages=4, pingpong=True),
    "n128s5p": DxConfig(block_n=128, num_stages=5, pingpong=True),
    "n128s6p": DxConfig(block_n=128, num_stages=6, pingpong=True),
}


def _dims(model):
    from flashmoe_science.bench.moe import MODELS

    s = MODELS[model]
    return s["num_experts"], s["top_k"], s["d_model"], s["d_ff"]


# ------------------------------------------------------------------------------------------------- offline builds
def _meta_case(model, num_tokens):
    from flashmoe_science.moe.dispatch import sort_buffers

    num_experts, top_k, d_model, d_ff = _dims(model)
    dev = torch.device("meta")
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, gdx.BLOCK_M, dev)  # shapes only
    tiles_max = sort.tile_expert.numel()
    dgu = torch.empty(tiles_max * gdx.BLOCK_M, 2 * d_ff, dtype=torch.bfloat16, device=dev)
    w1 = torch.empty(num_experts, 2 * d_ff, d_model, dtype=torch.bfloat16, device=dev)
    dx32 = torch.empty(num_tokens, d_model, dtype=torch.float32, device=dev)
    return dgu, w1, dx32, sort


SETMAXNREG = r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?(0x[0-9a-f]+)"  # the partitions' register counts


def offline(cases, names, out_dir):
    from sass_tools import cuobjdump

    records = []
    print(f"{'case':<24} {'config':<8} {'tile':<28} {'smem':>7} {'maxreg':>6} {'LDL/STL':>7} {'local':>5}  sass")
    for case in cases:
        model, num_tokens = case.split(":")
        tensors = _meta_case(model, int(num_tokens))
        for name in names:
            cfg = CONFIGS[name]
            rec = {"case": case, "config": name, "tile": cfg.label()}
            try:
                start = time.perf_counter()
                compiled = gdx.compile_offline(*tensors, cfg)
                sass = cuobjdump(compiled.asm["cubin"], "-sass")
                usage = " ".join(cuobjdump(compiled.asm["cubin"], "-res-usage").split())
                local = re.search(r"LOCAL:(\d+)", usage)
                launch_regs = re.search(r"REG:(\d+)", usage)
                regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
                rec.update(
                    compile_s=round(time.perf_counter() - start, 2), smem=compiled.metadata.shared,
                    # ptxas reports the launch cap (REGISTER_CAP) for warp-specialised kernels; the highest register
                    # the SASS names (+1) is what the widest partition (a consumer, after setmaxnreg) really uses
                    max_register=max(regs) + 1 if regs else 0,
                    launch_regs=int(launch_regs.group(1)) if launch_regs else None,
                    local_bytes=int(local.group(1)) if local else None,
                    LDL=len(re.findall(r"\bLDL\b", sass)), STL=len(re.findall(r"\bSTL\b", sass)),
                    HGMMA=sorted(set(re.findall(r"\bHGMMA\.\w+", sass))), n_HGMMA=len(re.findall(r"\bHGMMA\b", sass)),
                    UTMALDG=len(re.findall(r"\bUTMALDG\b", sass)), REDG=sorted(set(re.findall(r"\bREDG\S*", sass))),
                    setmaxnreg=sorted({int(v, 16) for v in re.findall(SETMAXNREG, sass)}))
                print(f"{case:<24} {name:<8} {cfg.label():<28} {rec['smem']:>7} {rec['max_register']:>6} "
                      f"{rec['LDL']:>3}/{rec['STL']:<3} {rec['local_bytes']:>5}  "
                      f"{'+'.join(rec['HGMMA'])} x{rec['n_HGMMA']}, "
                      f"UTMALDG {rec['UTMALDG']}, {'+'.join(rec['REDG'])}, setmaxnreg {rec['setmaxnreg']}", flush=True)
            except Exception as error:  # noqa: BLE001 - a config that does not build is reported, not fatal
                rec["error"] = f"{type(error).__name__}: {str(error)[:400]}"
                print(f"{case:<24} {name:<8} FAILED {rec['error']}", flush=True)
            records.append(rec)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "ab_moe_dx_sm90_offline.json"), "w") as f:
            json.dump(records, f, indent=1)


# --------------------------------------------------------------------------------------------------------- GPU A/B
def _bench(fn, rep):
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def _rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _fp32_reference(dgu, w1, sort, num_tokens):
    """dx in float32 by torch (TF32 off): per expert, its valid sorted rows @ w1[e], index_add_ into (T, d)."""
    ids = sort.sorted_pair_ids.long()
    out = torch.zeros(num_tokens, w1.shape[2], dtype=torch.float32, device=w1.device)
    starts, counts = sort.expert_row_start.tolist(), sort.expert_counts.tolist()
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for e, (start, count) in enumerate(zip(starts, counts)):
            if count:
                rows = slice(start, start + count)
                out.index_add_(0, ids[rows] // sort.top_k, dgu[rows].float() @ w1[e].float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return out


def gpu_ab(cases, names, out_dir, rep, hang_s, fp32_ref, device=None):
    """The A/B on ``device`` (default cuda; the CPU with TRITON_INTERPRET=1 and stubs only exercises the code)."""
    device = device or torch.device("cuda")
    on_gpu = device.type == "cuda"
    start = time.perf_counter()
    report = {"gpu": torch.cuda.get_device_name() if on_gpu else str(device), "torch": torch.__version__,
              "configs": {name: dataclasses.asdict(CONFIGS[name]) for name in names}, "cases": []}
    os.makedirs(out_dir, exist_ok=True)

    def write():
        with open(os.path.join(out_dir, "ab_moe_dx_sm90.json"), "w") as f:
            json.dump(report, f, indent=1)

    for case_name in cases:
        case = _run_case(case_name, names, rep, hang_s, fp32_ref, device, report, write)
        if case is not None:
            _print_table(case)
        if on_gpu:
            torch.cuda.empty_cache()
    report["wall_s"] = round(time.perf_counter() - start, 1)
    write()
    print(f"total {report['wall_s']} s")


def _run_case(case_name, names, rep, hang_s, fp32_ref, device, report, write):
    """One model:T: inputs, the Triton and torch timings, then every Gluon config (appended to report["cases"],
    written after every measurement). None if the heuristic's block_m is not the Gluon kernel's."""
    import sweep_moe as sm

    from flashmoe_science.bench import moe as bench_moe
    from flashmoe_science.moe import moe_route
    from flashmoe_science.moe.dispatch import sort_pairs_by_expert
    from flashmoe_science.moe.tiles import choose_tiles

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, num_tokens = case_name.split(":")
    num_tokens = int(num_tokens)
    num_experts, top_k, d_model, d_ff = _dims(model)
    torch.manual_seed(0)
    x, w1, w2, logits = bench_moe._make_inputs(num_tokens, num_experts, d_model, d_ff, torch.bfloat16, device)
    weights, ids = moe_route(logits, top_k)
    weights32 = weights.float().contiguous()
    grad_out = torch.randn_like(x)
    pairs = num_tokens * top_k
    flops = 4.0 * pairs * d_model * d_ff
    tiles = choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, device)
    if tiles.block_m != gdx.BLOCK_M:
        print(f"{case_name}: the heuristic's block_m is {tiles.block_m}, the Gluon kernel needs {gdx.BLOCK_M}; "
              f"skipped", flush=True)
        return None
    sort = sort_pairs_by_expert(ids, num_experts, tiles.block_m)
    buf = sm.Buffers(x, w1, w2, weights32, grad_out, sort, tiles.block_m, sm.PairFill(pairs), gather=False)
    dgu = buf.dgu_in
    dgu[sort.sorted_pair_ids >= sort.num_pairs] = float("nan")  # never written in a real backward: must not reach dx
    counts = sort.expert_counts.tolist()
    used_tiles = sum(-(-c // tiles.block_m) for c in counts)
    case = {"case": case_name, "T": num_tokens, "E": num_experts, "top_k": top_k, "d_model": d_model,
            "d_ff": d_ff, "pairs": pairs, "flops": flops, "row_tiles_used": used_tiles,
            "row_tiles_max": sort.tile_expert.numel(), "rows_per_expert": [min(counts), max(counts)],
            "triton_tiles": dataclasses.asdict(tiles.dx), "runs": {}}
    report["cases"].append(case)
    print(f"== {case_name}: {pairs} pairs, {used_tiles}/{sort.tile_expert.numel()} row tiles used, rows per "
          f"expert {min(counts)}..{max(counts)}; Triton dx tiles {sm.label(tiles, 'dx')}", flush=True)

    # the Triton kernel the library runs: the reference output
    launch = buf.launch("dx", tiles)
    buf.reset()
    launch()
    sync()
    ref = buf.out32.clone()
    case["triton_nan"] = bool(ref.isnan().any())
    ref32 = _fp32_reference(dgu, w1, sort, num_tokens) if fp32_ref else None
    if ref32 is not None:
        case["triton_err_vs_fp32"] = _rel_err(ref, ref32)
    ms = _bench(launch, rep)
    case["runs"]["triton"] = {"ms": ms, "tflops": flops / ms / 1e9}

    # torch._grouped_mm on the unpadded rows in expert order (as sweep_moe._grouped_mm_fns), with and without the
    # float32 combine
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)
    dgu_s = dgu[sort.pair_row.long()[order]]
    tokens_s = order // top_k
    dx_t = torch.zeros(num_tokens, d_model, dtype=torch.float32, device=device)
    ms = _bench(lambda: torch._grouped_mm(dgu_s, w1, offs=offs), rep)
    case["runs"]["grouped_mm"] = {"ms": ms, "tflops": flops / ms / 1e9}
    ms = _bench(lambda: dx_t.index_add_(0, tokens_s, torch._grouped_mm(dgu_s, w1, offs=offs).float()), rep)
    case["runs"]["grouped_mm+combine"] = {"ms": ms, "tflops": flops / ms / 1e9}
    write()

    dx = torch.zeros(num_tokens, d_model, dtype=torch.float32, device=device)
    for name in names:
        cfg = CONFIGS[name]
        rec = {"tile": cfg.label()}
        case["runs"][name] = rec

        def run(cfg=cfg):
            return gdx.dx_sm90(dgu, w1, dx, sort, tiles.block_m, cfg)

        try:
            dx.zero_()
            faulthandler.dump_traceback_later(hang_s, exit=True)  # a deadlocked kernel ends the run
            kernel = run()
            sync()
            faulthandler.cancel_dump_traceback_later()
            rec.update(err_vs_triton=_rel_err(dx, ref), identical=bool(torch.equal(dx, ref)),
                       nan=bool(dx.isnan().any()), regs=getattr(kernel, "n_regs", None),
                       spills=getattr(kernel, "n_spills", None),
                       smem=getattr(getattr(kernel, "metadata", None), "shared", None))
            if ref32 is not None:
                rec["err_vs_fp32"] = _rel_err(dx, ref32)
            ms = _bench(run, rep)
            rec.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as error:  # noqa: BLE001 - a config that fails is reported, the others still run
            faulthandler.cancel_dump_traceback_later()
            rec["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        write()
        print(f"  {name:<8} " + (f"FAILED {rec['error']}" if "error" in rec else
                                 f"{rec['ms']:.4f} ms {rec['tflops']:6.1f} TFLOP/s  err {rec['err_vs_triton']:.1e}"
                                 f" identical={rec['identical']} nan={rec['nan']}"), flush=True)
    return case


def _print_table(case):
    runs = case["runs"]
    base = runs["grouped_mm"]["tflops"]
    tri = runs["triton"]["tflops"]
    triton_tile = "n{block_n} k{block_k} w{num_warps} s{num_stages}".format(**case["triton_tiles"])
    print(f"\n{case['case']}  (FLOPs = 4*pairs*d*F = {case['flops'] / 1e12:.2f} T)")
    print(f"  {'kernel':<20} {'tile':<28} {'ms':>8} {'TFLOP/s':>8} {'x gmm':>6} {'x triton':>8} {'err/triton':>10} "
          f"{'err/fp32':>9}")
    for name, r in runs.items():
        tile = triton_tile if name == "triton" else r.get("tile", "")
        if "ms" not in r:
            print(f"  {name:<20} {tile:<28} {r.get('error', 'no time')}")
            continue
        err = f"{r['err_vs_triton']:10.1e}" if "err_vs_triton" in r else f"{'':>10}"
        e32 = case.get("triton_err_vs_fp32") if name == "triton" else r.get("err_vs_fp32")
        e32 = f"{e32:9.1e}" if e32 is not None else f"{'':>9}"
        print(f"  {name:<20} {tile:<28} {r['ms']:8.4f} {r['tflops']:8.1f} {r['tflops'] / base:6.3f} "
              f"{r['tflops'] / tri:8.3f} {err} {e32}")
    print(flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="")
    parser.add_argument("--offline", action="store_true", help="sm_90 builds and SASS counts only (no GPU needed)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of model:T")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    parser.add_argument("--rep", type=int, default=40, help="do_bench rep (ms of timed calls per measurement)")
    parser.add_argument("--hang-s", type=float, default=60.0, help="a first launch taking longer ends the run")
    parser.add_argument("--no-fp32-ref", action="store_true", help="skip the float32 torch reference")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    if args.offline:
        offline(cases, names, args.out)
        return
    if not torch.cuda.is_available():
        sys.exit("no GPU: use --offline for the sm_90 builds")
    gpu_ab(cases, names, args.out or ".", args.rep, args.hang_s, not args.no_fp32_ref)


if __name__ == "__main__":
    main()
