"""A/B of the MoE layer's backward with each dx tile config (moe/hopper/dx_sm90.py ``dx_config`` swapped in
turn), beside the torch._grouped_mm pipeline's backward: what bench moe's backward record measures (autograd of
``fused_moe``, do_bench median), in interleaved rounds so that clock drift hits every config alike. With
``--kernel``, each round also times the dx kernel alone per config (``dx_sm90`` on the layer's routing, random
d(gate, up); do_bench median, L2 flushed), in the same interleaved order.

    PYTHONPATH=src:scripts python scripts/ab_moe_layer_dx.py [--cases mixtral-8x7b:4096] [--configs n128s4p,n256s4t]
        [--rounds 3] [--out $OUT]

Config names are scripts/ab_moe_dx_sm90.py's. Prints, per case, each config's median over the rounds and its ratio
to grouped_mm's median; writes ab-moe-layer-dx.json under --out.
"""

import argparse
import json
import os
import statistics

import torch

from ab_moe_dx_sm90 import CONFIGS
from flashmoe_science.bench import moe as bench_moe
from flashmoe_science.moe.hopper import dx_sm90 as gdx


def _dx_kernel_case(tensors, shape):
    """A function config -> median ms of dx_sm90 alone on these inputs' routing (random d(gate, up))."""
    import triton.testing

    from flashmoe_science.moe import moe_route
    from flashmoe_science.moe.dispatch import sort_pairs_by_expert

    x, w1, _, logits = tensors
    _, ids = moe_route(logits, shape["top_k"])
    sort = sort_pairs_by_expert(ids, shape["num_experts"], gdx.BLOCK_M)
    dgu = torch.randn(sort.tile_expert.numel() * gdx.BLOCK_M, w1.shape[1], device=x.device).to(w1.dtype)
    dx32 = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

    def run(config):
        return triton.testing.do_bench(lambda: gdx.dx_sm90(dgu, w1, dx32, sort, gdx.BLOCK_M, config), warmup=25,
                                       rep=100, return_mode="median")
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="mixtral-8x7b:4096")
    parser.add_argument("--configs", default="n128s4p,n128s4pt,n256s4t")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kernel", action="store_true", help="also time the dx kernel alone per config")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device("cuda")
    names = args.configs.split(",")
    default = gdx.dx_config
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for case in args.cases.split(","):
        model, num_tokens = case.split(":")
        shape = bench_moe.MODELS[model]
        torch.manual_seed(0)
        tensors = bench_moe._make_inputs(int(num_tokens), shape["num_experts"], shape["d_model"], shape["d_ff"],
                                         torch.bfloat16, device)
        times = {name: [] for name in ["torch-grouped-mm", *names]}
        kernel_times = {name: [] for name in names}
        if args.kernel:
            dx_kernel = _dx_kernel_case(tensors, shape)
        for _ in range(args.rounds):
            if args.kernel:
                for name in names:
                    kernel_times[name].append(dx_kernel(CONFIGS[name]))
            times["torch-grouped-mm"].append(bench_moe._measure("torch-grouped-mm", "bwd", tensors,
                                                                shape["top_k"], device))
            for name in names:
                gdx.dx_config = lambda two_d_ff, config=CONFIGS[name]: config
                try:
                    times[name].append(bench_moe._measure("flashmoe", "bwd", tensors, shape["top_k"], device))
                finally:
                    gdx.dx_config = default
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians["torch-grouped-mm"]
        report["cases"][case] = {"ms": times, "median_ms": medians, "dx_kernel_ms": kernel_times}
        print(f"== {case} backward, medians of {args.rounds} rounds (ms; x grouped_mm)", flush=True)
        for name, ms in medians.items():
            label = CONFIGS[name].label() if name in CONFIGS else ""
            print(f"  {name:<18} {label:<40} {ms:8.3f}  x{base / ms:.3f}  rounds {['%.3f' % t for t in times[name]]}",
                  flush=True)
        if args.kernel:
            flops = 4.0 * int(num_tokens) * shape["top_k"] * shape["d_model"] * shape["d_ff"]
            print(f"   dx kernel alone, medians of {args.rounds} rounds (ms, TFLOP/s)")
            for name, t in kernel_times.items():
                ms = statistics.median(t)
                print(f"  {name:<18} {CONFIGS[name].label():<40} {ms:8.4f} {flops / ms / 1e9:7.1f}  rounds "
                      f"{['%.4f' % v for v in t]}", flush=True)
    if args.out:
        with open(os.path.join(args.out, "ab-moe-layer-dx.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
