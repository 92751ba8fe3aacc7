"""An interleaved A/B of two (or three) source trees on one GPU: the same attention (forward, forward+backward,
with a window and softcap), KV-cache decode (contiguous and paged) and MoE (fused_moe forward, forward+backward)
calls, timed by triton.testing.do_bench in one process per tree and round, the trees' order rotating each round so
that clock and thermal drift fall on all. Only the public functions are called, so any two commits compare.
`--suite backward` times only the attention backward at long rows (B1 H16 L16k, D 64/128, causal or not),
`--suite forward` only the attention forward (B1 H16 L16k and B4 H16 L4k at D=64 and 128, B2 H16 L8k at D=128,
B1 H16 L16k and B2 H16 L8k at D=256; causal or not), `--suite varlen` the packed D=128 H16 batches of the features
bench (its long tail and packed documents): the forward, and the backward alone, causal or not; `--suite packed`
causal packed forwards of equal lengths and of a serving prefill step, eager and graphed; `--suite
ragged-decode` a serving engine's decode steps (ragged lengths, pages of 16 and 64, CUDA-graph replays); `--suite
mask-mods` the user masks of `bench --suite mask-mods` on each backend that plans them by name. `--match TEXT` keeps
the suite's cases whose name contains TEXT.

    PYTHONPATH=src python benchmarks/tools/ab_interleaved.py --a /path/to/old/src --b src [--c other/src] \
        --rounds 4 --out "$OUT"

Writes ab.json (every case's ms per tree and round, the medians and each tree's ratio to A, GPU and versions) and
prints a table; `--worker` is one tree's process (JSON on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _cases():
    """(name, zero-argument call, tensors whose .grad to reset) on the current GPU."""
    import torch

    import flashmoe_science as fs

    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    cases = []
    for b, h, length, d in ((4, 16, 4096, 128), (16, 16, 1024, 128), (4, 32, 4096, 64)):
        q, k, v = (torch.randn(b, h, length, d, device=dev, dtype=bf16, generator=g) for _ in range(3))
        for causal in (False, True):
            name = f"attn fwd B{b} H{h} L{length} D{d} {'causal' if causal else 'full'}"
            cases.append((name, lambda q=q, k=k, v=v, c=causal: fs.flash_attention_science(q, k, v, causal=c), None))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        dout = torch.randn_like(q)
        cases.append((f"attn fwd+bwd B{b} H{h} L{length} D{d} causal",
                      lambda q=qg, k=kg, v=vg, o=dout: fs.flash_attention_science(q, k, v, causal=True).backward(o),
                      [qg, kg, vg]))
    q, k, v = (torch.randn(4, 16, 4096, 128, device=dev, dtype=bf16, generator=g) for _ in range(3))
    cases.append(("attn fwd window 1024 softcap 30", lambda: fs.flash_attention_science(
        q, k, v, causal=True, window=(1024, 0), softcap=30.0), None))
    for batch, context in ((1, 131072), (16, 8192)):
        qd = torch.randn(batch, 1, 32, 128, device=dev, dtype=bf16, generator=g)
        kc, vc = (torch.randn(batch, context, 8, 128, device=dev, dtype=bf16, generator=g) for _ in range(2))
        seqlens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        cases.append((f"decode B{batch} {context // 1024}k contiguous",
                      lambda q=qd, k=kc, v=vc, s=seqlens: fs.flash_attention_decode(q, k, v, s), None))
        pages = kc.view(batch * context // 64, 64, 8, 128)
        table = torch.arange(batch * context // 64, dtype=torch.int32, device=dev).view(batch, -1)
        cases.append((f"decode B{batch} {context // 1024}k paged 64",
                      lambda q=qd, k=pages, v=pages, s=seqlens, t=table: fs.flash_attention_decode(
                          q, k, v, s, block_table=t), None))
    for tokens, experts, d_model, d_ff, top_k in ((4096, 8, 4096, 14336, 2), (8192, 128, 2048, 768, 8)):
        x = torch.randn(tokens, d_model, device=dev, dtype=bf16, generator=g)
        w1 = torch.randn(experts, 2 * d_ff, d_model, device=dev, dtype=bf16, generator=g) * d_model ** -0.5
        w2 = torch.randn(experts, d_model, d_ff, device=dev, dtype=bf16, generator=g) * d_ff ** -0.5
        logits = torch.randn(tokens, experts, device=dev, dtype=bf16, generator=g)
        label = f"T{tokens} E{experts} d{d_model} F{d_ff} top{top_k}"
        cases.append((f"moe fwd {label}", lambda x=x, w1=w1, w2=w2, r=logits, t=top_k: fs.fused_moe(x, w1, w2, r, t),
                      None))
        xg, w1g, w2g = (t.clone().requires_grad_() for t in (x, w1, w2))
        cases.append((f"moe fwd+bwd {label}", lambda x=xg, w1=w1g, w2=w2g, r=logits, t=top_k: fs.fused_moe(
            x, w1, w2, r, t).sum().backward(), [xg, w1g, w2g]))
    return cases


def _backward_cases():
    """The attention backward alone (the forward's graph kept), B1 H16 L16k, D 64/128, causal or not."""
    import torch

    import flashmoe_science as fs

    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for d in (64, 128):
        q, k, v = (torch.randn(1, 16, 16384, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        dout = torch.randn_like(q)
        for causal in (False, True):
            out = fs.flash_attention_science(q, k, v, causal=causal)
            cases.append((f"attn bwd B1 H16 L16384 D{d} {'causal' if causal else 'full'}",
                          lambda o=out, g=dout: o.backward(g, retain_graph=True), [q, k, v]))
    return cases


def _forward_cases():
    """The attention forward alone: B1 H16 L16k and B4 H16 L4k at D=64 and 128, B2 H16 L8k at D=128, B1 H16 L16k
    and B2 H16 L8k at D=256; causal or not."""
    import torch

    import flashmoe_science as fs

    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for b, length, d in ((1, 16384, 64), (4, 4096, 64), (1, 16384, 128), (2, 8192, 128), (4, 4096, 128),
                         (1, 16384, 256), (2, 8192, 256)):
        q, k, v = (torch.randn(b, 16, length, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        for causal in (False, True):
            cases.append((f"attn fwd B{b} H16 L{length} D{d} {'causal' if causal else 'full'}",
                          lambda q=q, k=k, v=v, c=causal: fs.flash_attention_science(q, k, v, causal=c), None))
    return cases


def _varlen_cases():
    """Packed batches, D=128 H16 (bench.features' VARLEN_DISTRIBUTIONS "long tail", 49 sequences of 64..1626, and
    "packed documents", 31 of 37..8192; about 16k tokens each): the forward, and the backward alone (the forward's
    graph kept), causal or not."""
    import torch

    import flashmoe_science as fs
    from flashmoe_science.bench.features import HEAD_DIM, HEADS, VARLEN_DISTRIBUTIONS

    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for distribution in ("long tail", "packed documents"):
        lengths = VARLEN_DISTRIBUTIONS[distribution](1)
        total, longest = sum(lengths), max(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        dout = torch.randn_like(q)
        label = f"{distribution} {len(lengths)} seqs {min(lengths)}..{longest} H{HEADS} D{HEAD_DIM}"
        for causal in (False, True):
            mask = "causal" if causal else "full"

            def attend(q, k, v, c=causal):
                return fs.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=c)

            cases.append((f"varlen fwd {label} {mask}", lambda q=q, k=k, v=v, f=attend: f(q, k, v), None))
            out = attend(qg, kg, vg)
            cases.append((f"varlen bwd {label} {mask}", lambda o=out, g=dout: o.backward(g, retain_graph=True),
                          [qg, kg, vg]))
    return cases


def _packed_cases():
    """Causal packed forwards, eager and as CUDA-graph replays, 16k tokens, H = 2048 / D: equal lengths (D 64 and
    128 at 4 x 4096, 8 x 2048, 16 x 1024) and a serving engine's prefill step (GQA 32/8, D 128, prompts of uniform
    256..2048 tokens up to 16k tokens, as vLLM's `prefill` workload fills a step)."""
    import torch

    import flashmoe_science as fs
    from flashmoe_science.bench.report import graph_replay

    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [(f"D{d} {16384 // n} x {n}", [n] * (16384 // n), 2048 // d, 2048 // d, d)
               for d in (64, 128) for n in (4096, 2048, 1024)]
    prompts, total = [], 0
    for n in torch.randint(256, 2049, (64,), generator=torch.Generator().manual_seed(0)).tolist():
        if total + n > 16384:
            break
        prompts.append(n)
        total += n
    batches.append((f"GQA 32/8 D128 {len(prompts)} prompts 256..2048", prompts, 32, 8, 128))
    cases = []
    for label, lengths, heads, kv_heads, d in batches:
        total, longest = sum(lengths), max(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(total, kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))

        def attend(q=q, k=k, v=v, cu=cu, longest=longest):
            return fs.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)

        cases.append((f"packed causal {label}", attend, None))
        replay = graph_replay(attend)
        cases.append((f"packed causal {label} graph", lambda r=replay, held=(q, k, v, cu): r(), None))
    return cases


def _ragged_decode_cases():
    """Decode steps of ragged batches as CUDA-graph replays: 256 sequences of 128..640 keys (vLLM's `decode`
    workload) and 64 of 1024..4096, Hq 32, Hkv 8, D 128, pages of 16 and 64 scattered over the pool. The pool is
    built here from public calls only (bench.decode.ragged_paged_cache is newer than some trees compared)."""
    import torch

    import flashmoe_science as fs
    from flashmoe_science.bench.report import graph_replay

    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for batch, shortest, longest in ((256, 128, 640), (64, 1024, 4096)):
        lengths = torch.randint(shortest, longest + 1, (batch,), generator=torch.Generator().manual_seed(batch))
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        seqlens = lengths.to(device="cuda", dtype=torch.int32)
        for page in (16, 64):
            per_seq = (lengths + page - 1) // page
            order = torch.randperm(int(per_seq.sum()), device="cuda", generator=g).to(torch.int32)
            table = torch.zeros(batch, int(per_seq.max()), dtype=torch.int32, device="cuda")
            for row, (start, count) in enumerate(zip((per_seq.cumsum(0) - per_seq).tolist(), per_seq.tolist())):
                table[row, :count] = order[start:start + count]
            k, v = (torch.randn(order.numel(), page, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                    for _ in range(2))
            replay = graph_replay(lambda q=q, k=k, v=v, s=seqlens, t=table: fs.flash_attention_decode(
                q, k, v, s, block_table=t))
            # the graph reads these tensors: the case holds them for as long as it is timed
            cases.append((f"decode B{batch} {shortest}..{longest} page {page}",
                          lambda r=replay, held=(q, k, v, seqlens, table): r(), None))
    return cases


def _mask_mods_cases():
    """The mask-mods suite's masks (bench.mask_mods: B4 H16 L4096 D128) through each backend that plans them by name
    (`triton`, and `hopper` where the tree plans a mod there), forward and forward+backward."""
    import torch

    import flashmoe_science as fs
    from flashmoe_science.bench import mask_mods as mm

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(mm.BATCH, mm.HEADS, mm.LENGTH, mm.HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=g, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    cases = []
    for name, mod, _, _ in mm.mask_cases(mm.LENGTH, "cuda"):
        for backend in ("triton", "hopper"):
            def forward(mod=mod, backend=backend):
                return fs.flash_attention_science(q, k, v, mask_mod=mod, backend=backend)

            try:
                forward()
            except (ValueError, TypeError):  # this tree does not plan the mod on that backend
                continue
            cases.append((f"{name} {backend} fwd", torch.no_grad()(forward), None))
            try:
                forward().backward(grad)
            except (ValueError, TypeError):
                continue
            cases.append((f"{name} {backend} fwd+bwd", lambda f=forward: f().backward(grad), (q, k, v)))
    return cases


SUITES = {"all": _cases, "backward": _backward_cases, "forward": _forward_cases, "varlen": _varlen_cases,
          "packed": _packed_cases, "ragged-decode": _ragged_decode_cases, "mask-mods": _mask_mods_cases}


def worker(suite: str, match: str | None = None) -> None:
    import torch
    import triton
    from triton.testing import do_bench

    results = {}
    for name, fn, grads in SUITES[suite]():
        if match and match not in name:
            continue
        results[name] = float(do_bench(fn, warmup=100, rep=300, grad_to_none=grads, return_mode="median"))
        torch.cuda.synchronize()
    json.dump({"ms": results, "torch": torch.__version__, "triton": triton.__version__,
               "gpu": torch.cuda.get_device_name()}, sys.stdout)


def _run(src: str, suite: str, match: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--suite", suite,
                           *(["--match", match] if match else [])], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the worker on {src} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", help="the baseline tree's src folder")
    parser.add_argument("--b", help="the new tree's src folder")
    parser.add_argument("--c", help="a third tree's src folder (optional)")
    parser.add_argument("--suite", choices=tuple(SUITES), default="all")
    parser.add_argument("--match", help="only the cases whose name contains this text")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="start no round that would end past this many seconds (the rounds done are reported)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.suite, args.match)
        return 0
    trees = ("a", "b", "c") if args.c else ("a", "b")
    runs = {tree: [] for tree in trees}
    meta = {}
    start_all, longest = time.time(), 0.0
    for round_ in range(args.rounds):
        if round_ and time.time() - start_all + longest > args.budget_s:
            print(f"stopping after {round_} rounds: the budget of {args.budget_s:.0f} s", flush=True)
            break
        round_start = time.time()
        shift = round_ % len(trees)
        order = trees[shift:] + trees[:shift]
        for tree in order if round_ % 2 == 0 else order[::-1]:
            start = time.time()
            result = _run(getattr(args, tree), args.suite, args.match)
            meta = {key: result[key] for key in ("torch", "triton", "gpu")}
            runs[tree].append(result["ms"])
            print(f"round {round_} tree {tree}: {time.time() - start:.0f} s", flush=True)
        longest = max(longest, time.time() - round_start) if round_ else 0.0  # the first round compiles
    rows = []
    for name in runs["a"][0]:
        row = {"case": name}
        for tree in trees:
            row[f"{tree}_ms"] = [r[name] for r in runs[tree]]
            row[f"{tree}_median_ms"] = statistics.median(row[f"{tree}_ms"])
            if tree != "a":
                row[f"{tree}_over_a"] = row[f"{tree}_median_ms"] / row["a_median_ms"]
        row["a_spread"] = max(row["a_ms"]) / min(row["a_ms"]) - 1
        rows.append(row)
        ratios = "  ".join(f"{t.upper()} {row[f'{t}_median_ms']:8.3f} ms {t.upper()}/A {row[f'{t}_over_a']:6.3f}"
                           for t in trees[1:])
        print(f"{name:48s} A {row['a_median_ms']:8.3f} ms  {ratios}  (A's own spread {row['a_spread']:.1%})")
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump({"a": args.a, "b": args.b, "c": args.c, "suite": args.suite, "rounds": len(runs["a"]), **meta,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cases": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
