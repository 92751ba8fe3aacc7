"""``flashmoe-science supercon train | screen | bench``: the superconductor Tc workload from the command line.

    flashmoe-science supercon train  --out runs/supercon              # random and family splits, metrics and plots
    flashmoe-science supercon screen --model runs/supercon/random/model.pt --out runs/supercon/screen --top 1000
    flashmoe-science supercon bench  --model runs/supercon/random/model.pt --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flashmoe_science.science.supercon_data import DEFAULT_DATA, SPLITS, load_supercon
from flashmoe_science.science.supercon_model import IMPLEMENTATIONS, ModelConfig, default_implementation

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def _load_data(args: argparse.Namespace):
    data, table = load_supercon(args.data, limit=args.rows)
    print(table.summary(), flush=True)
    return data


def _splits(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in SPLITS for name in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list from {', '.join(SPLITS)}; got {text!r}")
    return names


def run_train(args: argparse.Namespace) -> int:
    from flashmoe_science.science.supercon_train import TrainConfig, train

    device = _device(args.device)
    data = _load_data(args)
    model_config = ModelConfig(d_model=args.d_model, num_heads=args.heads, num_layers=args.layers,
                               num_experts=args.experts, top_k=args.top_k, d_ff=args.d_ff)
    summary = {}
    for split in args.splits:
        config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed, split=split,
                             implementation=args.implementation, model=model_config)
        _, metrics = train(data, config, device, Path(args.out) / split, progress=not args.no_progress)
        test = metrics["test"]
        print(f"{split} split (seed {args.seed}): test R2 = {test['r2']:.4f} (of log(1+Tc): {test['r2_log1p']:.4f}), "
              f"MAE = {test['mae_K']:.2f} K, "
              f"RMSE = {test['rmse_K']:.2f} K, n = {test['n']} ({metrics['train_seconds']:.0f} s, "
              f"{metrics['implementation']} build on {device}) -> {Path(args.out) / split}", flush=True)
        summary[split] = {key: metrics[key] for key in ("test", "sizes", "seed", "implementation", "train_seconds")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _space(args: argparse.Namespace, device: torch.device):
    from flashmoe_science.science.supercon_screen import CandidateSpace, dopant_elements

    data = _load_data(args)
    keep = torch.nonzero(data.targets >= args.min_parent_tc).flatten()
    parents = data.subset(keep)
    space = CandidateSpace(parents, dopant_elements(data, args.min_dopant_count), device=device)
    print(f"candidate space: {len(space):,} substitutions over {len(parents):,} parent compositions "
          f"(Tc >= {args.min_parent_tc} K)", flush=True)
    return data, space


def run_screen(args: argparse.Namespace) -> int:
    from flashmoe_science.science.supercon_screen import screen
    from flashmoe_science.science.supercon_train import load_model

    device = _device(args.device)
    _, space = _space(args, device)
    model = load_model(args.model, device).cast_parameters(DTYPES[args.dtype])
    implementation = args.implementation or default_implementation(device)
    summary = screen(model, space, top=args.top, batch_size=args.batch_size, implementation=implementation,
                     mc_samples=args.mc_samples, limit=args.limit, out_dir=Path(args.out), resume=args.resume,
                     progress=not args.no_progress)
    print(f"screened {summary['candidates']:,} candidates in {summary['seconds']:.1f} s "
          f"({summary['candidates_per_s']:,.0f}/s, {implementation} build); top {args.top}: {summary['top_csv']}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from flashmoe_science.science.supercon_bench import run_benchmark
    from flashmoe_science.science.supercon_train import load_model

    device = _device(args.device)
    data, space = _space(args, device)
    model = load_model(args.model, device)
    path, table = run_benchmark(model, data, space, candidates=args.candidates, batch_size=args.batch_size,
                                train_batch_size=args.train_batch_size, mc_samples=args.mc_samples,
                                dtype=DTYPES[args.dtype], out_dir=Path(args.out))
    print(table)
    print(f"\nresults: {path} (and {path.with_suffix('.md').name})")
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=str(DEFAULT_DATA), help=f"SuperCon CSV (name,Tc; default {DEFAULT_DATA})")
    parser.add_argument("--rows", type=int, help="read only the first N data rows (quick runs, tests)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _implementation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--implementation", choices=IMPLEMENTATIONS,
                        help="fused: packed varlen attention + fused_moe; plain: padding + SDPA + per-expert loop "
                        "(default: fused on a GPU, plain on the CPU)")


def _screening(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model.pt written by `supercon train`")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--batch-size", type=int, default=65536, help="candidates per batch (default 65536)")
    parser.add_argument("--mc-samples", type=int, default=8, help="MC-dropout head samples per candidate (default 8)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="model dtype (default bfloat16)")
    parser.add_argument("--min-parent-tc", type=float, default=0.0,
                        help="parents: data compositions with Tc >= this (K, default 0: all)")
    parser.add_argument("--min-dopant-count", type=int, default=20,
                        help="dopants: elements in at least this many data compositions (default 20)")


def add_supercon_parser(commands) -> None:
    """Adds ``supercon`` (with train, screen, bench) to the ``flashmoe-science`` subcommands."""
    supercon = commands.add_parser("supercon", help="superconductor Tc model: train, screen candidates, benchmark")
    actions = supercon.add_subparsers(dest="action", metavar="{train,screen,bench}", required=True)

    train = actions.add_parser("train", help="train on the random and the held-out-family splits")
    _common(train)
    _implementation(train)
    train.add_argument("--out", required=True, help="output folder (one subfolder per split)")
    train.add_argument("--splits", type=_splits, default=list(SPLITS), help="random,family (default both)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--epochs", type=int, default=60)
    train.add_argument("--batch-size", type=int, default=256)
    train.add_argument("--lr", type=float, default=2e-3)
    defaults = ModelConfig()
    train.add_argument("--d-model", type=int, default=defaults.d_model)
    train.add_argument("--heads", type=int, default=defaults.num_heads)
    train.add_argument("--layers", type=int, default=defaults.num_layers)
    train.add_argument("--experts", type=int, default=defaults.num_experts)
    train.add_argument("--top-k", type=int, default=defaults.top_k)
    train.add_argument("--d-ff", type=int, default=defaults.d_ff)
    train.set_defaults(handler=run_train)

    screen = actions.add_parser("screen", help="score the substitution candidates, write the top N as CSV")
    _common(screen)
    _implementation(screen)
    _screening(screen)
    screen.add_argument("--top", type=int, default=1000, help="how many to keep (default 1000)")
    screen.add_argument("--limit", type=int, help="screen only the first N candidates")
    screen.add_argument("--resume", action="store_true", help="continue from <out>/screen_state.pt")
    screen.set_defaults(handler=run_screen)

    bench = actions.add_parser("bench", help="screening and training speed, library vs plain build")
    _common(bench)
    _screening(bench)
    bench.add_argument("--candidates", type=int, default=2_000_000, help="candidates per timed run (default 2M)")
    bench.add_argument("--train-batch-size", type=int, default=256)
    bench.set_defaults(handler=run_bench)
