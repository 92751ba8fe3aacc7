"""A/B of the MoE layer's backward with each dx tile config (moe/hopper/dx_sm90.py ``MEASURED_CONFIG`` swapped in
turn), beside the torch._grouped_mm pipeline's backward: what bench moe's backward record measures (autograd of
``fused_moe``, do_bench median), in interleaved rounds so that clock drift hits every config alike.

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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="mixtral-8x7b:4096")
    parser.add_argument("--configs", default="n128s4p,n128s4pt,n256s4t")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device("cuda")
    names = args.configs.split(",")
    default = gdx.MEASURED_CONFIG
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for case in args.cases.split(","):
        model, num_tokens = case.split(":")
        shape = bench_moe.MODELS[model]
        torch.manual_seed(0)
        tensors = bench_moe._make_inputs(int(num_tokens), shape["num_experts"], shape["d_model"], shape["d_ff"],
                                         torch.bfloat16, device)
        times = {name: [] for name in ["torch-grouped-mm", *names]}
        for _ in range(args.rounds):
            times["torch-grouped-mm"].append(bench_moe._measure("torch-grouped-mm", "bwd", tensors,
                                                                shape["top_k"], device))
            for name in names:
                gdx.MEASURED_CONFIG = CONFIGS[name]
                try:
                    times[name].append(bench_moe._measure("flashmoe", "bwd", tensors, shape["top_k"], device))
                finally:
                    gdx.MEASURED_CONFIG = default
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians["torch-grouped-mm"]
        report["cases"][case] = {"ms": times, "median_ms": medians}
        print(f"== {case} backward, medians of {args.rounds} rounds (ms; x grouped_mm)", flush=True)
        for name, ms in medians.items():
            label = CONFIGS[name].label() if name in CONFIGS else ""
            print(f"  {name:<18} {label:<40} {ms:8.3f}  x{base / ms:.3f}  rounds {['%.3f' % t for t in times[name]]}",
                  flush=True)
    if args.out:
        with open(os.path.join(args.out, "ab-moe-layer-dx.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
