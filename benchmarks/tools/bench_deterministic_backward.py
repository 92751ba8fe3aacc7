"""The attention backward with and without determinism, side by side on one GPU: `flash_attention_science(...,
deterministic=True)` against the default, per FA3-grid shape (B·L = 16384, H·D = 2048), causal and not; the backward
alone (autograd.grad on a retained graph, triton.testing.do_bench median). Prints a table (ms, TFLOP/s at
2.5 x the forward's FLOPs, deterministic / default) and writes JSON to --out. `--compare OLD.json`: after the run,
each row's default and deterministic times beside another tree's run of the same shapes (that tree's `--out`, e.g.
the previous commit's sources on PYTHONPATH), as new / old.

    PYTHONPATH=src python benchmarks/tools/bench_deterministic_backward.py [--dims 64,128,256] [--lengths 1024,4096,16384]
"""
import argparse
import json

import torch
import triton

from flashmoe_science import flash_attention_science
from flashmoe_science.attention.record import recording


def backward_ms(q, k, v, grad, causal, deterministic):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention_science(*leaves, causal=causal, deterministic=deterministic)
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True), warmup=50,
                                   rep=200)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--out", default="deterministic_backward.json")
    parser.add_argument("--compare", default=None, help="another run's --out JSON: print new / old per row")
    args = parser.parse_args()
    records = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'shape':28s} {'causal':6s} {'default ms':>10s} {'determ. ms':>10s} {'ratio':>6s}  deterministic kernels")
    for d in map(int, args.dims.split(",")):
        for length in map(int, args.lengths.split(",")):
            b, h = 16384 // length, 2048 // d
            q, k, v, grad = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            for causal in (False, True):
                default = backward_ms(q, k, v, grad, causal, False)
                determ = backward_ms(q, k, v, grad, causal, True)
                flops = 2.5 * 4 * b * h * length * length * d / (2 if causal else 1)
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                with recording() as log:
                    torch.autograd.grad(flash_attention_science(*leaves, causal=causal, deterministic=True), leaves,
                                        grad)
                kernels = ", ".join(f"{b}:{kern}" for direction, b, kern in log if direction == "backward")
                shape = f"B{b} H{h} L{length} D{d}"
                print(f"{shape:28s} {str(causal):6s} {default:10.3f} {determ:10.3f} {determ / default:6.2f}  {kernels[:70]}",
                      flush=True)
                records.append({"op": "attention", "pass": "bwd", "shape": shape, "causal": causal, "dtype": "bf16",
                                "default_ms": default, "deterministic_ms": determ,
                                "default_tflops": flops / default / 1e9, "deterministic_tflops": flops / determ / 1e9,
                                "gpu": torch.cuda.get_device_name()})
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    if args.compare:
        compare(records, args.compare)


def compare(records, old_path):
    """Each row's times beside the same row of another run (`old_path`): ms old -> new and new / old."""
    with open(old_path) as f:
        old = {(r["shape"], r["causal"]): r for r in json.load(f)}
    print(f"\n{'shape':28s} {'causal':6s} {'default old -> new ms':>24s} {'new/old':>7s} "
          f"{'determ. old -> new ms':>24s} {'new/old':>7s} {'determ/default new':>18s}")
    for r in records:
        o = old.get((r["shape"], r["causal"]))
        if o is None:
            continue
        print(f"{r['shape']:28s} {str(r['causal']):6s} {o['default_ms']:11.3f} -> {r['default_ms']:8.3f} "
              f"{r['default_ms'] / o['default_ms']:7.3f} {o['deterministic_ms']:11.3f} -> "
              f"{r['deterministic_ms']:8.3f} {r['deterministic_ms'] / o['deterministic_ms']:7.3f} "
              f"{r['deterministic_ms'] / r['default_ms']:18.3f}")


if __name__ == "__main__":
    main()
