"""A/B of the forward's down GEMM, ``out32[token] += weight * h[row] @ w2[e].T``: Triton's ``_down_combine_kernel``
(``triton_gemm.down_forward_launch`` at ``choose_tiles``' tiles) against dx_sm90's Gluon kernel in its DOWN mode
(``down_sm90``) per tile config, the kernel alone; then the layer's forward (``fused_moe`` without grad, as bench
moe times it) with each down beside the torch._grouped_mm pipeline. Interleaved rounds (runs in sequence are not
comparable on this GPU, docs/perf-notes.md session 15); the layer in sustained windows (``--warmup`` ms of
back-to-back calls first: the layer runs at the 700 W cap).

    PYTHONPATH=src:scripts python scripts/ab_moe_down_sm90.py [--cases mixtral-8x7b:4096,qwen3-30b-a3b:4096]
        [--configs n256s3t,n128s4p] [--rounds 3] [--warmup 1000] [--out $OUT]

Config names are scripts/ab_moe_dx_sm90.py's CONFIGS. Prints per case the kernel's medians (ms, TFLOP/s, error
against Triton's output relative to its largest value) and the layer's (ms, x grouped_mm).
"""

import argparse
import json
import os
import statistics

import torch
import triton.testing

from ab_moe_dx_sm90 import CONFIGS
from flashmoe_science.bench import moe as bench_moe
from flashmoe_science.moe import api as moe_api
from flashmoe_science.moe import moe_route, triton_gemm
from flashmoe_science.moe.dispatch import sort_pairs_by_expert
from flashmoe_science.moe.hopper import dx_sm90 as gdx
from flashmoe_science.moe.tiles import choose_tiles


def _kernel_case(tensors, shape):
    """(functions name -> () of the down GEMM alone on this routing (random h, NaN in padding rows), the output
    buffer, the Triton reference output)."""
    x, _, w2, logits = tensors
    weights, ids = moe_route(logits, shape["top_k"])
    weights32 = weights.float().contiguous()
    tiles = choose_tiles(x.shape[0], shape["top_k"], shape["num_experts"], shape["d_model"], shape["d_ff"], x.device)
    sort = sort_pairs_by_expert(ids, shape["num_experts"], tiles.block_m)
    h = torch.randn(sort.tile_expert.numel() * tiles.block_m, shape["d_ff"], device=x.device).to(w2.dtype)
    h[sort.sorted_pair_ids >= sort.num_pairs] = float("nan")  # never reaches the output
    out32 = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    triton_launch = triton_gemm.down_forward_launch(h, w2, out32, weights32, sort, tiles)
    fns = {"triton": triton_launch}
    for name, config in CONFIGS.items():
        fns[name] = (lambda config=config: gdx.down_sm90(h, w2, out32, weights32, sort, tiles.block_m, config))
    triton_launch()
    torch.cuda.synchronize()
    return fns, out32, out32.clone(), tiles.block_m


def _forward_with(down, tensors, top_k, warmup):
    """bench moe's forward of fused_moe (no grad) with the down GEMM forced to ``down`` ("gluon" or "triton"),
    do_bench median after ``warmup`` ms of back-to-back calls."""
    hopper_down = triton_gemm._hopper_down
    if down == "triton":
        triton_gemm._hopper_down = lambda *args: False
    moe_api._PREPARED.clear()  # a prepared forward keeps the down launch it was built with
    try:
        layer = bench_moe._layer("flashmoe")
        with torch.no_grad():
            return triton.testing.do_bench(lambda: layer(*tensors, top_k), warmup=warmup, rep=500,
                                           return_mode="median")
    finally:
        triton_gemm._hopper_down = hopper_down
        moe_api._PREPARED.clear()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="mixtral-8x7b:4096,mixtral-8x7b:16384,qwen3-30b-a3b:4096")
    parser.add_argument("--configs", default="n256s3t,n256s4t,n128s4p,n128s4pt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1000, help="ms of back-to-back layer calls before timing")
    parser.add_argument("--no-layer", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device("cuda")
    names = args.configs.split(",")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for case in args.cases.split(","):
        model, num_tokens = case.split(":")
        shape = bench_moe.MODELS[model]
        torch.manual_seed(0)
        tensors = bench_moe._make_inputs(int(num_tokens), shape["num_experts"], shape["d_model"], shape["d_ff"],
                                         torch.bfloat16, device)
        flops = 2.0 * int(num_tokens) * shape["top_k"] * shape["d_model"] * shape["d_ff"]
        fns, out32, ref, block_m = _kernel_case(tensors, shape)
        errors = {}
        if block_m == gdx.BLOCK_M:
            for name in names:
                out32.zero_()
                fns[name]()
                torch.cuda.synchronize()
                errors[name] = ((out32 - ref).abs().max() / ref.abs().max()).item()
        else:
            print(f"{case}: block_m {block_m}: the Gluon kernel does not run here", flush=True)
        names_here = names if block_m == gdx.BLOCK_M else []
        kernel_ms = {name: [] for name in ["triton", *names_here]}
        layers = ["torch-grouped-mm", "gluon", "triton"] if not args.no_layer else []
        layer_ms = {name: [] for name in layers}
        for _ in range(args.rounds):
            for name in kernel_ms:
                kernel_ms[name].append(triton.testing.do_bench(fns[name], warmup=25, rep=200, return_mode="median"))
            for name in layers:
                if name == "torch-grouped-mm":
                    layer = bench_moe._layer(name)
                    with torch.no_grad():
                        ms = triton.testing.do_bench(lambda: layer(*tensors, shape["top_k"]), warmup=args.warmup,
                                                     rep=500, return_mode="median")
                else:
                    ms = _forward_with(name, tensors, shape["top_k"], args.warmup)
                layer_ms[name].append(ms)
        report["cases"][case] = {"kernel_ms": kernel_ms, "err_vs_triton": errors, "layer_fwd_ms": layer_ms}
        print(f"== {case} down GEMM alone, medians of {args.rounds} interleaved rounds (ms, TFLOP/s)", flush=True)
        for name, t in kernel_ms.items():
            ms = statistics.median(t)
            label = CONFIGS[name].label() if name in CONFIGS else "triton_gemm.down_forward_launch"
            err = f"err {errors[name]:.1e}" if name in errors else ""
            print(f"  {name:<10} {label:<36} {ms:8.4f} {flops / ms / 1e9:7.1f}  {err}  rounds "
                  f"{['%.4f' % v for v in t]}", flush=True)
        if layers:
            base = statistics.median(layer_ms["torch-grouped-mm"])
            print(f"   layer forward (fused_moe, no grad; {args.warmup} ms warm-up), x grouped_mm", flush=True)
            for name, t in layer_ms.items():
                ms = statistics.median(t)
                print(f"  {name:<18} {ms:8.3f}  x{base / ms:.3f}  rounds {['%.3f' % v for v in t]}", flush=True)
        del fns, out32, ref, tensors
        torch.cuda.empty_cache()
    if args.out:
        with open(os.path.join(args.out, "ab-moe-down-sm90.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
