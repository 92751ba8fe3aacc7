"""Train a GPT-style MoE decoder twice from one seed: with flashmoe_science's attention and FusedMoE ("ours"), and
with the PyTorch build ("torch": SDPA attention, and the MoE experts through ``torch._grouped_mm`` on the GPU or a
per-expert loop on the CPU), each in eager mode and under ``torch.compile``. Same initial weights, same batches.

Corpus: the documentation that installed packages ship, i.e. the docstrings of numpy and torch (``--corpus-packages``;
English prose with code examples, several MB, read from the installed sources by ``ast``: nothing is downloaded,
and both runs of a machine read the same text). Tokenizer: a byte-level BPE (Hugging Face ``tokenizers``, which
transformers installs) trained on that corpus; corpus, tokenizer and token ids are cached under ``--out``.

Writes ``--out``/train_gpt_moe.csv (every step of every run), summary.json (final loss, tokens/s, ratios) and
loss.png. Progress bars show the corpus being read and each run's loss and tokens/s (one line per update when
stderr is a log file).

    python examples/train_gpt_moe.py                             # ~100M parameters (8 layers, d=768, 8 experts), GPU
    python examples/train_gpt_moe.py --config tiny --device cpu  # about a minute on 2 CPU cores

The tiny config on a CPU checks the pipeline (both builds, eager and compiled, agree step by step); its tokens/s
are no measure of the kernels, which a CPU does not run.
"""

from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import pathlib
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from flashmoe_science.device import check_device_option
from flashmoe_science.moe.reference import fused_experts_reference
from flashmoe_science.moe.routing import route_reference
from flashmoe_science.nn import Attention, FusedMoE, TransformerBlock
from flashmoe_science.nn.attention import apply_rotary_torch
from flashmoe_science.science.progress import progress_bar


@dataclass(frozen=True)
class ModelConfig:
    layers: int
    d_model: int
    n_heads: int
    d_ff: int  # per expert
    experts: int
    top_k: int
    vocab: int
    seq_len: int
    batch: int


CONFIGS = {
    # 107M parameters: embeddings (tied) 12.6M, attention 8 x 2.4M, experts 8 x 9.4M, routers and norms
    "100m": ModelConfig(layers=8, d_model=768, n_heads=12, d_ff=512, experts=8, top_k=2, vocab=16384, seq_len=1024,
                        batch=32),
    "tiny": ModelConfig(layers=2, d_model=64, n_heads=4, d_ff=64, experts=4, top_k=2, vocab=512, seq_len=32, batch=4),
}
# the defaults of options left out, per config: the tiny one runs in about a minute on 2 CPU cores
RUN_DEFAULTS = {"100m": dict(steps=300, max_corpus_chars=8_000_000),
                "tiny": dict(steps=200, max_corpus_chars=1_000_000)}


# ------------------------------------------------------------------------------------------------ the baseline
class TorchAttention(Attention):
    """The same layer in PyTorch ops: the rotary embedding, and attention through ``F.scaled_dot_product_attention``
    (cuDNN / flash on the GPU)."""

    def rotate(self, x, cos, sin):
        return apply_rotary_torch(x, cos, sin)

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.attention_options["causal"])


class TorchMoE(FusedMoE):
    """The same parameters, computed in PyTorch: routing in torch ops, then on the GPU the tokens sorted by expert
    and both expert GEMMs as ``torch._grouped_mm`` (static shapes: it compiles without graph breaks), on the CPU
    the per-expert loop of ``fused_experts_reference``."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, self.d_model)
        weights, ids = route_reference(self.router(x), self.top_k, self.renormalize, self.scoring)
        if not x.is_cuda:
            return fused_experts_reference(x, self.w1, self.w2, weights, ids).reshape(hidden_states.shape)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        gate_up = torch._grouped_mm(x[tokens], self.w1.transpose(1, 2), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offsets)
        y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, y).reshape(hidden_states.shape)


# --------------------------------------------------------------------------------------------------- the model
class GPT(nn.Module):
    def __init__(self, config: ModelConfig, impl: str):
        super().__init__()
        classes = dict(attention_class=TorchAttention, moe_class=TorchMoE) if impl == "torch" else {}
        self.embed = nn.Embedding(config.vocab, config.d_model)
        self.blocks = nn.ModuleList(
            TransformerBlock(config.d_model, config.n_heads, config.d_ff, num_experts=config.experts,
                             top_k=config.top_k, **classes) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.d_model, eps=1e-6)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return F.linear(self.norm(h), self.embed.weight)  # tied output projection


# ---------------------------------------------------------------------------------------------------- the data
def package_docstrings(packages: list[str], max_chars: int, progress: bool = True) -> str:
    """The docstrings of the installed `packages`' modules, classes and functions, file by file in sorted order,
    until `max_chars`."""
    pieces, total = [], 0
    with progress_bar(max_chars, "corpus", unit="char", enabled=progress, unit_scale=True) as bar:
        for package in packages:
            root = pathlib.Path(importlib.util.find_spec(package).submodule_search_locations[0])
            for path in sorted(root.rglob("*.py")):
                try:
                    tree = ast.parse(path.read_text(encoding="utf-8"))
                except (SyntaxError, UnicodeDecodeError, ValueError):
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        doc = ast.get_docstring(node)
                        if doc and len(doc) > 40:
                            pieces.append(doc)
                            total += len(doc) + 2
                bar.update(min(total, max_chars) - bar.n)
                if total >= max_chars:
                    return "\n\n".join(pieces)[:max_chars]
    return "\n\n".join(pieces)


def load_tokens(args, config: ModelConfig) -> tuple[np.ndarray, str]:
    """Token ids of the corpus (cached), and a line describing corpus and tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    versions = {p: importlib.metadata.version(p) for p in args.corpus_packages}
    key = hashlib.sha1(json.dumps([versions, args.max_corpus_chars, config.vocab]).encode()).hexdigest()[:12]
    cache = args.out / f"tokens-{key}.npy"
    about = (f"docstrings of {', '.join(f'{p} {v}' for p, v in versions.items())} (<= {args.max_corpus_chars} chars); "
             f"byte-level BPE, vocab {config.vocab}, trained on it")
    if cache.exists():
        return np.load(cache), about
    text = package_docstrings(args.corpus_packages, args.max_corpus_chars)
    print(f"training the tokenizer (byte-level BPE, vocab {config.vocab}) on {len(text):,} chars, then encoding",
          flush=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=config.vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    documents = text.split("\n\n")
    tokenizer.train_from_iterator(documents, trainer)
    ids = np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(documents)])
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / f"tokenizer-{key}.json"))
    np.save(cache, ids)
    return ids, about


def batches(ids: np.ndarray, config: ModelConfig, steps: int, seed: int, device):
    """(input, target) pairs of `steps` random windows, the same for every run with this seed."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(ids.astype(np.int64))
    for _ in range(steps):
        starts = torch.randint(0, len(data) - config.seq_len - 1, (config.batch,), generator=generator)
        window = torch.stack([data[s:s + config.seq_len + 1] for s in starts.tolist()]).to(device)
        yield window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------------------------------- training
def learning_rate(step: int, args) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))


def train(impl: str, compiled: bool, ids, config: ModelConfig, args, device, dtype) -> dict:
    torch.manual_seed(args.seed)
    model = GPT(config, impl).to(device=device, dtype=dtype)
    forward = torch.compile(model, backend=args.compile_backend, mode=args.compile_mode) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    name = f"{impl}{' compiled' if compiled else ''}"
    tokens_per_step = config.batch * config.seq_len
    records, timed_from = [], None
    bar = progress_bar(args.steps, name, unit="step")
    for step, (inputs, targets) in enumerate(batches(ids, config, args.steps, args.seed, device)):
        if step == args.warmup_steps:  # compilation and first-call costs stay out of tokens/s
            timed_from = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        logits = forward(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, config.vocab), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # synchronises: the clock below sees finished steps
        elapsed = time.perf_counter() - timed_from if timed_from is not None else 0.0
        speed = (step + 1 - args.warmup_steps) * tokens_per_step / elapsed if elapsed > 0 else float("nan")
        records.append(dict(run=name, impl=impl, compiled=compiled, step=step, loss=value,
                            lr=learning_rate(step, args), tokens_per_s=speed))
        bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{speed:,.0f}", refresh=False)
        bar.update(1)
    bar.close()
    last = [r["loss"] for r in records[-max(1, args.steps // 10):]]
    return dict(run=name, impl=impl, compiled=compiled, final_loss=float(np.mean(last)),
                tokens_per_s=records[-1]["tokens_per_s"], parameters=sum(p.numel() for p in model.parameters()),
                records=records)


def write_outputs(results: list[dict], args, about: str, config: ModelConfig, device) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "train_gpt_moe.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]["records"][0]))
        writer.writeheader()
        for result in results:
            writer.writerows(result["records"])
    summary = dict(config=asdict(config), corpus=about, device=str(device),
                   gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   torch=torch.__version__, steps=args.steps, seed=args.seed,
                   runs=[{k: v for k, v in r.items() if k != "records"} for r in results])
    by_run = {(r["impl"], r["compiled"]): r for r in results}
    for compiled in (False, True):
        ours, base = by_run.get(("ours", compiled)), by_run.get(("torch", compiled))
        if ours and base:
            tag = "compiled" if compiled else "eager"
            summary[f"{tag}_speedup"] = ours["tokens_per_s"] / base["tokens_per_s"]
            summary[f"{tag}_final_loss_rel_diff"] = abs(ours["final_loss"] / base["final_loss"] - 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["compiled"] for r in results})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, compiled in zip(axes[0], modes):
        for r in results:
            if r["compiled"] == compiled:
                ax.plot([x["step"] for x in r["records"]], [x["loss"] for x in r["records"]],
                        label=f"{r['impl']} ({r['tokens_per_s']:,.0f} tok/s)", linewidth=1)
        ax.set(title="torch.compile" if compiled else "eager", xlabel="step", ylabel="training loss")
        ax.legend()
    fig.suptitle(f"{config.layers} layers, d={config.d_model}, {config.experts} experts top-{config.top_k} "
                 f"({format_count(results[0]['parameters'])} parameters), {summary['gpu'] or device}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out / "loss.png", dpi=120)
    plt.close(fig)
    return summary


def format_count(n: int) -> str:
    """``107_000_000`` -> ``"107M"``, ``260_000`` -> ``"260K"``, ``2_630_000`` -> ``"2.63M"`` (3 significant digits)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="100m",
                        help="100m: ~100M parameters for a GPU; tiny: a minute on a CPU (default 100m)")
    parser.add_argument("--steps", type=int, help="training steps per run (default 300; 200 for tiny)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="steps left out of tokens/s (default: 10%% of --steps, at least 1)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and batches (default 0)")
    parser.add_argument("--runs", default="ours,torch", help="comma-separated: ours, torch")
    parser.add_argument("--compile", default="off,on", help="comma-separated: off, on")
    parser.add_argument("--compile-backend", help="torch.compile backend (default inductor on a GPU, aot_eager on "
                        "the CPU, which traces the same graph without minutes of C++ compilation)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default cuda if available)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the tiny config's "
                        "small matrix products gain little from more, and several threads slow down many times over "
                        "when other processes share the cores)")
    parser.add_argument("--corpus-packages", default="numpy,torch", type=lambda s: s.split(","),
                        help="installed packages whose docstrings form the corpus (default numpy,torch)")
    parser.add_argument("--max-corpus-chars", type=int,
                        help="corpus size in characters (default 8,000,000; 1,000,000 for tiny)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/train_gpt_moe"),
                        help="output folder; the corpus, tokenizer and token ids are cached there")
    args = parser.parse_args(argv)
    try:
        check_device_option(args.device)
    except ValueError as error:  # one line, before the corpus and tokenizer are built
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    for name, value in RUN_DEFAULTS[args.config].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.compile_backend is None:
        args.compile_backend = "inductor" if args.device.startswith("cuda") else "aot_eager"
    if args.steps < 1 or args.threads < 1:
        parser.error(f"--steps and --threads must be at least 1, got {args.steps} and {args.threads}")
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 10)
    if not 0 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps}")
    for name, allowed in (("runs", {"ours", "torch"}), ("compile", {"off", "on"})):
        values = getattr(args, name).split(",")
        if not values or set(values) - allowed:
            parser.error(f"--{name} takes a comma-separated subset of {sorted(allowed)}, got {getattr(args, name)!r}")
        setattr(args, name, values)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args) -> dict:
    config, device = CONFIGS[args.config], torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ids, about = load_tokens(args, config)
    print(f"corpus: {about}; {len(ids):,} tokens")
    results = [train(impl, mode == "on", ids, config, args, device, dtype)
               for mode in args.compile for impl in args.runs]
    summary = write_outputs(results, args, about, config, device)
    for run_summary in summary["runs"]:
        print(f"{run_summary['run']:>15}: final loss {run_summary['final_loss']:.4f}, "
              f"{run_summary['tokens_per_s']:,.0f} tokens/s")
    for key in ("eager_speedup", "compiled_speedup", "eager_final_loss_rel_diff", "compiled_final_loss_rel_diff"):
        if key in summary:
            print(f"{key}: {summary[key]:.4f}")
    return summary


if __name__ == "__main__":
    main()
