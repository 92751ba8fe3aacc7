"""A/B of the MoE backward's weight-gradient GEMMs, ``out[e] = A_e^T B_e`` (dw1 = d(gate, up)_e^T x_e, dw2 =
(weight * dout)_e^T h_e): the warp-specialised Gluon kernel (moe/hopper/wgrad_sm90.py, a few tile configs) against
the Triton kernel the library runs (``triton_gemm.dw1_launch`` / ``dw2_launch`` at ``choose_tiles``' tiles) and
torch._grouped_mm doing the same GEMMs.

    PYTHONPATH=src:scripts python scripts/ab_moe_wgrad_sm90.py --out $OUT        # on the H200, < 60 s
    PYTHONPATH=src:scripts python scripts/ab_moe_wgrad_sm90.py --offline         # sm_90 builds only, no GPU

Inputs as scripts/sweep_moe.py makes them (bench.moe._make_inputs, moe_route, sort_pairs_by_expert, its Buffers /
PairFill: random d(gate, up) and h per routed pair at that pair's sorted row, zeros in their padding rows; x_sorted
and g_sorted by the library's row gather, which writes zeros into the padding rows of used tiles: checked here,
"gather_padding_zero"). The Gluon kernel reads the padding rows of each expert's last K step (up to the next multiple
of block_k = 64): they must be zero. Every row past that (the rest of the expert's padding, unused row tiles) is set
to NaN in all four operands: a kernel that read one shows NaNs. Checks, per Gluon config and GEMM: max |gluon -
triton| / max |triton| (both round a float32 sum to bf16 once: expect 0 or ~1 bf16 ulp, 4e-3, in a few elements),
whether they are identical, and both against a float32 torch reference. Then the median time
(triton.testing.do_bench, L2 flushed before each call) of each, in TFLOP/s with FLOPs = 4 * pairs * d * F (dw1)
and 2 * pairs * d * F (dw2). torch._grouped_mm runs on the unpadded rows in expert order.

A config that hangs (a deadlock would be a kernel bug) ends the process after --hang-s seconds; the results so far
are in the JSON (written after every measurement). Past --budget-s of wall time the remaining Gluon configs are
skipped (recorded as such).
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

from flashmoe_science.moe.hopper import wgrad_sm90 as gw
from flashmoe_science.moe.hopper.wgrad_sm90 import WgradConfig

CASES = ("mixtral-8x7b:4096", "qwen3-30b-a3b:4096")
GEMMS = ("dw1", "dw2")
FLOP_FACTOR = {"dw1": 4, "dw2": 2}  # x pairs * d * F
# the cooperative 128x256 tile first (the Triton kernel's tile), the ping-pong ones last
CONFIGS = {
    "n256s3": WgradConfig(block_n=256, num_stages=3),
    "n256s4e2": WgradConfig(block_n=256, num_stages=4, epilogue_split=2),
    "n128s4p": WgradConfig(block_n=128, num_stages=4, pingpong=True),
    "n128s5p": WgradConfig(block_n=128, num_stages=5, pingpong=True),
    "n128s6pe2": WgradConfig(block_n=128, num_stages=6, pingpong=True, epilogue_split=2),
}
BLOCK_K = 64  # every config's: the rows past each expert's next multiple of it are NaN-poisoned
assert all(c.block_k == BLOCK_K for c in CONFIGS.values())


def _dims(model):
    from flashmoe_science.bench.moe import MODELS

    s = MODELS[model]
    return s["num_experts"], s["top_k"], s["d_model"], s["d_ff"]


def _gemm_shapes(d_model, d_ff):
    """(M, N) of out[e] = A_e^T B_e: dw1 (2F, d), dw2 (d, F)."""
    return {"dw1": (2 * d_ff, d_model), "dw2": (d_model, d_ff)}


# ------------------------------------------------------------------------------------------------- offline builds
def _meta_case(model, num_tokens, gemm):
    from flashmoe_science.moe.dispatch import sort_buffers

    num_experts, top_k, d_model, d_ff = _dims(model)
    dev = torch.device("meta")
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, 128, dev)  # shapes only
    tiles_max = sort.tile_expert.numel()
    M, N = _gemm_shapes(d_model, d_ff)[gemm]
    a = torch.empty(tiles_max * 128, M, dtype=torch.bfloat16, device=dev)
    b = torch.empty(tiles_max * 128, N, dtype=torch.bfloat16, device=dev)
    out = torch.empty(num_experts, M, N, dtype=torch.bfloat16, device=dev)
    return a, b, out, sort


SETMAXNREG = r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?(0x[0-9a-f]+)"  # the partitions' register counts


def offline(cases, names, out_dir):
    from sass_tools import cuobjdump

    records = []
    print(f"{'case':<24} {'gemm':<4} {'config':<10} {'tile':<32} {'smem':>7} {'maxreg':>6} {'LDL/STL':>7} "
          f"{'local':>5}  sass")
    for case in cases:
        model, num_tokens = case.split(":")
        for gemm in GEMMS:
            tensors = _meta_case(model, int(num_tokens), gemm)
            for name in names:
                cfg = CONFIGS[name]
                rec = {"case": case, "gemm": gemm, "config": name, "tile": cfg.label()}
                try:
                    start = time.perf_counter()
                    compiled = gw.compile_offline(*tensors, cfg)
                    sass = cuobjdump(compiled.asm["cubin"], "-sass")
                    usage = " ".join(cuobjdump(compiled.asm["cubin"], "-res-usage").split())
                    local = re.search(r"LOCAL:(\d+)", usage)
                    launch_regs = re.search(r"REG:(\d+)", usage)
                    regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
                    hgmma = re.findall(r"\bHGMMA\.\S+ R\d+, ([^,\s]+)", sass)
                    rec.update(
                        compile_s=round(time.perf_counter() - start, 2), smem=compiled.metadata.shared,
                        smem_estimate=gw.smem_bytes(cfg),
                        # ptxas reports the launch cap for warp-specialised kernels; the highest register the SASS
                        # names (+1) is what the widest partition (a consumer, after setmaxnreg) really uses
                        max_register=max(regs) + 1 if regs else 0,
                        launch_regs=int(launch_regs.group(1)) if launch_regs else None,
                        local_bytes=int(local.group(1)) if local else None,
                        LDL=len(re.findall(r"\bLDL\b", sass)), STL=len(re.findall(r"\bSTL\b", sass)),
                        LDSM=len(re.findall(r"\bLDSM\b", sass)), STSM=len(re.findall(r"\bSTSM\b", sass)),
                        HGMMA=sorted(set(re.findall(r"\bHGMMA\.\w+", sass))), n_HGMMA=len(hgmma),
                        # gdesc[URx].tnspA.tnspB: both operands by shared-memory descriptor, A read transposed
                        HGMMA_operands=sorted({re.sub(r"\[UR\d+\]", "", op) for op in hgmma}),
                        UTMALDG=len(re.findall(r"\bUTMALDG\b", sass)), UTMASTG=len(re.findall(r"\bUTMASTG\b", sass)),
                        setmaxnreg=sorted({int(v, 16) for v in re.findall(SETMAXNREG, sass)}))
                    print(f"{case:<24} {gemm:<4} {name:<10} {cfg.label():<32} {rec['smem']:>7} "
                          f"{rec['max_register']:>6} {rec['LDL']:>3}/{rec['STL']:<3} {rec['local_bytes']:>5}  "
                          f"{'+'.join(rec['HGMMA'])} x{rec['n_HGMMA']} {'+'.join(rec['HGMMA_operands'])}, "
                          f"UTMALDG {rec['UTMALDG']}, UTMASTG {rec['UTMASTG']}, STSM {rec['STSM']}, "
                          f"LDSM {rec['LDSM']}, setmaxnreg {rec['setmaxnreg']}", flush=True)
                except Exception as error:  # noqa: BLE001 - a config that does not build is reported, not fatal
                    rec["error"] = f"{type(error).__name__}: {str(error)[:400]}"
                    print(f"{case:<24} {gemm:<4} {name:<10} FAILED {rec['error']}", flush=True)
                records.append(rec)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "ab_moe_wgrad_sm90_offline.json"), "w") as f:
            json.dump(records, f, indent=1)


# --------------------------------------------------------------------------------------------------------- GPU A/B
def _bench(fn, rep):
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def _rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _fp32_reference(a, b, sort):
    """out[e] = A_e^T B_e in float32 by torch (TF32 off), on each expert's valid rows."""
    starts, counts = sort.expert_row_start.tolist(), sort.expert_counts.tolist()
    out = torch.zeros(len(counts), a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for e, (start, count) in enumerate(zip(starts, counts)):
            if count:
                out[e] = a[start:start + count].float().T @ b[start:start + count].float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return out


def _unread_rows(sort, num_rows, device):
    """Rows the kernel never reads: past each expert's next multiple of BLOCK_K (the rest of its padding) and every
    row of the unused tiles. Also returns the padding rows it does read (which must be zero)."""
    unread = torch.ones(num_rows, dtype=torch.bool, device=device)
    read_padding = torch.zeros(num_rows, dtype=torch.bool, device=device)
    for start, count in zip(sort.expert_row_start.tolist(), sort.expert_counts.tolist()):
        read = -(-count // BLOCK_K) * BLOCK_K
        unread[start:start + read] = False
        read_padding[start + count:start + read] = True
    return unread, read_padding


def gpu_ab(cases, names, out_dir, rep, hang_s, budget_s, fp32_ref, device=None):
    """The A/B on ``device`` (default cuda)."""
    device = device or torch.device("cuda")
    on_gpu = device.type == "cuda"
    start = time.perf_counter()
    report = {"gpu": torch.cuda.get_device_name() if on_gpu else str(device), "torch": torch.__version__,
              "configs": {name: dataclasses.asdict(CONFIGS[name]) for name in names}, "cases": []}
    os.makedirs(out_dir, exist_ok=True)

    def write():
        report["wall_s"] = round(time.perf_counter() - start, 1)
        with open(os.path.join(out_dir, "ab_moe_wgrad_sm90.json"), "w") as f:
            json.dump(report, f, indent=1)

    for case_name in cases:
        case = _run_case(case_name, names, rep, hang_s, budget_s, start, fp32_ref, device, report, write)
        if case is not None:
            _print_tables(case)
        if on_gpu:
            torch.cuda.empty_cache()
    write()
    print(f"total {report['wall_s']} s")


def _run_case(case_name, names, rep, hang_s, budget_s, t0, fp32_ref, device, report, write):
    """One model:T: inputs, the Triton and torch timings, then every Gluon config, for dw1 and dw2 (appended to
    report["cases"], written after every measurement). None if the heuristic's block_m is not 128."""
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
    tiles = choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, device)
    if tiles.block_m != 128:
        print(f"{case_name}: the heuristic's block_m is {tiles.block_m}, not 128; skipped", flush=True)
        return None
    sort = sort_pairs_by_expert(ids, num_experts, tiles.block_m)
    buf = sm.Buffers(x, w1, w2, weights32, grad_out, sort, tiles.block_m, sm.PairFill(pairs), gather=True)
    num_rows = buf.dgu_in.shape[0]
    unread, read_padding = _unread_rows(sort, num_rows, device)
    counts = sort.expert_counts.tolist()
    case = {"case": case_name, "T": num_tokens, "E": num_experts, "top_k": top_k, "d_model": d_model, "d_ff": d_ff,
            "pairs": pairs, "rows_per_expert": [min(counts), max(counts)],
            "padding_rows_read": int(read_padding.sum()), "rows_never_read": int(unread.sum()),
            # the library's row gather (x_sorted, g_sorted) must leave zeros in the padding rows the kernel reads
            "gather_padding_zero": bool((buf.x_sorted[read_padding] == 0).all() and
                                        (buf.g_sorted[read_padding] == 0).all()),
            "triton_tiles": {g: dataclasses.asdict(getattr(tiles, g)) for g in GEMMS}, "gemms": {}}
    for t in (buf.dgu_in, buf.x_sorted, buf.g_sorted, buf.h_in):
        t[unread] = float("nan")  # never written in a real backward either: must not reach the output
    report["cases"].append(case)
    print(f"== {case_name}: {pairs} pairs, rows per expert {min(counts)}..{max(counts)}, "
          f"{case['padding_rows_read']} padding rows read (zeros from the gather: {case['gather_padding_zero']}), "
          f"{case['rows_never_read']} rows NaN; Triton tiles dw1 {sm.label(tiles, 'dw1')}, "
          f"dw2 {sm.label(tiles, 'dw2')}", flush=True)
    gmm = sm._grouped_mm_fns(x, w1, w2, ids, weights32, grad_out, buf.h_in, buf.dgu_in, sort)
    operands = {"dw1": (buf.dgu_in, buf.x_sorted), "dw2": (buf.g_sorted, buf.h_in)}

    for gemm in GEMMS:
        a, b = operands[gemm]
        flops = FLOP_FACTOR[gemm] * pairs * d_model * d_ff
        runs = {}
        rec_gemm = {"flops": flops, "M_N": list(_gemm_shapes(d_model, d_ff)[gemm]), "runs": runs}
        case["gemms"][gemm] = rec_gemm
        # the Triton kernel the library runs: the reference output
        launch = buf.launch(gemm, tiles)
        launch()
        sync()
        ref = buf.result(gemm).clone()
        rec_gemm["triton_nan"] = bool(ref.isnan().any())
        ref32 = _fp32_reference(a, b, sort) if fp32_ref else None
        if ref32 is not None:
            rec_gemm["triton_err_vs_fp32"] = _rel_err(ref, ref32)
        ms = _bench(launch, rep)
        runs["triton"] = {"ms": ms, "tflops": flops / ms / 1e9}
        try:
            ms = _bench(gmm[gemm], rep)
            runs["grouped_mm"] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as error:  # noqa: BLE001 - the torch baseline is optional
            runs["grouped_mm"] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
        write()

        out = torch.empty_like(ref)
        for name in names:
            cfg = CONFIGS[name]
            rec = {"tile": cfg.label()}
            runs[name] = rec
            if time.perf_counter() - t0 > budget_s:
                rec["error"] = f"skipped: past --budget-s {budget_s}"
                print(f"  {gemm} {name:<10} {rec['error']}", flush=True)
                continue

            def run(cfg=cfg, a=a, b=b):
                return gw.wgrad_sm90(a, b, out, sort, cfg)

            try:
                out.fill_(float("nan"))  # every element must be written
                # a deadlocked kernel ends the run (first launch, compile included, and the timing)
                faulthandler.dump_traceback_later(hang_s, exit=True)
                kernel = run()
                sync()
                rec.update(err_vs_triton=_rel_err(out, ref), identical=bool(torch.equal(out, ref)),
                           nan=bool(out.isnan().any()), regs=getattr(kernel, "n_regs", None),
                           spills=getattr(kernel, "n_spills", None),
                           smem=getattr(getattr(kernel, "metadata", None), "shared", None))
                if ref32 is not None:
                    rec["err_vs_fp32"] = _rel_err(out, ref32)
                ms = _bench(run, rep)
                faulthandler.cancel_dump_traceback_later()
                rec.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as error:  # noqa: BLE001 - a config that fails is reported, the others still run
                faulthandler.cancel_dump_traceback_later()
                rec["error"] = f"{type(error).__name__}: {str(error)[:400]}"
            write()
            print(f"  {gemm} {name:<10} " + (
                f"FAILED {rec['error']}" if "error" in rec else
                f"{rec['ms']:.4f} ms {rec['tflops']:6.1f} TFLOP/s  err {rec['err_vs_triton']:.1e} "
                f"identical={rec['identical']} nan={rec['nan']}"), flush=True)
        del ref, ref32, out
    return case


def _print_tables(case):
    for gemm, g in case["gemms"].items():
        runs = g["runs"]
        base = runs.get("grouped_mm", {}).get("tflops")
        tri = runs["triton"]["tflops"]
        t = case["triton_tiles"][gemm]
        triton_tile = f"{t['block_m'] or t['block_n']}x{t['block_n']}x{t['block_k']} w{t['num_warps']} " \
                      f"s{t['num_stages']} p{t['persistent']}"
        print(f"\n{case['case']} {gemm} (M x N = {g['M_N'][0]} x {g['M_N'][1]}, FLOPs {g['flops'] / 1e12:.2f} T)")
        print(f"  {'kernel':<12} {'tile':<32} {'ms':>8} {'TFLOP/s':>8} {'x gmm':>6} {'x triton':>8} "
              f"{'err/triton':>10} {'err/fp32':>9}")
        for name, r in runs.items():
            tile = triton_tile if name == "triton" else r.get("tile", "")
            if "ms" not in r:
                print(f"  {name:<12} {tile:<32} {r.get('error', 'no time')}")
                continue
            err = f"{r['err_vs_triton']:10.1e}" if "err_vs_triton" in r else f"{'':>10}"
            e32 = g.get("triton_err_vs_fp32") if name == "triton" else r.get("err_vs_fp32")
            e32 = f"{e32:9.1e}" if e32 is not None else f"{'':>9}"
            vs_gmm = f"{r['tflops'] / base:6.3f}" if base else f"{'':>6}"
            print(f"  {name:<12} {tile:<32} {r['ms']:8.4f} {r['tflops']:8.1f} {vs_gmm} {r['tflops'] / tri:8.3f} "
                  f"{err} {e32}")
    print(flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="")
    parser.add_argument("--offline", action="store_true", help="sm_90 builds and SASS counts only (no GPU needed)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of model:T")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    parser.add_argument("--rep", type=int, default=40, help="do_bench rep (ms of timed calls per measurement)")
    parser.add_argument("--hang-s", type=float, default=30.0, help="a first launch taking longer ends the run")
    parser.add_argument("--budget-s", type=float, default=55.0, help="skip the remaining Gluon configs past this")
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
    gpu_ab(cases, names, args.out or ".", args.rep, args.hang_s, args.budget_s, not args.no_fp32_ref)


if __name__ == "__main__":
    main()
