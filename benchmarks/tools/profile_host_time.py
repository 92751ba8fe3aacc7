"""Host time per call vs device time, for shapes whose GPU work is short enough that the launch path can bound the
benchmark (before prepared launches, D=256 L=512 ran at half the TFLOP/s of a direct kernel call). Prints, per
shape and backend: device ms (calls queued back to back, timed by CUDA events), host µs per call (no sync), and a
cProfile of the sm_90 `auto` path's host side (top functions by cumulative time).

    PYTHONPATH=src python benchmarks/tools/profile_host_time.py [--cases BxHxLxD,...] [--profile BxHxLxD]
    PYTHONPATH=src python benchmarks/tools/profile_host_time.py --moe [--tokens 1,16,64]

`--moe`: the same for `fused_moe` on the bench's models (bf16), the prepared launch (a repeated signature) against
the full path (the prepared-call cache emptied before each call).
`--attn-bwd`: the attention backward as the bench times it (out.backward, graph retained) per backend
(`--backends`, default auto, triton, cudnn): device ms and host µs per backward, the kernels it launched
(torch.profiler, device µs each) and a cProfile of auto's host side. From its third backward a graph's backward runs
its BackwardPlan's prepared launch sequence (attention/autograd.py), which the timed calls measure. Beside it, a
training step's attention (forward recording the graph, then its backward; a repeated signature replays
call.Recorded).
`--attn-bwd-cpu`: no GPU needed. The Python side of the sm_90 backward (D64 causal, bf16 CPU tensors of B1 H2 L128:
the host work does not depend on the size, CPU allocations do) with the kernel launches replaced by no-ops
(Triton's compiled kernels and driver stubbed; descriptors, keys, allocations and autograd real): µs per call of
the prepared BackwardPlan, of the whole `out.backward` through `_KernelAttention`, and of an autograd.Function
whose backward only allocates its three gradients (autograd's own floor), then a cProfile.
`--varlen`: `flash_attention_varlen` on the varlen bench's long-tailed batch (16384 tokens, H=16, D=128) against
the dense call of the same tokens (4 x 4096), forward alone and forward + backward, causal and not: device ms, host
µs, the kernels each launches (torch.profiler) and a cProfile of the packed forward's host side.
`--moe-bwd`: the layer's backward as the bench times it (autograd.grad, graph retained), ours and the grouped_mm
pipeline, then a cProfile of ours (top functions by own time).
"""
import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashmoe_science import flash_attention_science

CASES = "32x8x512x256,32x8x512x64,4x8x2048x64,4x8x4096x64,32x16x512x128,8x16x2048x128"


def call(name, q, k, v, causal):
    if name == "cudnn":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return flash_attention_science(q, k, v, causal=causal, backend=name)


def _host_and_device(fn, n=50):
    """(device ms per call, host µs per call without a sync) of fn(). The device time is taken behind a long
    sleep kernel, so the queue is full and the GPU never waits for the host."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n, host_us


def _host_profile(fn, n) -> pstats.Stats:
    """cProfile of n calls of fn() (the host side; the GPU work is synchronised after the last)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return pstats.Stats(prof)


def moe_main(tokens):
    from flashmoe_science.bench.moe import MODELS
    from flashmoe_science.moe import execute as moe_execute
    from flashmoe_science.moe import fused_moe

    for model, shape in MODELS.items():
        e, k, d, f = shape["num_experts"], shape["top_k"], shape["d_model"], shape["d_ff"]
        w1 = torch.randn(e, 2 * f, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
        w2 = torch.randn(e, d, f, device="cuda", dtype=torch.bfloat16) * f**-0.5
        for t in tokens:
            x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)

            def prepared():
                return fused_moe(x, w1, w2, logits, k)

            def full():
                moe_execute.PREPARED.clear()
                return fused_moe(x, w1, w2, logits, k)

            line = [f"{model} T={t}"]
            for name, fn in (("prepared", prepared), ("full path", full)):
                device_ms, host_us = _host_and_device(fn)
                line.append(f"{name}: device {device_ms:.4f} ms, host {host_us:.0f} us")
            print(" | ".join(line), flush=True)


def moe_bwd_main(tokens):
    from flashmoe_science.bench.moe import MODELS, torch_grouped_mm_moe
    from flashmoe_science.moe import fused_moe

    for model, shape in MODELS.items():
        e, k, d, f = shape["num_experts"], shape["top_k"], shape["d_model"], shape["d_ff"]
        w1 = (torch.randn(e, 2 * f, d, device="cuda", dtype=torch.bfloat16) * d**-0.5).requires_grad_()
        w2 = (torch.randn(e, d, f, device="cuda", dtype=torch.bfloat16) * f**-0.5).requires_grad_()
        for t in tokens:
            x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            line = [f"{model} T={t} bwd"]
            for name, layer in (("flashmoe", fused_moe), ("grouped-mm", torch_grouped_mm_moe)):
                out = layer(x, w1, w2, logits, k)
                grad_out = torch.randn_like(out)

                def backward():
                    return torch.autograd.grad(out, (x, w1, w2, logits), grad_out, retain_graph=True)

                device_ms, host_us = _host_and_device(backward, n=20)
                line.append(f"{name}: device {device_ms:.4f} ms, host {host_us:.0f} us")
                if name == "flashmoe":
                    stats = _host_profile(backward, 20)
            print(" | ".join(line), flush=True)
            stats.sort_stats("tottime").print_stats(12)


def attn_bwd_main(cases, backends):
    from torch.profiler import ProfilerActivity, profile

    for case in cases.split(","):
        b, h, length, d = map(int, case.split("x"))
        for causal in (False, True):
            line = [f"B{b} H{h} L{length} D{d} causal={int(causal)} bwd"]
            for name in backends:
                q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                out = call(name, q, k, v, causal)
                grad_out = torch.randn_like(out)

                def backward():
                    for t in (q, k, v):
                        t.grad = None
                    out.backward(grad_out, retain_graph=True)

                def step():  # a training step's attention: forward recording the graph, then its backward
                    for t in (q, k, v):
                        t.grad = None
                    call(name, q, k, v, causal).backward(grad_out)

                device_ms, host_us = _host_and_device(backward, n=30)
                step_ms, step_us = _host_and_device(step, n=30)
                line.append(f"{name}: device {device_ms:.4f} ms, host {host_us:.0f} us (fwd+bwd: device "
                            f"{step_ms:.4f} ms, host {step_us:.0f} us)")
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        backward()
                    torch.cuda.synchronize()
                kernels = {}
                for event in prof.events():
                    if event.device_type.name == "CUDA":
                        kernels.setdefault(event.name[:70], []).append(event.device_time)
                print(f"  {line[0]} {name} kernels (count, mean us):", flush=True)
                for kname, times in kernels.items():
                    print(f"    {len(times):3d} x {sum(times) / len(times):8.1f}  {kname}", flush=True)
                if name == "auto" and not causal:
                    _host_profile(backward, 30).sort_stats("tottime").print_stats(15)
            print(" | ".join(line), flush=True)


def attn_bwd_cpu_main(shape=(1, 2, 128, 64), causal=True, n=2000):
    from flashmoe_science import prepared_launch
    from flashmoe_science.attention import autograd, bwd_prep
    from flashmoe_science.attention.features import as_features
    from flashmoe_science.attention.hopper import backend, bwd_sm90
    from flashmoe_science.attention.tiles import backward_tiles
    from flashmoe_science.attention.triton.backend import TritonBackward
    from flashmoe_science.device import INTERPRETER_TRAITS

    class NoLaunch:  # a CompiledKernel whose launch does nothing
        function, packed_metadata = None, None

        def run(self, *args):
            pass

    class Driver:
        class active:  # noqa: N801 - triton.runtime.driver.driver.active
            get_current_device = staticmethod(lambda: 0)
            get_current_stream = staticmethod(lambda device: 0)

    prepared_launch.driver = Driver
    for kernel in (bwd_sm90.attention_backward_sm90_kernel, bwd_prep.preprocess_kernel, bwd_prep.dq_convert_kernel):
        kernel.warmup = lambda *args, **kwargs: NoLaunch()
    backend.launch_backward = lambda *args, **kwargs: None  # the unprepared first two backwards
    b, h, length, d = shape
    features = as_features(causal)
    step = backend.HopperBackward(fallback=TritonBackward(backward_tiles(d, torch.bfloat16, causal,
                                                                         INTERPRETER_TRAITS)))
    plan = autograd.BackwardPlan(step, d ** -0.5, False)
    q, k, v, grad_out = (torch.randn(b, h, length, d, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.randn(b, h, length)
    for _ in range(3):  # run, run + prepare, prepared
        plan(q, k, v, q, lse, grad_out, features)

    class Forward:  # the forward plan's part _KernelAttention needs, its kernel a no-op
        @staticmethod
        def run(q, k, v, features, softmax_scale):
            return torch.empty_like(q), lse

    graph_plan = type("Plan", (), {"forward": Forward, "problem": None})()
    autograd.backward_plan = lambda *args: plan
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = autograd._KernelAttention.apply(*leaves, None, features, d ** -0.5, graph_plan)

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return torch.empty_like(q)

        @staticmethod
        def backward(ctx, grad):
            q, k, v = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    empty_out = Empty.apply(*leaves)

    def timed(fn):
        for _ in range(50):
            fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    def whole(out):
        def backward():
            for t in leaves:
                t.grad = None
            out.backward(grad_out, retain_graph=True)
        return backward

    rounds = [(timed(lambda: plan(q, k, v, q, lse, grad_out, features)), timed(whole(out)), timed(whole(empty_out)))
              for _ in range(3)]  # interleaved: this machine's speed drifts
    medians = [sorted(column)[1] for column in zip(*rounds)]
    print(f"B{b} H{h} L{length} D{d} causal={int(causal)}, launches stubbed, us per call (median of 3 interleaved "
          f"rounds): BackwardPlan {medians[0]:.1f} | out.backward {medians[1]:.1f} | allocating "
          f"autograd.Function {medians[2]:.1f}", flush=True)
    _host_profile(whole(out), n).sort_stats("tottime").print_stats(15)


def _kernels(fn, n=5) -> str:
    """The CUDA kernels fn() launches: count per call and mean device µs each."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels.setdefault(event.name[:70], []).append(event.device_time)
    return "\n".join(f"    {len(t) / n:4.1f} x {sum(t) / len(t):8.1f} us  {name}" for name, t in kernels.items())


def varlen_main():
    from flashmoe_science import flash_attention_varlen
    from flashmoe_science.bench.features import HEAD_DIM, HEADS, VARLEN_MAX, VARLEN_MIN, VARLEN_TOKENS, long_tailed_lengths

    lengths = long_tailed_lengths(VARLEN_TOKENS, VARLEN_MIN, VARLEN_MAX)
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    print(f"{len(lengths)} sequences {min(lengths)}..{longest}, {total} tokens", flush=True)
    for causal in (False, True):
        for grad in (False, True):
            packed = [torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                      for _ in range(3)]
            dense = [torch.randn(4, HEADS, total // 4, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                                 requires_grad=grad) for _ in range(3)]
            calls = {"varlen": lambda: flash_attention_varlen(*packed, cu, cu, longest, longest, causal=causal),
                     "dense": lambda: flash_attention_science(*dense, causal=causal)}
            for name, fn in calls.items():
                step = fn
                if grad:
                    def step(fn=fn):
                        fn().backward(gradient=grad_out)
                    grad_out = torch.randn_like(fn())
                device_ms, host_us = _host_and_device(step, n=30)
                label = f"causal={int(causal)} {'fwd+bwd' if grad else 'fwd'} {name}"
                print(f"{label}: device {device_ms:.4f} ms, host {host_us:.0f} us", flush=True)
                print(_kernels(step), flush=True)
                if name == "varlen" and not causal:
                    _host_profile(step, 30).sort_stats("tottime").print_stats(12)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moe", action="store_true")
    p.add_argument("--moe-bwd", action="store_true")
    p.add_argument("--attn-bwd", action="store_true")
    p.add_argument("--attn-bwd-cpu", action="store_true")
    p.add_argument("--varlen", action="store_true")
    p.add_argument("--tokens", default="1,16,64")
    p.add_argument("--cases", default=CASES)
    p.add_argument("--profile", default="32x8x512x256")
    p.add_argument("--backends", default="auto,triton,cudnn", help="--attn-bwd: the backends timed")
    a = p.parse_args()
    if a.moe:
        return moe_main([int(t) for t in a.tokens.split(",")])
    if a.varlen:
        return varlen_main()
    if a.attn_bwd_cpu:
        return attn_bwd_cpu_main()
    if a.attn_bwd:
        return attn_bwd_main(a.cases, a.backends.split(","))
    if a.moe_bwd:
        return moe_bwd_main([int(t) for t in a.tokens.split(",")])
    for case in a.cases.split(","):
        b, h, length, d = map(int, case.split("x"))
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            line = [f"B{b} H{h} L{length} D{d} causal={int(causal)}"]
            for name in ("auto", "triton", "cudnn"):
                device_ms, host_us = _host_and_device(lambda: call(name, q, k, v, causal))
                line.append(f"{name}: device {device_ms:.4f} ms, host {host_us:.0f} us")
            print(" | ".join(line), flush=True)
    b, h, length, d = map(int, a.profile.split("x"))
    q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call("auto", q, k, v, False)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        call("auto", q, k, v, False)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
