"""A/B of the MoE layer's backward with each variant of its Gluon GEMMs' tile configs swapped in turn (dx:
moe/hopper/dx_sm90.py ``dx_config``; wgrad: moe/hopper/wgrad_sm90.py ``MEASURED_CONFIG``), beside the torch._grouped_mm pipeline's backward: what bench moe's backward record measures (autograd of
``fused_moe``, do_bench median), in interleaved rounds so that clock drift hits every config alike. With
``--kernel``, each round also times the dx kernel alone per config (``dx_sm90`` on the layer's routing, random
d(gate, up); do_bench median, L2 flushed), in the same interleaved order.

    PYTHONPATH=src:scripts python scripts/ab_moe_layer_bwd.py [--cases mixtral-8x7b:4096]
        [--configs n128s4p,n256s4t,wgrad:n128s6pe2,dx:n256s3t+wgrad:n256s4e2] [--rounds 3] [--kernel] [--out $OUT]

A variant is "+"-joined parts "dx:NAME" (scripts/ab_moe_dx_sm90.py's CONFIGS) or "wgrad:NAME"
(scripts/ab_moe_wgrad_sm90.py's); a bare NAME is "dx:NAME"; what a variant does not name stays the library's.
Prints, per case, each variant's median over the rounds and its ratio to grouped_mm's median; writes
ab-moe-layer-bwd.json under --out. ``--kernel`` times the dx config of each variant that names one.
"""

import argparse
import json
import os
import statistics

import torch

from ab_moe_dx_sm90 import CONFIGS
from ab_moe_wgrad_sm90 import CONFIGS as WGRAD_CONFIGS
from flashmoe_science.bench import moe as bench_moe
from flashmoe_science.moe.hopper import dx_sm90 as gdx
from flashmoe_science.moe.hopper import wgrad_sm90


def _parse(variant):
    """variant name -> {"dx": DxConfig, "wgrad": WgradConfig} (the parts it names)."""
    parts = {}
    for part in variant.split("+"):
        kind, _, name = part.rpartition(":")
        kind = kind or "dx"
        parts[kind] = (CONFIGS if kind == "dx" else WGRAD_CONFIGS)[name]
    return parts


def _label(variant):
    return " + ".join(f"{kind} {config.label()}" for kind, config in _parse(variant).items())


def _swapped(variant, fn):
    """fn() with the variant's configs in place of the library's."""
    parts = _parse(variant)
    dx_default, wgrad_default = gdx.dx_config, wgrad_sm90.MEASURED_CONFIG
    if "dx" in parts:
        gdx.dx_config = lambda two_d_ff, config=parts["dx"]: config
    if "wgrad" in parts:
        wgrad_sm90.MEASURED_CONFIG = parts["wgrad"]
    try:
        return fn()
    finally:
        gdx.dx_config, wgrad_sm90.MEASURED_CONFIG = dx_default, wgrad_default


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
    parser.add_argument("--configs", default="n128s4p,n256s3t")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kernel", action="store_true", help="also time the dx kernel alone per config")
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
        times = {name: [] for name in ["torch-grouped-mm", *names]}
        kernel_times = {name: [] for name in names}
        if args.kernel:
            dx_kernel = _dx_kernel_case(tensors, shape)
        for _ in range(args.rounds):
            if args.kernel:
                for name in names:
                    if "dx" in _parse(name):
                        kernel_times[name].append(dx_kernel(_parse(name)["dx"]))
            times["torch-grouped-mm"].append(bench_moe._measure("torch-grouped-mm", "bwd", tensors,
                                                                shape["top_k"], device))
            for name in names:
                times[name].append(_swapped(name, lambda: bench_moe._measure("flashmoe", "bwd", tensors,
                                                                             shape["top_k"], device)))
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians["torch-grouped-mm"]
        report["cases"][case] = {"ms": times, "median_ms": medians, "dx_kernel_ms": kernel_times}
        print(f"== {case} backward, medians of {args.rounds} rounds (ms; x grouped_mm)", flush=True)
        for name, ms in medians.items():
            label = _label(name) if name != "torch-grouped-mm" else ""
            print(f"  {name:<18} {label:<40} {ms:8.3f}  x{base / ms:.3f}  rounds {['%.3f' % t for t in times[name]]}",
                  flush=True)
        if args.kernel:
            flops = 4.0 * int(num_tokens) * shape["top_k"] * shape["d_model"] * shape["d_ff"]
            print(f"   dx kernel alone, medians of {args.rounds} rounds (ms, TFLOP/s)")
            for name, t in kernel_times.items():
                if not t:
                    continue
                ms = statistics.median(t)
                print(f"  {name:<18} {_parse(name)['dx'].label():<40} {ms:8.4f} {flops / ms / 1e9:7.1f}  rounds "
                      f"{['%.4f' % v for v in t]}", flush=True)
    if args.out:
        with open(os.path.join(args.out, "ab-moe-layer-bwd.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
