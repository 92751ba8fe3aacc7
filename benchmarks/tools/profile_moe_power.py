"""SM clock and board power while the MoE layer's backward runs back to back (flashmoe and the torch._grouped_mm
pipeline, as bench moe calls them), sampled by nvidia-smi every 50 ms: is the layer power-limited, and at what
clock does each backend run?

    PYTHONPATH=src python benchmarks/tools/profile_moe_power.py [--case mixtral-8x7b:4096] [--seconds 4]
"""

import argparse
import statistics
import subprocess
import time

import torch

from flashmoe_science.bench import moe as bench_moe

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def sample_while(fn, seconds):
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    start = time.time()
    calls = 0
    while time.time() - start < seconds:
        fn()
        calls += 1
    torch.cuda.synchronize()
    elapsed = time.time() - start
    smi.terminate()
    rows = [line.split(", ") for line in smi.communicate()[0].strip().splitlines()]
    rows = rows[len(rows) // 4:]  # past the ramp
    clock = statistics.median(float(r[0]) for r in rows)
    power = statistics.median(float(r[1]) for r in rows)
    temp = statistics.median(float(r[2]) for r in rows)
    reasons = sorted({r[3] for r in rows})
    return elapsed / calls * 1e3, clock, power, temp, reasons


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="mixtral-8x7b:4096")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    model, num_tokens = args.case.split(":")
    shape = bench_moe.MODELS[model]
    torch.manual_seed(0)
    tensors = bench_moe._make_inputs(int(num_tokens), shape["num_experts"], shape["d_model"], shape["d_ff"],
                                     torch.bfloat16, torch.device("cuda"))
    for backend in ("flashmoe", "torch-grouped-mm", "flashmoe", "torch-grouped-mm"):
        leaves = [t.detach().requires_grad_() for t in tensors]
        out = bench_moe._layer(backend)(*leaves, shape["top_k"])
        grad_out = torch.randn_like(out)
        ms, clock, power, temp, reasons = sample_while(
            lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True), args.seconds)
        print(f"{args.case} bwd {backend:<17} {ms:7.3f} ms/call back to back; SM clock {clock:.0f} MHz, "
              f"{power:.0f} W, {temp:.0f} C, throttle reasons {reasons}", flush=True)


if __name__ == "__main__":
    main()
