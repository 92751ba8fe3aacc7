"""A/B of the MoE backward's dx GEMM, ``dx32[token] += d(gate, up)[row] @ w1[e]`` (``--gemm dh``: its dh GEMM;
``--gemm dh_swiglu``: dh with the SwiGLU backward in its epilogue): the
warp-specialised Gluon kernel (moe/hopper/dx_sm90.py, several tile configs) against the Triton kernel the library
runs (``triton_gemm.dx_launch`` at ``choose_tiles``' tiles) and torch._grouped_mm doing the same GEMM.

    PYTHONPATH=src:scripts python scripts/ab_moe_dx_sm90.py --out $OUT          # on the H200, < 2 min
    PYTHONPATH=src:scripts python scripts/ab_moe_dx_sm90.py --offline           # sm_90 builds only, no GPU
    PYTHONPATH=src:scripts python scripts/ab_moe_dx_sm90.py --gemm dh --out $OUT  # the dh GEMM instead (below)

Inputs as scripts/sweep_moe.py makes them (bench.moe._make_inputs, moe_route, sort_pairs_by_expert, and its
Buffers / PairFill: random d(gate, up) per routed pair at that pair's sorted row), except that the padding rows of
d(gate, up) are set to NaN (in a real backward they are never written): a kernel that let a padding row into dx
shows NaNs. Checks, per Gluon config: max |gluon - triton| / max |triton| (both accumulate in float32 and add into
float32: expect ~1e-7 or exact equality), and both against a float32 torch reference. Then the median time
(triton.testing.do_bench, L2 flushed before each call) of each, in TFLOP/s with FLOPs = 4 * pairs * d * F.
torch._grouped_mm is the GEMM alone on the unpadded rows in expert order (no combine: a ceiling); "gmm+combine"
adds the float32 index_add_ into (T, d) that our kernels' atomics do.

``--gemm dh``: the same kernel's row-store mode, ``dh[row] = dout[token(row)] @ w2[e]`` (K = d, N = F; FLOPs =
2 * pairs * d * F), against ``triton_gemm.dh_launch`` at ``choose_tiles``' tiles and torch._grouped_mm on dout's rows in
expert order (bf16 output, no gather: a ceiling). The Gluon kernel reads dout already gathered to the sorted rows
(``triton_gemm.sorted_rows``, zeros in padding rows, which are then set to NaN here: a padding row must not reach
a valid one, and dh's padding rows must stay untouched); that copy is timed alone ("gather") and each config both
alone and after it ("<config>+gather": what moe_backward runs). Errors are over the valid rows.

``--gemm dh_swiglu``: the same dh product with the SwiGLU backward in the epilogue (``dh_swiglu_sm90``, what
moe_backward runs on Hopper) against what it replaces, ``triton_gemm.dh_launch`` (float32 dh) followed by
``swiglu_backward_launch``, each timed alone and the two in a row ("triton dh+swiglu"). Inputs: the forward's saved
gate_up (random, NaN in the rows of no pair: the kernels must mask them), h = silu(gate) * up rounded, softmax routing
weights. Per Gluon config: the fused kernel alone, after the row gather of dout ("<config>+gather": what
moe_backward runs) and, for scale, the same tile's plain dh (row store, "<config> dh"). Checks against the Triton
pair: d(gate, up) on the valid rows (max |diff| / max |ref| and the fraction of elements not identical: dh differs in
its last float32 bits, so a rounding to bf16 flips now and then), the routing-weight gradient (max |diff| / max
|ref|), zeros in the padding rows of used tiles, untouched (NaN) rows of unused tiles. Each config's build stats
(registers, local memory, spills, shared memory) come from the JIT-compiled binary's SASS, as ``--offline`` reports
them without a GPU. The summary line per case: Triton dh + swiglu vs fused + gather, in ms.

    PYTHONPATH=src:scripts python scripts/ab_moe_dx_sm90.py --gemm dh_swiglu --out $OUT   # on the H200, ~2 min
    PYTHONPATH=src:scripts python scripts/ab_moe_dx_sm90.py --gemm dh_swiglu --offline    # sm_90 builds, no GPU

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
from flashmoe_science.moe.hopper.dx_sm90 import DxConfig, SwigluOperands

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
    # dx with the last, partial wave's items split along K (split_tail)
    "n256s3t": DxConfig(block_n=256, num_stages=3, split_tail=True),
    "n256s4t": DxConfig(block_n=256, num_stages=4, split_tail=True),
    "n128s4pt": DxConfig(block_n=128, num_stages=4, pingpong=True, split_tail=True),
    "n128s5pt": DxConfig(block_n=128, num_stages=5, pingpong=True, split_tail=True),
    # dh_swiglu (ping-pong only: one set of epilogue buffers, 3 x 128 x 128, beside a ring of at most 4 stages):
    # the epilogue's chunk width (swiglu_cols, default 16: 16 values per thread per chunk)
    "n128s3p": DxConfig(block_n=128, num_stages=3, pingpong=True),
    "n128s4pc32": DxConfig(block_n=128, num_stages=4, pingpong=True, swiglu_cols=32),
    "n128s3pc32": DxConfig(block_n=128, num_stages=3, pingpong=True, swiglu_cols=32),
}
# dh's K = d and N = F differ from dx's (2F, d): dx's ping-pong tile with 4 and 5 stages, and the cooperative
# 128x256 tile; dh_swiglu: ping-pong with 4 or 3 stages and 32-column chunks (tests/moe/test_moe_dh_sm90.py's
# SWIGLU_CONFIGS: keep in step), and 16-column chunks for comparison
DEFAULT_CONFIGS = {"dx": ["n256s3", "n256s4", "n128s3", "n128s4", "n128s5", "n128s4p", "n128s5p", "n128s6p"],
                   "dh": ["n128s4p", "n128s5p", "n256s3"],
                   "dh_swiglu": ["n128s4pc32", "n128s3pc32", "n128s4p"]}


def _dims(model):
    from flashmoe_science.bench.moe import MODELS

    s = MODELS[model]
    return s["num_experts"], s["top_k"], s["d_model"], s["d_ff"]


# ------------------------------------------------------------------------------------------------- offline builds
def _meta_case(model, num_tokens, gemm="dx"):
    """(the positional tensors of compile_offline: a, w, out, sort; SwigluOperands or None) on the meta device."""
    from flashmoe_science.moe.dispatch import sort_buffers

    num_experts, top_k, d_model, d_ff = _dims(model)
    dev = torch.device("meta")
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, gdx.BLOCK_M, dev)  # shapes only
    rows = sort.tile_expert.numel() * gdx.BLOCK_M
    bf16 = dict(dtype=torch.bfloat16, device=dev)
    if gemm == "dh":  # dout_sorted (rows, d), w2 (E, d, F), dh (rows, F)
        return (torch.empty(rows, d_model, **bf16), torch.empty(num_experts, d_model, d_ff, **bf16),
                torch.empty(rows, d_ff, dtype=torch.float32, device=dev), sort), None
    if gemm == "dh_swiglu":  # as dh, out = dgu (rows, 2F) bf16, and gate_up, h, weights, dweights
        pair_values = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
        swiglu = SwigluOperands(torch.empty(rows, 2 * d_ff, **bf16), torch.empty(rows, d_ff, **bf16), pair_values,
                                pair_values)
        return (torch.empty(rows, d_model, **bf16), torch.empty(num_experts, d_model, d_ff, **bf16),
                torch.empty(rows, 2 * d_ff, **bf16), sort), swiglu
    dgu = torch.empty(rows, 2 * d_ff, **bf16)
    w1 = torch.empty(num_experts, 2 * d_ff, d_model, **bf16)
    dx32 = torch.empty(num_tokens, d_model, dtype=torch.float32, device=dev)
    return (dgu, w1, dx32, sort), None


SETMAXNREG = r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?(0x[0-9a-f]+)"  # the partitions' register counts


def build_stats(compiled) -> dict:
    """What a build's SASS says about its resources: shared memory, the highest register the widest partition names,
    local memory and spill instructions, the MMA / TMA / epilogue instruction mix, the partitions' setmaxnreg."""
    from sass_tools import cuobjdump

    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    usage = " ".join(cuobjdump(compiled.asm["cubin"], "-res-usage").split())
    local = re.search(r"LOCAL:(\d+)", usage)
    launch_regs = re.search(r"REG:(\d+)", usage)
    regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
    return dict(
        smem=compiled.metadata.shared,
        # ptxas reports the launch cap (REGISTER_CAP) for warp-specialised kernels; the highest register the SASS
        # names (+1) is what the widest partition (a consumer, after setmaxnreg) really uses
        max_register=max(regs) + 1 if regs else 0,
        launch_regs=int(launch_regs.group(1)) if launch_regs else None,
        local_bytes=int(local.group(1)) if local else None,
        LDL=len(re.findall(r"\bLDL\b", sass)), STL=len(re.findall(r"\bSTL\b", sass)),
        HGMMA=sorted(set(re.findall(r"\bHGMMA\.\w+", sass))), n_HGMMA=len(re.findall(r"\bHGMMA\b", sass)),
        UTMALDG=len(re.findall(r"\bUTMALDG\b", sass)), REDG=sorted(set(re.findall(r"\bREDG\S*", sass))),
        n_REDG=len(re.findall(r"\bREDG\b", sass)), n_LDG=len(re.findall(r"\bLDG\b", sass)),
        STG=sorted(set(re.findall(r"\bSTG\S*", sass))), n_STG=len(re.findall(r"\bSTG\b", sass)),
        n_BAR=len(re.findall(r"\bBAR\.SYNC\b", sass)),
        setmaxnreg=sorted({int(v, 16) for v in re.findall(SETMAXNREG, sass)}))


def _stats_line(rec, gemm):
    if gemm == "dx":
        epilogue = "+".join(rec["REDG"])
    elif gemm == "dh":
        epilogue = f"{'+'.join(rec['STG'])} x{rec['n_STG']}"
    else:
        epilogue = f"LDG x{rec['n_LDG']}, {'+'.join(rec['STG'])} x{rec['n_STG']}, REDG x{rec['n_REDG']}"
    return (f"{rec['smem']:>7} {rec['max_register']:>6} {rec['LDL']:>3}/{rec['STL']:<3} {rec['local_bytes']:>5}  "
            f"{'+'.join(rec['HGMMA'])} x{rec['n_HGMMA']}, UTMALDG {rec['UTMALDG']}, {epilogue}, "
            f"BAR.SYNC {rec['n_BAR']}, setmaxnreg {rec['setmaxnreg']}")


def _label(cfg, gemm):
    return cfg.swiglu_label() if gemm == "dh_swiglu" else cfg.label()


def offline(cases, names, out_dir, gemm="dx"):
    records = []
    print(f"{gemm} GEMM, offline sm_90 builds")
    print(f"{'case':<24} {'config':<10} {'tile':<32} {'smem':>7} {'maxreg':>6} {'LDL/STL':>7} {'local':>5}  sass")
    for case in cases:
        model, num_tokens = case.split(":")
        tensors, swiglu = _meta_case(model, int(num_tokens), gemm)
        for name in names:
            cfg = CONFIGS[name]
            rec = {"case": case, "gemm": gemm, "config": name, "tile": _label(cfg, gemm)}
            try:
                start = time.perf_counter()
                compiled = gdx.compile_offline(*tensors, cfg, gemm=gemm, swiglu=swiglu)
                rec.update(compile_s=round(time.perf_counter() - start, 2), **build_stats(compiled))
                print(f"{case:<24} {name:<10} {rec['tile']:<32} {_stats_line(rec, gemm)}", flush=True)
            except Exception as error:  # noqa: BLE001 - a config that does not build is reported, not fatal
                rec["error"] = f"{type(error).__name__}: {str(error)[:400]}"
                print(f"{case:<24} {name:<10} FAILED {rec['error']}", flush=True)
            records.append(rec)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"ab_moe_{gemm}_sm90_offline.json"), "w") as f:
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


def gpu_ab(cases, names, out_dir, rep, hang_s, fp32_ref, device=None, gemm="dx"):
    """The A/B on ``device`` (default cuda; the CPU with TRITON_INTERPRET=1 and stubs only exercises the code)."""
    device = device or torch.device("cuda")
    on_gpu = device.type == "cuda"
    start = time.perf_counter()
    report = {"gpu": torch.cuda.get_device_name() if on_gpu else str(device), "torch": torch.__version__,
              "gemm": gemm, "configs": {name: dataclasses.asdict(CONFIGS[name]) for name in names}, "cases": []}
    os.makedirs(out_dir, exist_ok=True)

    def write():
        with open(os.path.join(out_dir, f"ab_moe_{gemm}_sm90.json"), "w") as f:
            json.dump(report, f, indent=1)

    run_case = {"dx": _run_case, "dh": _run_dh_case, "dh_swiglu": _run_dh_swiglu_case}[gemm]
    for case_name in cases:
        case = run_case(case_name, names, rep, hang_s, fp32_ref, device, report, write)
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


def _fp32_dh(grad_out, w2, sort, valid):
    """dh's valid rows in float32 by torch (TF32 off): per expert, dout[tokens of its rows] @ w2[e]."""
    ids = sort.sorted_pair_ids.long()
    out = torch.zeros(ids.numel(), w2.shape[2], dtype=torch.float32, device=w2.device)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for e, (start, count) in enumerate(zip(sort.expert_row_start.tolist(), sort.expert_counts.tolist())):
            if count:
                rows = slice(start, start + count)
                out[rows] = grad_out[ids[rows] // sort.top_k].float() @ w2[e].float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return out[valid]


def _run_dh_case(case_name, names, rep, hang_s, fp32_ref, device, report, write):
    """``_run_case`` for dh: Triton dh_launch, torch._grouped_mm, the row gather alone, then per Gluon config the
    kernel alone and after the gather (see the module docstring)."""
    from flashmoe_science.bench import moe as bench_moe
    from flashmoe_science.moe import moe_route
    from flashmoe_science.moe import triton_gemm as tg
    from flashmoe_science.moe.dispatch import sort_pairs_by_expert
    from flashmoe_science.moe.tiles import choose_tiles

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, num_tokens = case_name.split(":")
    num_tokens = int(num_tokens)
    num_experts, top_k, d_model, d_ff = _dims(model)
    torch.manual_seed(0)
    x, w1, w2, logits = bench_moe._make_inputs(num_tokens, num_experts, d_model, d_ff, torch.bfloat16, device)
    del x, w1
    _, ids = moe_route(logits, top_k)
    grad_out = torch.randn(num_tokens, d_model, device=device).to(torch.bfloat16)
    pairs = num_tokens * top_k
    flops = 2.0 * pairs * d_model * d_ff
    tiles = choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, device)
    if tiles.block_m != gdx.BLOCK_M:
        print(f"{case_name}: the heuristic's block_m is {tiles.block_m}, the Gluon kernel needs {gdx.BLOCK_M}; "
              f"skipped", flush=True)
        return None
    sort = sort_pairs_by_expert(ids, num_experts, tiles.block_m)
    num_rows = sort.tile_expert.numel() * tiles.block_m
    valid = sort.sorted_pair_ids < sort.num_pairs
    counts = sort.expert_counts.tolist()
    used_tiles = sum(-(-c // tiles.block_m) for c in counts)
    case = {"case": case_name, "gemm": "dh", "T": num_tokens, "E": num_experts, "top_k": top_k, "d_model": d_model,
            "d_ff": d_ff, "pairs": pairs, "flops": flops, "row_tiles_used": used_tiles,
            "row_tiles_max": sort.tile_expert.numel(), "rows_per_expert": [min(counts), max(counts)],
            "triton_tiles": dataclasses.asdict(tiles.up_bwd), "runs": {}}
    report["cases"].append(case)
    print(f"== {case_name} dh: {pairs} pairs, {used_tiles}/{sort.tile_expert.numel()} row tiles used, rows per "
          f"expert {min(counts)}..{max(counts)}; Triton dh tiles n{tiles.up_bwd.block_n} k{tiles.up_bwd.block_k} "
          f"w{tiles.up_bwd.num_warps} s{tiles.up_bwd.num_stages}", flush=True)

    # the Triton kernel the library runs: the reference output (padding rows NaN: never written)
    dh_ref = torch.full((num_rows, d_ff), float("nan"), device=device)
    launch = tg.dh_launch(grad_out, w2, dh_ref, sort, tiles)
    launch()
    sync()
    ref = dh_ref[valid]
    del dh_ref
    case["triton_nan"] = bool(ref.isnan().any())
    ref32 = _fp32_dh(grad_out, w2, sort, valid) if fp32_ref else None
    if ref32 is not None:
        case["triton_err_vs_fp32"] = _rel_err(ref, ref32)
    ms = _bench(launch, rep)
    case["runs"]["triton"] = {"ms": ms, "tflops": flops / ms / 1e9}

    # torch._grouped_mm on dout's rows in expert order (gathered once, outside the timing; bf16 output)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)
    dout_s = grad_out[order // top_k]
    ms = _bench(lambda: torch._grouped_mm(dout_s, w2, offs=offs), rep)
    case["runs"]["grouped_mm"] = {"ms": ms, "tflops": flops / ms / 1e9}

    # the gathered copy the Gluon kernel reads, as moe_backward makes it
    dout_sorted = tg.sorted_rows(grad_out, None, sort, num_rows)
    gather = tg.gather_rows_launch(grad_out, dout_sorted, None, sort)
    ms = _bench(gather, rep)
    moved = 2 * (pairs + num_rows) * d_model * grad_out.element_size()  # ~: rows read (pairs) and written (rows)
    case["runs"]["gather"] = {"ms": ms, "GB/s": moved / ms / 1e6}
    write()
    dout_sorted[~valid] = float("nan")  # zeros from the gather: NaN shows a padding row reaching a valid one

    dh = torch.full((num_rows, d_ff), float("nan"), device=device)
    for name in names:
        cfg = CONFIGS[name]
        rec = {"tile": cfg.label()}
        case["runs"][name] = rec

        def run(cfg=cfg):
            return gdx.dh_sm90(dout_sorted, w2, dh, sort, tiles.block_m, cfg)

        def run_after_gather(cfg=cfg):
            gather()  # writes zeros into the padding rows again: outputs are checked before this runs
            return run(cfg)

        try:
            dh.fill_(float("nan"))
            faulthandler.dump_traceback_later(hang_s, exit=True)  # a deadlocked kernel ends the run
            kernel = run()
            sync()
            faulthandler.cancel_dump_traceback_later()
            out = dh[valid]
            rec.update(err_vs_triton=_rel_err(out, ref), identical=bool(torch.equal(out, ref)),
                       nan=bool(out.isnan().any()), padding_untouched=bool(dh[~valid].isnan().all()),
                       regs=getattr(kernel, "n_regs", None), spills=getattr(kernel, "n_spills", None),
                       smem=getattr(getattr(kernel, "metadata", None), "shared", None))
            if ref32 is not None:
                rec["err_vs_fp32"] = _rel_err(out, ref32)
            del out
            ms = _bench(run, rep)
            rec.update(ms=ms, tflops=flops / ms / 1e9)
            ms = _bench(run_after_gather, rep)
            case["runs"][f"{name}+gather"] = {"tile": cfg.label(), "ms": ms, "tflops": flops / ms / 1e9}
            dout_sorted[~valid] = float("nan")
        except Exception as error:  # noqa: BLE001 - a config that fails is reported, the others still run
            faulthandler.cancel_dump_traceback_later()
            rec["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        write()
        print(f"  {name:<8} " + (f"FAILED {rec['error']}" if "error" in rec else
                                 f"{rec['ms']:.4f} ms {rec['tflops']:6.1f} TFLOP/s (after the gather "
                                 f"{case['runs'][name + '+gather']['tflops']:6.1f}) err {rec['err_vs_triton']:.1e}"
                                 f" identical={rec['identical']} nan={rec['nan']} "
                                 f"padding_untouched={rec['padding_untouched']}"), flush=True)
    return case


def _swiglu_inputs(sort, num_tokens, top_k, d_ff, device):
    """The forward's saved gate_up and h (h = silu(gate) * up, rounded; NaN in the rows of no pair) and softmax
    routing weights (T, k) float32."""
    rows = sort.tile_expert.numel() * gdx.BLOCK_M
    valid = sort.sorted_pair_ids < sort.num_pairs
    gate_up = torch.randn(rows, 2 * d_ff, device=device).to(torch.bfloat16)
    gate, up = gate_up.float().chunk(2, dim=1)
    h = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    del gate, up
    gate_up[~valid] = float("nan")
    h[~valid] = float("nan")
    weights32 = torch.softmax(torch.randn(num_tokens, top_k, device=device), dim=1).contiguous()
    return gate_up, h, weights32


def _run_dh_swiglu_case(case_name, names, rep, hang_s, fp32_ref, device, report, write):
    """``_run_case`` for dh with the SwiGLU backward fused (see the module docstring). fp32_ref is unused: the
    reference is the Triton pair, checked against float64 by the GPU tests."""
    from flashmoe_science.bench import moe as bench_moe
    from flashmoe_science.moe import moe_route
    from flashmoe_science.moe import triton_gemm as tg
    from flashmoe_science.moe.dispatch import sort_pairs_by_expert
    from flashmoe_science.moe.tiles import choose_tiles

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, num_tokens = case_name.split(":")
    num_tokens = int(num_tokens)
    num_experts, top_k, d_model, d_ff = _dims(model)
    torch.manual_seed(0)
    _, _, w2, logits = bench_moe._make_inputs(num_tokens, num_experts, d_model, d_ff, torch.bfloat16, device)
    _, ids = moe_route(logits, top_k)
    grad_out = torch.randn(num_tokens, d_model, device=device).to(torch.bfloat16)
    pairs = num_tokens * top_k
    flops = 2.0 * pairs * d_model * d_ff
    tiles = choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, device)
    if tiles.block_m != gdx.BLOCK_M:
        print(f"{case_name}: the heuristic's block_m is {tiles.block_m}, the Gluon kernel needs {gdx.BLOCK_M}; "
              f"skipped", flush=True)
        return None
    sort = sort_pairs_by_expert(ids, num_experts, tiles.block_m)
    num_rows = sort.tile_expert.numel() * tiles.block_m
    valid = sort.sorted_pair_ids < sort.num_pairs
    used = sort.tile_expert.long()[torch.arange(num_rows, device=device) // tiles.block_m] >= 0
    counts = sort.expert_counts.tolist()
    used_tiles = sum(-(-c // tiles.block_m) for c in counts)
    gate_up, h, weights32 = _swiglu_inputs(sort, num_tokens, top_k, d_ff, device)
    case = {"case": case_name, "gemm": "dh_swiglu", "T": num_tokens, "E": num_experts, "top_k": top_k,
            "d_model": d_model, "d_ff": d_ff, "pairs": pairs, "flops": flops, "row_tiles_used": used_tiles,
            "row_tiles_max": sort.tile_expert.numel(), "rows_per_expert": [min(counts), max(counts)],
            "triton_tiles": dataclasses.asdict(tiles.up_bwd), "runs": {}}
    report["cases"].append(case)
    print(f"== {case_name} dh+swiglu: {pairs} pairs, {used_tiles}/{sort.tile_expert.numel()} row tiles used, rows "
          f"per expert {min(counts)}..{max(counts)}; Triton dh tiles n{tiles.up_bwd.block_n} k{tiles.up_bwd.block_k} "
          f"w{tiles.up_bwd.num_warps} s{tiles.up_bwd.num_stages}", flush=True)

    # what the fused kernel replaces: the reference outputs (padding rows of dh: NaN, never written)
    dh = torch.full((num_rows, d_ff), float("nan"), device=device)
    ref = torch.full((num_rows, 2 * d_ff), float("nan"), device=device, dtype=torch.bfloat16)
    ref_dscale = torch.zeros(num_tokens, top_k, device=device)
    dh_launch = tg.dh_launch(grad_out, w2, dh, sort, tiles)
    swiglu_launch = tg.swiglu_backward_launch(gate_up, dh, h, weights32, ref, ref_dscale, sort)
    dh_launch()
    swiglu_launch()
    sync()
    case["triton_nan"] = bool(ref[valid].isnan().any())
    ms = _bench(dh_launch, rep)
    case["runs"]["triton dh"] = {"ms": ms, "tflops": flops / ms / 1e9}
    ms = _bench(swiglu_launch, rep)
    moved = pairs * d_ff * (2 * 2 + 4 + 2 + 2 * 2)  # gate_up, dh (float32), h read; d(gate, up) written
    case["runs"]["triton swiglu"] = {"ms": ms, "GB/s": moved / ms / 1e6}

    def triton_pair():
        dh_launch()
        swiglu_launch()

    ms = _bench(triton_pair, rep)
    case["runs"]["triton dh+swiglu"] = {"ms": ms, "tflops": flops / ms / 1e9}
    del dh

    # the row gather the Gluon kernel's A needs, as moe_backward makes it
    dout_sorted = tg.sorted_rows(grad_out, None, sort, num_rows)
    gather = tg.gather_rows_launch(grad_out, dout_sorted, None, sort)
    ms = _bench(gather, rep)
    moved = 2 * (pairs + num_rows) * d_model * grad_out.element_size()  # ~: rows read (pairs) and written (rows)
    case["runs"]["gather"] = {"ms": ms, "GB/s": moved / ms / 1e6}
    write()
    dout_sorted[~valid] = float("nan")  # zeros from the gather: NaN shows a padding row reaching a valid one

    dgu = torch.empty(num_rows, 2 * d_ff, device=device, dtype=torch.bfloat16)
    dscale = torch.zeros(num_tokens, top_k, device=device)
    swiglu = SwigluOperands(gate_up, h, weights32, dscale)
    dh_plain = torch.empty(num_rows, d_ff, device=device)
    ref_valid = ref[valid].float()
    for name in names:
        cfg = CONFIGS[name]
        rec = {"tile": cfg.swiglu_label()}
        case["runs"][name] = rec

        def run(cfg=cfg):
            return gdx.dh_swiglu_sm90(dout_sorted, w2, dgu, swiglu, sort, tiles.block_m, cfg)

        def run_after_gather(cfg=cfg):
            gather()  # writes zeros into the padding rows again: outputs are checked before this runs
            return run(cfg)

        try:
            dgu.fill_(float("nan"))
            dscale.zero_()
            faulthandler.dump_traceback_later(hang_s, exit=True)  # a deadlocked kernel ends the run
            kernel = run()
            sync()
            faulthandler.cancel_dump_traceback_later()
            ours = dgu[valid].float()
            diff = (ours - ref_valid).abs()
            rec.update(err_vs_triton=(diff.max() / ref_valid.abs().max()).item(),
                       not_identical=(diff > 0).float().mean().item(), nan=bool(ours.isnan().any()),
                       dscale_err=_rel_err(dscale, ref_dscale),
                       padding_zero=bool(torch.all(dgu[used & ~valid] == 0)),
                       unused_untouched=bool(dgu[~used].isnan().all()))
            del ours, diff
            try:
                rec.update(build_stats(kernel))
            except Exception as error:  # noqa: BLE001 - no cuobjdump: the timings still count
                rec["build_error"] = f"{type(error).__name__}: {str(error)[:200]}"
            ms = _bench(run, rep)
            rec.update(ms=ms, tflops=flops / ms / 1e9)
            ms = _bench(run_after_gather, rep)
            case["runs"][f"{name}+gather"] = {"tile": cfg.swiglu_label(), "ms": ms, "tflops": flops / ms / 1e9}
            dout_sorted[~valid] = float("nan")
            # the same tile's plain dh (row store): what the SwiGLU epilogue costs on top of the GEMM
            ms = _bench(lambda cfg=cfg: gdx.dh_sm90(dout_sorted, w2, dh_plain, sort, tiles.block_m, cfg), rep)
            case["runs"][f"{name} dh"] = {"tile": cfg.label(), "ms": ms, "tflops": flops / ms / 1e9}
        except Exception as error:  # noqa: BLE001 - a config that fails is reported, the others still run
            faulthandler.cancel_dump_traceback_later()
            rec["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        write()
        if "error" in rec:
            print(f"  {name:<10} FAILED {rec['error']}", flush=True)
            continue
        print(f"  {name:<10} {rec['ms']:.4f} ms (after the gather {case['runs'][name + '+gather']['ms']:.4f}, plain dh "
              f"{case['runs'][name + ' dh']['ms']:.4f}) dgu err {rec['err_vs_triton']:.1e} not identical "
              f"{rec['not_identical']:.1e} dscale err {rec['dscale_err']:.1e} nan={rec['nan']} "
              f"padding_zero={rec['padding_zero']} unused_untouched={rec['unused_untouched']}", flush=True)
        if "build_error" not in rec:
            print(f"  {'':<10} build: {_stats_line(rec, 'dh_swiglu')}", flush=True)
    return case


def _print_table(case):
    runs = case["runs"]
    gemm = case.get("gemm", "dx")
    base = runs["grouped_mm"]["tflops"] if "grouped_mm" in runs else None
    tri = runs["triton dh+swiglu" if gemm == "dh_swiglu" else "triton"]["tflops"]
    triton_tile = "n{block_n} k{block_k} w{num_warps} s{num_stages}".format(**case["triton_tiles"])
    factor = 4 if gemm == "dx" else 2
    print(f"\n{case['case']} {gemm}  (FLOPs = {factor}*pairs*d*F = {case['flops'] / 1e12:.2f} T)")
    print(f"  {'kernel':<20} {'tile':<32} {'ms':>8} {'TFLOP/s':>8} {'x gmm':>6} {'x triton':>8} {'err/triton':>10} "
          f"{'err/fp32':>9}")
    for name, r in runs.items():
        tile = triton_tile if name.startswith("triton") and "tile" not in r else r.get("tile", "")
        if "ms" not in r:
            print(f"  {name:<20} {tile:<32} {r.get('error', 'no time')}")
            continue
        if "tflops" not in r:  # a copy or an elementwise pass, in GB/s
            print(f"  {name:<20} {tile:<32} {r['ms']:8.4f} {r['GB/s']:6.0f} GB/s")
            continue
        err = f"{r['err_vs_triton']:10.1e}" if "err_vs_triton" in r else f"{'':>10}"
        e32 = case.get("triton_err_vs_fp32") if name == "triton" else r.get("err_vs_fp32")
        e32 = f"{e32:9.1e}" if e32 is not None else f"{'':>9}"
        x_gmm = f"{r['tflops'] / base:6.3f}" if base else f"{'':>6}"
        print(f"  {name:<20} {tile:<32} {r['ms']:8.4f} {r['tflops']:8.1f} {x_gmm} {r['tflops'] / tri:8.3f} {err} {e32}")
    if gemm == "dh_swiglu":
        fused = {n: r["ms"] for n, r in runs.items() if n.endswith("+gather") and "ms" in r}
        if fused:
            best = min(fused, key=fused.get)
            triton_ms = runs["triton dh+swiglu"]["ms"]
            print(f"  summary: Triton dh + swiglu {triton_ms:.4f} ms; fused + gather, best {best}: "
                  f"{fused[best]:.4f} ms ({triton_ms - fused[best]:+.4f} ms saved, x{triton_ms / fused[best]:.3f})")
    print(flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="")
    parser.add_argument("--offline", action="store_true", help="sm_90 builds and SASS counts only (no GPU needed)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of model:T")
    parser.add_argument("--gemm", choices=("dx", "dh", "dh_swiglu"), default="dx",
                        help="which product of the kernel (dh_swiglu: dh with the SwiGLU backward in its epilogue)")
    parser.add_argument("--configs", default="",
                        help=f"comma list of {list(CONFIGS)} (default: {DEFAULT_CONFIGS})")
    parser.add_argument("--rep", type=int, default=40, help="do_bench rep (ms of timed calls per measurement)")
    parser.add_argument("--hang-s", type=float, default=60.0, help="a first launch taking longer ends the run")
    parser.add_argument("--no-fp32-ref", action="store_true", help="skip the float32 torch reference")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    names = [n for n in args.configs.split(",") if n] or DEFAULT_CONFIGS[args.gemm]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    if args.offline:
        offline(cases, names, args.out, args.gemm)
        return
    if not torch.cuda.is_available():
        sys.exit("no GPU: use --offline for the sm_90 builds")
    gpu_ab(cases, names, args.out or ".", args.rep, args.hang_s, not args.no_fp32_ref, gemm=args.gemm)


if __name__ == "__main__":
    main()
