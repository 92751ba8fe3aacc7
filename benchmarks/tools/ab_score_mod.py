"""score_mod in the attention forward, one GPU, one process: a softcap and an ALiBi slope table written as
`@triton.jit` score mods, on each backend that plans them by name (backend="hopper", "triton"), FlexAttention
(compiled, its score_mod in torch) and the built-in keyword (softcap=, alibi_slopes=) on auto, B4 H16 L4096 D128,
causal and not; triton.testing.do_bench, the median of --rounds rounds whose backend order rotates. A backend that
refuses a mod is reported and left out. --pass bwd times the backward alone (autograd.grad of one forward's graph,
retained; the mods with their derivatives). An A/B for the dispatch rules, not a published run.

    PYTHONPATH=src python benchmarks/tools/ab_score_mod.py --rounds 3 --pass fwd,bwd --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

import flashmoe_science as fs
from flashmoe_science.attention.mods import ScoreMod

CAP = 30.0


@triton.jit
def softcap_mod(score, b, h, q_idx, kv_idx):
    return 30.0 * (1.0 - 2.0 / (tl.exp(score * (2.0 / 30.0)) + 1.0))  # CAP · tanh(score / CAP)


@triton.jit
def softcap_grad(score, b, h, q_idx, kv_idx):
    t = 1.0 - 2.0 / (tl.exp(score * (2.0 / 30.0)) + 1.0)
    return 1.0 - t * t


@triton.jit
def alibi_mod(score, b, h, q_idx, kv_idx, slopes):
    return score - tl.load(slopes + h) * tl.abs(q_idx - kv_idx).to(tl.float32)


@triton.jit
def alibi_grad(score, b, h, q_idx, kv_idx, slopes):
    return score * 0.0 + 1.0


def _backward(forward, q, k, v):
    """The backward of one `forward()` call, as a callable: autograd.grad through its graph, built at the first
    call and retained."""
    graph = []

    def run():
        if not graph:
            out = forward()
            graph.append((out, torch.randn_like(out)))
        out, grad = graph[0]
        return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    return run


def _calls(causal: bool, backward: bool = False):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, L, D = 4, 16, 4096, 128
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device="cuda") / H).float()
    flex = torch.compile(flex_attention)
    blocks = create_block_mask(lambda b, h, i, j: j <= i, None, None, L, L) if causal else None

    def flex_softcap(s, b, h, i, j):
        return CAP * torch.tanh(s / CAP)

    def flex_alibi(s, b, h, i, j):
        return s - slopes[h] * (i - j).abs()

    mods = {"softcap": (ScoreMod(softcap_mod, grad=softcap_grad), flex_softcap, dict(softcap=CAP)),
            "alibi table": (ScoreMod(alibi_mod, slopes, grad=alibi_grad), flex_alibi, dict(alibi_slopes=slopes))}
    calls = {}
    for name, (mod, flex_mod, keyword) in mods.items():
        calls[name, "hopper"] = lambda mod=mod: fs.flash_attention_science(q, k, v, causal=causal, score_mod=mod,
                                                                           backend="hopper")
        calls[name, "triton"] = lambda mod=mod: fs.flash_attention_science(q, k, v, causal=causal, score_mod=mod,
                                                                           backend="triton")
        calls[name, "flex"] = lambda f=flex_mod: flex(q, k, v, score_mod=f, block_mask=blocks)
        calls[name, "builtin"] = lambda kw=keyword: fs.flash_attention_science(q, k, v, causal=causal, **kw)
    flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
    if backward:  # five products instead of two; each backend's graph built once, outside the timing
        return {key: _backward(call, q, k, v) for key, call in calls.items()}, flops * 2.5
    return calls, flops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=".")
    parser.add_argument("--pass", dest="passes", default="fwd", help="fwd, bwd or fwd,bwd")
    args = parser.parse_args()
    rows = []
    for phase, causal in [(p, c) for p in args.passes.split(",") for c in (True, False)]:
        calls, flops = _calls(causal, phase == "bwd")
        for key in list(calls):
            try:
                calls[key]()
            except Exception as error:  # a backend that does not plan this mod
                print(f"{key[0]:12s} {'causal' if causal else 'full':6s} {key[1]:8s} {phase} refused: {error}",
                      flush=True)
                del calls[key]
        times = {key: [] for key in calls}
        for r in range(args.rounds):
            keys = list(calls)
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                times[key].append(triton.testing.do_bench(calls[key], warmup=25, rep=100))
        for (mod, backend), ms in times.items():
            med = statistics.median(ms)
            rows.append(dict(mod=mod, backend=backend, causal=causal, ms=med, tflops=flops / med / 1e9, **{"pass": phase}))
            print(f"{mod:12s} {'causal' if causal else 'full':6s} {backend:8s} {phase} {med:8.3f} ms "
                  f"{flops / med / 1e9:7.1f} TFLOP/s", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    with open(f"{args.out}/ab_score_mod.json", "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
