"""Host time per call of the eager front doors (prepared launches), beside the same work through the torch.compile
custom ops: called directly, in a compiled function (default mode) and under CUDA graphs (mode="reduce-overhead").

The eager rows are the ones that must not move when the custom ops land: run this script at the commit before
(``git worktree add /tmp/before <commit>``, then ``PYTHONPATH=/tmp/before/src``) and after; the op rows are skipped
where the custom ops (``flashmoe_science.attention.ops``) do not exist. Problems are small, so a call is bound by the host: the
time of `--calls` back-to-back calls (no synchronisation between them) divided by their number, median of
`--repeats`.

    PYTHONPATH=src python benchmarks/tools/host_time_custom_ops.py [--calls 200 --repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashmoe_science as fs


def host_us(fn, calls: int, repeats: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def cases():
    """(name, eager call, the custom-op call or None, the function to compile)."""
    try:  # absent before the custom ops landed: only the eager rows then
        from flashmoe_science.attention import ops as attention_ops
        from flashmoe_science.moe import ops as moe_ops
    except ImportError:
        attention_ops = moe_ops = None
    device, dtype = "cuda", torch.bfloat16
    for b, h, length, d in ((1, 8, 128, 64), (4, 8, 1024, 128)):
        q, k, v = (torch.randn(b, h, length, d, device=device, dtype=dtype) for _ in range(3))

        def attention(q=q, k=k, v=v):
            return fs.flash_attention_science(q, k, v, causal=True)

        op = (lambda q=q, k=k, v=v: attention_ops.attention_forward(q, k, v, True, d ** -0.5, None, None, None, "auto",
                                                                    False)) if attention_ops else None
        yield f"attention B{b} H{h} L{length} D{d} causal", attention, op
    for tokens, experts, d_model, d_ff in ((1, 8, 1024, 1024), (16, 64, 1024, 512), (256, 8, 1024, 1024)):
        x = torch.randn(tokens, d_model, device=device, dtype=dtype)
        w1 = torch.randn(experts, 2 * d_ff, d_model, device=device, dtype=dtype) * 0.02
        w2 = torch.randn(experts, d_model, d_ff, device=device, dtype=dtype) * 0.02
        logits = torch.randn(tokens, experts, device=device, dtype=dtype)

        def moe(x=x, w1=w1, w2=w2, logits=logits):
            return fs.fused_moe(x, w1, w2, logits, 2)

        op = (lambda x=x, w1=w1, w2=w2, logits=logits:
              moe_ops.fused_moe_inference(x, w1, w2, logits, 2, True, "softmax", "auto")) if attention_ops else None
        yield f"fused_moe T{tokens} E{experts} d{d_model} F{d_ff} top-2", moe, op


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call (inference, no grad)")
    print(f"{'case':<40} {'eager':>8} {'op':>8} {'compiled':>9} {'cudagraph':>10}")
    with torch.no_grad():
        for name, eager, op in cases():
            row = [host_us(eager, args.calls, args.repeats)]
            if op is None:
                row += [float("nan")] * 3
            else:
                row.append(host_us(op, args.calls, args.repeats))
                for mode in ("default", "reduce-overhead"):
                    torch._dynamo.reset()
                    compiled = torch.compile(eager, mode=mode, fullgraph=True)
                    row.append(host_us(compiled, args.calls, args.repeats))
            print(f"{name:<40} " + " ".join(f"{value:>8.1f} " for value in row))


if __name__ == "__main__":
    main()
