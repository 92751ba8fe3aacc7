"""How the MoE layer's timing depends on the measurement window: each backend timed by do_bench with bench moe's
short window (25 ms warm-up, 100 ms timed) and with sustained windows (seconds of back-to-back calls first, so that
the power controller has settled: the layer runs at the H200's 700 W cap, see docs/perf-notes.md session 15),
in both orders (ours first, grouped_mm first), over interleaved rounds; nvidia-smi samples the SM clock during each
timed window.

    PYTHONPATH=src python scripts/ab_moe_sustained.py [--cases mixtral-8x7b:4096:bwd,...] [--rounds 2]
        [--windows 25/100,1000/500,3000/500]

Prints one line per measurement and, per case and window, the medians and ours/grouped_mm ratio per order.
"""

import argparse
import statistics
import subprocess

import torch
import triton.testing

from flashmoe_science.bench import moe as bench_moe

BACKENDS = ("flashmoe", "torch-grouped-mm")


def _call(backend, pass_, tensors, top_k):
    layer = bench_moe._layer(backend)
    if pass_ == "fwd":
        def fwd():
            with torch.no_grad():
                return layer(*tensors, top_k)
        return fwd
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = layer(*leaves, top_k)
    grad_out = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)


def _timed(fn, warmup_ms, rep_ms):
    """do_bench median and the median SM clock (MHz) nvidia-smi saw during the whole call (warm-up included)."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    smi.terminate()
    clocks = [float(line) for line in smi.communicate()[0].split()]
    tail = clocks[-max(1, int(rep_ms / 50)):]  # the timed window's samples
    return ms, statistics.median(tail) if tail else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="mixtral-8x7b:4096:bwd,mixtral-8x7b:4096:fwd,qwen3-30b-a3b:4096:bwd")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--windows", default="25/100,1000/500,3000/500", help="warmup/rep pairs in ms")
    args = parser.parse_args()
    windows = [tuple(int(v) for v in w.split("/")) for w in args.windows.split(",")]
    torch.manual_seed(0)
    results = {}
    for case in args.cases.split(","):
        model, num_tokens, pass_ = case.split(":")
        shape = bench_moe.MODELS[model]
        tensors = bench_moe._make_inputs(int(num_tokens), shape["num_experts"], shape["d_model"], shape["d_ff"],
                                         torch.bfloat16, torch.device("cuda"))
        calls = {b: _call(b, pass_, tensors, shape["top_k"]) for b in BACKENDS}
        for fn in calls.values():  # compile and autotune outside the windows
            fn()
        torch.cuda.synchronize()
        for round_ in range(args.rounds):
            for order in (BACKENDS, BACKENDS[::-1]):
                for warmup, rep in windows:
                    for backend in order:
                        ms, clock = _timed(calls[backend], warmup, rep)
                        key = (case, f"{warmup}/{rep}", order[0])
                        results.setdefault(key, {}).setdefault(backend, []).append(ms)
                        print(f"{case} round {round_} first={order[0]:<16} window {warmup}/{rep} ms "
                              f"{backend:<16} {ms:8.3f} ms  SM {clock:.0f} MHz", flush=True)
        del calls, tensors
        torch.cuda.empty_cache()
    print("\nmedians (ms) and ours / grouped_mm speedup")
    for (case, window, first), times in results.items():
        ours = statistics.median(times["flashmoe"])
        theirs = statistics.median(times["torch-grouped-mm"])
        print(f"{case:<26} window {window:>9} first={first:<16} flashmoe {ours:8.3f}  grouped_mm {theirs:8.3f}  "
              f"speedup {theirs / ours:.3f}x", flush=True)


if __name__ == "__main__":
    main()
