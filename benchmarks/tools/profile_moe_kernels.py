"""Per-kernel GPU time of the MoE layer (torch.profiler), and the layer's GPU-only time under a CUDA graph.

Usage: PYTHONPATH=src python benchmarks/tools/profile_moe_kernels.py [--tokens 1,16,4096] [--models mixtral-8x7b,...]
Prints, per (model, T, pass), each kernel's mean device time per call and the sum, beside do_bench's median of
the eager call (which includes host time when the host is slower than the GPU) and of a CUDA-graph replay.
"""

import argparse
from collections import defaultdict

import torch
import triton

from flashmoe_science.bench.moe import MODELS, _graph_median_ms, expert_gemm_flops
from flashmoe_science.moe import fused_moe

ITERS = 20


def kernel_times(fn):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            fn()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    per_call = defaultdict(int)
    for ev in events:
        per_call[ev.name] += 1
    # a kernel launched several times per call (the Gluon GEMMs) is reported per launch in call order ("#i")
    totals = defaultdict(float)
    seen = defaultdict(int)
    for ev in events:
        n = per_call[ev.name] // ITERS
        label = ev.name if n <= 1 else f"{ev.name} #{seen[ev.name] % n}"
        seen[ev.name] += 1
        totals[label] += ev.device_time_total
    return {k: (v / ITERS, 1) for k, v in totals.items()}


def profile_case(model, k, d, F, w1, w2, T):
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(T, w1.shape[0], device="cuda", dtype=torch.float32)
    ids = torch.topk(logits, k, dim=-1).indices
    experts_used = torch.unique(ids).numel()
    weight_bytes = experts_used * 3 * d * F * 2

    def fwd():
        return fused_moe(x, w1, w2, logits, k)

    eager = triton.testing.do_bench(fwd)
    try:
        graph = _graph_median_ms(fwd)
    except Exception as e:  # noqa: BLE001
        graph = float("nan")
        print("graph capture failed:", type(e).__name__, e)
    kt = kernel_times(fwd)
    total = sum(v for v, _ in kt.values()) / 1e3
    print(f"\n== {model} T={T} fwd: eager {eager:.4f} ms, graph {graph:.4f} ms, kernels sum {total:.4f} ms; "
          f"experts used {experts_used}, weight read bound {weight_bytes / 4.3e12 * 1e3:.4f} ms "
          f"(graph at {weight_bytes / graph / 1e6:.0f} GB/s); "
          f"{expert_gemm_flops(T, k, d, F, 'fwd') / eager / 1e9:.1f} TFLOP/s eager")
    for name, (us, n) in sorted(kt.items(), key=lambda kv: -kv[1][0]):
        print(f"  {us:9.1f} us  x{n:.0f}  {name[:110]}")

    xg = x.detach().requires_grad_()
    w1g = w1.detach().requires_grad_()
    w2g = w2.detach().requires_grad_()
    lg = logits.detach().requires_grad_()
    out = fused_moe(xg, w1g, w2g, lg, k)
    dout = torch.randn_like(out)

    def bwd():
        return torch.autograd.grad(out, (xg, w1g, w2g, lg), dout, retain_graph=True)

    eager_b = triton.testing.do_bench(bwd)
    kt = kernel_times(bwd)
    total = sum(v for v, _ in kt.values()) / 1e3
    print(f"\n== {model} T={T} bwd: eager {eager_b:.4f} ms, kernels sum {total:.4f} ms; "
          f"{expert_gemm_flops(T, k, d, F, 'bwd') / eager_b / 1e9:.1f} TFLOP/s eager")
    for name, (us, n) in sorted(kt.items(), key=lambda kv: -kv[1][0]):
        print(f"  {us:9.1f} us  x{n:.0f}  {name[:110]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,16,4096")
    p.add_argument("--models", default=",".join(MODELS))
    args = p.parse_args()
    torch.manual_seed(0)
    for model in args.models.split(","):
        cfg = MODELS[model]
        E, k, d, F = cfg["num_experts"], cfg["top_k"], cfg["d_model"], cfg["d_ff"]
        w1 = torch.randn(E, 2 * F, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
        w2 = torch.randn(E, d, F, device="cuda", dtype=torch.bfloat16) * F**-0.5
        for T in map(int, args.tokens.split(",")):
            profile_case(model, k, d, F, w1, w2, T)
        del w1, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
