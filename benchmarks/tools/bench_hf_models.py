"""transformers models on our attention against transformers' defaults, one process, interleaved repeats.

Models (random weights, bf16): ``moe``, a Qwen3-MoE-style decoder (8 layers, hidden 1024, 16 query / 4 KV heads of
D=64, 64 experts top-8 of width 512), and ``dense``, a Llama-style decoder of the same attention (8 layers, hidden
1024, MLP 3072). Batches: ``full`` (B x L, no mask) and ``padded`` (B rows right-padded to L, lengths uniform in
[L/4, L], the tokenizer's 0/1 mask). Passes: ``train`` (forward, loss over the real tokens, backward) and ``infer``
(forward under no_grad; its loss computed from the logits, untimed). Contenders, each the same model object
switched between them: ``sdpa`` (transformers' defaults: sdpa attention, grouped_mm experts), ``attention`` (our
attention, the same experts) and, for the MoE model, ``both`` (our attention and `FusedMoE` blocks, a copy sharing
nothing but the weights' values).

Each round times every (model, batch, pass, contender) once, in an order that alternates per round, as the median
of ``--steps`` steps after two warm steps; the records give each round's ms and each round's ratio to sdpa, and the
loss of each contender (its relative difference to sdpa's in ``loss_rel``).

    PYTHONPATH=src python benchmarks/tools/bench_hf_models.py --rounds 3 --out $OUT
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import statistics
import time

import torch

ROUNDS, STEPS = 3, 8


def model_configs(vocab: int):
    import transformers

    attention = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                     head_dim=64, vocab_size=vocab, max_position_embeddings=8192)
    return {
        "moe": transformers.Qwen3MoeConfig(**attention, num_experts=64, num_experts_per_tok=8,
                                           moe_intermediate_size=512, intermediate_size=3072, norm_topk_prob=True),
        "dense": transformers.LlamaConfig(**attention, intermediate_size=3072),
    }


def make_batch(kind: str, batch: int, length: int, vocab: int, device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    if kind == "full":
        return ids.to(device), None
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=generator)
    lengths[0] = length  # the padded length is the longest row's
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return ids.to(device), mask.to(device)


def build(name: str, config, device):
    """{contender: model} for one model: sdpa and attention share one object (switched per call)."""
    import transformers

    from flashmoe_science.integrations import hf

    hf.register()
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                         dtype=torch.bfloat16).to(device)
    models = {"sdpa": base, "attention": base}
    if name == "moe":
        models["both"] = hf.apply(copy.deepcopy(base))
    return models


def _labels(ids, mask):
    return ids if mask is None else ids.masked_fill(mask == 0, -100)


def _step(model, implementation, ids, mask, train: bool):
    """One step; returns what the loss is computed from: the loss (train) or the logits (infer)."""
    if implementation is not None and model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)
    if not train:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask)).loss
    loss.backward()
    return loss.detach()


def _loss(result, ids, mask) -> float:
    """The step's loss: as returned (train), or the causal LM loss of the logits over the real tokens (infer)."""
    if result.dim() == 0:
        return float(result)
    labels = _labels(ids, mask)
    return float(torch.nn.functional.cross_entropy(result[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                                   ignore_index=-100))


IMPLEMENTATIONS = {"sdpa": "sdpa", "attention": "fmoe_science", "both": None}


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_case(model, contender, ids, mask, train, steps) -> tuple[float, float]:
    """(median ms of `steps` steps after two warm ones, each from the host's issue to the device's end, so host
    stalls count; the last step's loss)."""
    implementation = IMPLEMENTATIONS[contender]
    for _ in range(2):
        value = _step(model, implementation, ids, mask, train)
    times = []
    for _ in range(steps):
        _synchronize(ids.device)
        start = time.perf_counter()
        value = _step(model, implementation, ids, mask, train)
        _synchronize(ids.device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), _loss(value, ids, mask)


def run(models_wanted, batches, passes, rounds, steps, batch, length, vocab, device="cuda",
        progress=print) -> list[dict]:
    device = torch.device(device)
    configs = model_configs(vocab)
    measured: dict[tuple, list[tuple[float, float]]] = {}
    built = {name: build(name, configs[name], device) for name in models_wanted}
    data = {kind: make_batch(kind, batch, length, vocab, device) for kind in batches}
    cases = [(name, kind, pass_, contender) for name in models_wanted for kind in batches for pass_ in passes
             for contender in built[name]]
    for round_ in range(rounds):
        order = cases if round_ % 2 == 0 else cases[::-1]
        for name, kind, pass_, contender in order:
            ids, mask = data[kind]
            ms, value = time_case(built[name][contender], contender, ids, mask, pass_ == "train", steps)
            measured.setdefault((name, kind, pass_, contender), []).append((ms, value))
            progress(f"round {round_ + 1} {name:5s} {kind:6s} {pass_:5s} {contender:9s} {ms:8.2f} ms  {value:.5f}")
    records = []
    for (name, kind, pass_, contender), values in measured.items():
        base = measured[(name, kind, pass_, "sdpa")]
        ms_rounds = [ms for ms, _ in values]
        ratios = [b / ms for (b, _), ms in zip(base, ms_rounds)]
        records.append(dict(op="hf-model", model=name, batch=kind, pass_=pass_, backend=contender,
                            shape=f"{batch}x{length}", dtype="bf16", ms=statistics.median(ms_rounds),
                            ms_rounds=ms_rounds, speedup_vs_sdpa=statistics.median(ratios),
                            speedup_rounds=ratios, loss=values[-1][1],
                            loss_rel=abs(values[-1][1] - base[-1][1]) / max(abs(base[-1][1]), 1e-12)))
    for record in records:
        record["pass"] = record.pop("pass_")
    return records


def table(records) -> str:
    lines = [f"{'model':6s} {'batch':7s} {'pass':6s} {'contender':10s} {'ms':>8s} {'x sdpa':>7s}  rounds"]
    for r in records:
        rounds = " / ".join(f"{x:.2f}" for x in r["speedup_rounds"])
        lines.append(f"{r['model']:6s} {r['batch']:7s} {r['pass']:6s} {r['backend']:10s} {r['ms']:8.2f} "
                     f"{r['speedup_vs_sdpa']:7.3f}  {rounds}  (loss rel {r['loss_rel']:.1e})")
    return "\n".join(lines)


def main(argv=None) -> int:
    from flashmoe_science.bench.report import environment_metadata, resolve_commit, result_stem

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="moe,dense")
    parser.add_argument("--batches", default="full,padded")
    parser.add_argument("--passes", default="train,infer")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu runs the reference: a smoke test")
    parser.add_argument("--out", help="folder for the JSON record")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    records = run(args.models.split(","), args.batches.split(","), args.passes.split(","), args.rounds, args.steps,
                  args.batch, args.length, args.vocab, args.device)
    print(table(records))
    print(f"{time.perf_counter() - start:.0f} s")
    if args.out:
        envelope = {**environment_metadata(resolve_commit()), "suite": "hf-models", "rounds": args.rounds,
                    "steps": args.steps}
        stem = result_stem(envelope["gpu"], envelope["date"], envelope["commit"])
        path = pathlib.Path(args.out) / f"{stem}-hf-models.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**envelope, "records": records}, indent=1) + "\n")
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
