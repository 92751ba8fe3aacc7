"""``flashmoe-science supercon train | baselines | screen | bench``: the superconductor Tc workload from the command
line.

    flashmoe-science supercon train  --quick --out runs/supercon     # both splits in minutes on a CPU
    flashmoe-science supercon baselines --out runs/supercon/baselines --ours runs/supercon  # needs .[science]
    flashmoe-science supercon screen --model runs/supercon/random/model.pt --out runs/supercon/screen --top 100 \\
        --limit 200000
    flashmoe-science supercon bench  --model runs/supercon/random/model.pt --quick

The SuperCon data ship with the package (``--data`` reads another CSV). ``train`` and ``screen`` save their state
every minute and on Ctrl-C; the same command again resumes, ``--restart`` starts over. Problems with the input are
one :class:`~flashmoe_science.errors.CommandError` line.
"""

from __future__ import annotations

import argparse
import csv
import functools
import gzip
import json
import sys
from pathlib import Path

import torch

from flashmoe_science.bench.report import DEFAULT_OUT, check_out_dir
from flashmoe_science.errors import CommandError
from flashmoe_science.science.checkpoint import Interrupted
from flashmoe_science.science.supercon_data import (
    CONFLICT_DISTANCE,
    CONFLICT_TC_K,
    DEFAULT_SPLITS,
    LABEL_SETS,
    SPLITS,
    curate_labels,
    load_supercon,
)
from flashmoe_science.science.supercon_model import IMPLEMENTATIONS, ModelConfig, default_implementation
from flashmoe_science.science.supercon_trees import science_modules

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EXIT_INTERRUPTED = 130  # the shell's code for a command stopped by Ctrl-C (128 + SIGINT)

# train: (full run, --quick) defaults of the options left out; --quick trains both splits in minutes on 2 CPU cores
TRAIN_DEFAULTS = {
    "epochs": (60, 12), "batch_size": (256, 256), "lr": (2e-3, 3e-3),
    "d_model": (ModelConfig.d_model, 64), "heads": (ModelConfig.num_heads, 4), "layers": (ModelConfig.num_layers, 2),
    "experts": (ModelConfig.num_experts, 4), "top_k": (ModelConfig.top_k, 2), "d_ff": (ModelConfig.d_ff, 128),
}
SCREEN_QUICK_LIMIT = 100_000
# screen and bench: (GPU, CPU) defaults
BATCH_SIZE = (65536, 8192)
DTYPE = ("bfloat16", "float32")


def _device(name: str | None) -> torch.device:
    """The torch device of ``--device`` (default: cuda if available, else cpu), checked by placing an empty tensor
    on it, so a device this torch or machine lacks fails here in one line rather than after the data has loaded."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise CommandError(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise CommandError(f"--device {name}: the supercon commands run on cpu or cuda (cuda:N)")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # a CPU-only torch raises AssertionError for cuda
        cuda = (f"torch {torch.__version__} has no CUDA support" if torch.version.cuda is None
                else f"{torch.cuda.device_count()} CUDA device(s) found")
        raise CommandError(f"--device {name}: not usable here ({cuda}; {str(error).splitlines()[0][:100]}); "
                           "leave --device out to use the CPU") from None
    return device


def _per_device(device: torch.device, choices: tuple):
    return choices[0] if device.type == "cuda" else choices[1]


def _check_at_least(**options) -> None:
    """``name=(value, minimum)``: a CommandError naming the first option below its minimum (None: not given)."""
    for name, (value, minimum) in options.items():
        if value is not None and value < minimum:
            raise CommandError(f"--{name.replace('_', '-')} must be at least {minimum}, got {value}")


def _load_data(args: argparse.Namespace, minimum_rows: int, purpose: str, labels: str = "raw"):
    """The data of ``--data`` (default: the packaged SuperCon CSV), with at least ``minimum_rows`` readable rows;
    ``labels="curated"``: the consistent-label variant of :func:`curate_labels`."""
    source = args.data or "the packaged SuperCon data"
    try:
        data, table = load_supercon(args.data, limit=args.rows)
    except FileNotFoundError:
        raise CommandError(f"no such data file: {args.data} (leave out --data to use the packaged SuperCon "
                           "data)") from None
    except (ValueError, UnicodeDecodeError, gzip.BadGzipFile, csv.Error) as error:
        raise CommandError(f"{args.data} is not a CSV with columns name,Tc ({str(error).splitlines()[0][:120]})"
                           ) from None
    print(f"{source}: {table.summary()}", flush=True)
    if labels == "curated":
        data, changes = curate_labels(data)
        print(f"curated labels: {changes['merged_rows']} rows of {changes['merged_groups']} repeated compositions "
              f"merged (median Tc), {changes['conflicting_rows']} rows of conflicting near-duplicates (0 K within "
              f"L1 {CONFLICT_DISTANCE} of >= {CONFLICT_TC_K:g} K) left out: {len(data)} compositions", flush=True)
    if len(data) < minimum_rows:
        read = f"the first {args.rows} rows of {source}" if args.rows is not None else source
        curated = " after --labels curated" if labels == "curated" else ""
        raise CommandError(f"{read} hold {len(data)} readable compositions{curated} ({len(table.rejected)} rejected); "
                           f"{purpose} needs at least {minimum_rows}: "
                           + ("use a larger --rows or leave it out" if args.rows is not None
                              else "use a CSV with more valid name,Tc rows"))
    return data


SPLITS_HELP = ("comma-separated: random (rows shuffled), family (whole chemical systems held out), superconductors "
               "(the rows with Tc > 0 shuffled); default random,family")


def _splits(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in SPLITS for name in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list from {', '.join(SPLITS)}; got {text!r}")
    return names


def _command(handler):
    """Runs a command with ``--threads`` torch CPU threads (restored afterwards); after Ctrl-C, once its state is
    saved, prints one line on how to resume and returns exit code 130."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        _check_at_least(threads=(args.threads, 1))
        check_out_dir(args.out)  # a bad --out fails now, not when the first result is saved
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            return handler(args)
        except Interrupted as stop:
            print(f"interrupted: state saved to {stop.path}; run the same command again to resume "
                  "(--restart starts over)", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        finally:
            torch.set_num_threads(threads)

    return run


# ---------------------------------------------------------------------------------------------------------- train
def _train_options(args: argparse.Namespace) -> dict:
    """The train options, each the given value or its full/--quick default."""
    options = {name: getattr(args, name) if getattr(args, name) is not None else defaults[int(args.quick)]
               for name, defaults in TRAIN_DEFAULTS.items()}
    _check_at_least(forest_trees=(args.forest_trees, 1), epochs=(options["epochs"], 1),
                    batch_size=(options["batch_size"], 1), d_model=(options["d_model"], 1), heads=(options["heads"], 1), layers=(options["layers"], 1),
                    experts=(options["experts"], 1), top_k=(options["top_k"], 1), d_ff=(options["d_ff"], 1),
                    rows=(args.rows, 1))
    if options["lr"] <= 0:
        raise CommandError(f"--lr must be positive, got {options['lr']}")
    if options["d_model"] % options["heads"]:
        raise CommandError(f"--d-model ({options['d_model']}) must be a multiple of --heads ({options['heads']})")
    if options["top_k"] > options["experts"]:
        raise CommandError(f"--top-k ({options['top_k']}) must be at most --experts ({options['experts']})")
    return options


def run_train(args: argparse.Namespace) -> int:
    from flashmoe_science.science.supercon_train import (
        CHECKPOINT_FILE,
        MIN_ROWS,
        TrainConfig,
        finished_run,
        run_settings,
        train,
    )

    options = _train_options(args)
    device = _device(args.device)
    if args.members:  # the tree members need the [science] extra: say so before anything trains
        science_modules()
    data = _load_data(args, MIN_ROWS, "training", args.labels)
    model_config = ModelConfig(d_model=options["d_model"], num_heads=options["heads"], num_layers=options["layers"],
                               num_experts=options["experts"], top_k=options["top_k"], d_ff=options["d_ff"])
    out = Path(args.out)
    summary = {}
    for split in args.splits:
        config = TrainConfig(epochs=options["epochs"], batch_size=options["batch_size"], lr=options["lr"],
                             seed=args.seed, split=split, implementation=args.implementation, model=model_config,
                             members=tuple(args.members), forest_trees=args.forest_trees)
        implementation = args.implementation or default_implementation(device)
        metrics = None if args.restart else finished_run(out / split, run_settings(config, implementation, data))
        if metrics is not None:
            print(f"{split} split: already trained in {out / split} (--restart trains again)", flush=True)
        else:
            if not args.restart and (out / split / CHECKPOINT_FILE).is_file():
                print(f"{split} split: resuming from {out / split / CHECKPOINT_FILE}", flush=True)
            _, metrics = train(data, config, device, out / split, progress=not args.no_progress,
                               restart=args.restart)
        for name, member in metrics["members"].items():
            print(f"  {name}: blend weight {member['weight']:.2f}, alone: test R2 = {member['test']['r2']:.4f}, "
                  f"MAE = {member['test']['mae_K']:.2f} K", flush=True)
        test = metrics["test"]
        print(f"{split} split (seed {args.seed}): test R2 = {test['r2']:.4f} (of log(1+Tc): {test['r2_log1p']:.4f}), "
              f"MAE = {test['mae_K']:.2f} K, RMSE = {test['rmse_K']:.2f} K, n = {test['n']} "
              f"({metrics['train_seconds']:.0f} s, {metrics['implementation']} build on {metrics['device']}) "
              f"-> {out / split}", flush=True)
        summary[split] = {key: metrics[key] for key in ("test", "sizes", "seed", "implementation", "train_seconds")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


# ------------------------------------------------------------------------------------------------------ baselines
def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        seeds = []
    if not seeds:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 0,1,2; got {text!r}")
    return seeds


def _members(text: str) -> list[str]:
    from flashmoe_science.science.supercon_trees import MEMBERS

    if text.strip() == "none":
        return []
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in MEMBERS for name in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected none or a comma-separated list of distinct names from "
                                         f"{', '.join(MEMBERS)}; got {text!r}")
    return names


def _models(text: str) -> list[str]:
    from flashmoe_science.science.supercon_baselines import BASELINES

    if text.strip() == "none":
        return []
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in BASELINES for name in names):
        raise argparse.ArgumentTypeError(f"expected none or a comma-separated list from {', '.join(BASELINES)}; "
                                         f"got {text!r}")
    return names


def run_baselines(args: argparse.Namespace) -> int:
    from flashmoe_science.science.supercon_baselines import (
        BASELINES,
        read_earlier,
        read_ours,
        run_baselines,
        write_results,
    )
    from flashmoe_science.science.supercon_train import MIN_ROWS

    _check_at_least(rows=(args.rows, 1), trees=(args.trees, 1))
    earlier = read_earlier(Path(args.include)) if args.include else []
    ours = read_ours(Path(args.ours)) if args.ours else []
    if ours:  # the new runs of the model replace an earlier file's
        earlier = [record for record in earlier if record["model"] in BASELINES]
    models = list(BASELINES) if args.models is None else args.models
    records = []
    if models:
        science_modules()  # before the data loads: a missing [science] extra is the first thing said
        data = _load_data(args, MIN_ROWS, "the baselines", args.labels)
        records = run_baselines(data, args.splits, args.seeds, models, trees=args.trees, threads=args.threads,
                                progress=not args.no_progress)
    settings = {"splits": args.splits, "seeds": args.seeds, "models": models, "trees": args.trees,
                "rows": args.rows, "data": args.data or "packaged", "labels": args.labels, "ours": args.ours,
                "include": args.include}
    path, table = write_results(earlier + ours + records, args.splits, Path(args.out), settings)
    print(table)
    print(f"\nresults: {path} (and {path.with_suffix('.md').name})")
    return 0


# ------------------------------------------------------------------------------------------------ screen, bench
def _model(args: argparse.Namespace, device: torch.device):
    """The trained model of ``--model``, read before any heavy work (a wrong file fails in a second)."""
    from flashmoe_science.science.supercon_train import load_model

    return load_model(args.model, device)


def _space(args: argparse.Namespace, device: torch.device):
    from flashmoe_science.science.supercon_screen import CandidateSpace, dopant_elements

    _check_at_least(rows=(args.rows, 1), min_dopant_count=(args.min_dopant_count, 1))
    data = _load_data(args, 1, "screening")
    keep = torch.nonzero(data.targets >= args.min_parent_tc).flatten()
    if keep.numel() == 0:
        raise CommandError(f"no composition has Tc >= {args.min_parent_tc} K (the largest is "
                           f"{float(data.targets.max()):.1f} K): lower --min-parent-tc")
    dopants = dopant_elements(data, args.min_dopant_count)
    if dopants.numel() == 0:
        raise CommandError(f"no element occurs in {args.min_dopant_count} compositions: lower --min-dopant-count")
    parents = data.subset(keep)
    space = CandidateSpace(parents, dopants, device=device)
    print(f"candidate space: {len(space):,} substitutions over {len(parents):,} parent compositions "
          f"(Tc >= {args.min_parent_tc} K)", flush=True)
    return data, space


def run_screen(args: argparse.Namespace) -> int:
    from flashmoe_science.science.supercon_screen import screen

    device = _device(args.device)
    limit = args.limit if args.limit is not None or not args.quick else SCREEN_QUICK_LIMIT
    batch_size = args.batch_size or _per_device(device, BATCH_SIZE)
    _check_at_least(top=(args.top, 1), limit=(limit, 1), batch_size=(batch_size, 1), mc_samples=(args.mc_samples, 0))
    dtype = args.dtype or _per_device(device, DTYPE)
    model = _model(args, device).cast_parameters(DTYPES[dtype])
    data, space = _space(args, device)
    implementation = args.implementation or default_implementation(device)
    summary = screen(model, space, top=args.top, batch_size=batch_size, implementation=implementation,
                     mc_samples=args.mc_samples, limit=limit, out_dir=Path(args.out), restart=args.restart,
                     progress=not args.no_progress, known=data)
    print(f"screened {summary['candidates']:,} candidates in {summary['seconds']:.1f} s "
          f"({summary['candidates_per_s']:,.0f}/s, {implementation} build, {dtype}); "
          f"{summary['screened_total']:,} in all; top {args.top}: {summary['top_csv']} (with each one's parent, "
          f"substitution and nearest known composition); distribution: {summary['plot']}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from flashmoe_science.science.supercon_bench import QUICK_SIZES, BenchSizes, run_benchmark

    device = _device(args.device)
    sizes = QUICK_SIZES if args.quick else BenchSizes(batch_size=_per_device(device, BATCH_SIZE))
    sizes = replace(sizes, **{name: value for name, value in (("candidates", args.candidates),
                                                              ("batch_size", args.batch_size)) if value is not None})
    _check_at_least(candidates=(sizes.candidates, 1), batch_size=(sizes.batch_size, 1),
                    train_batch_size=(args.train_batch_size, 1), mc_samples=(args.mc_samples, 0))
    dtype = args.dtype or _per_device(device, DTYPE)
    model = _model(args, device)
    data, space = _space(args, device)
    if device.type != "cuda" and not args.quick:
        print("note: full-size benchmark on a CPU (hours); --quick measures both builds in a minute or two",
              flush=True)
    path, table = run_benchmark(model, data, space, sizes=sizes, train_batch_size=args.train_batch_size,
                                mc_samples=args.mc_samples, dtype=DTYPES[dtype], out_dir=Path(args.out),
                                progress=not args.no_progress)
    print(table)
    print(f"\nresults: {path} (and {path.with_suffix('.md').name})")
    return 0


# ------------------------------------------------------------------------------------------------------ parser
def _common(parser: argparse.ArgumentParser, model: bool = True) -> None:
    """The options every supercon command has; ``model``: also --device and --quick (the commands that run the
    model)."""
    parser.add_argument("--data", help="a CSV with columns name,Tc (gzip if it ends in .gz) instead of the SuperCon "
                        "data packaged with flashmoe-science (16,406 compositions)")
    parser.add_argument("--rows", type=int, help="read only the first N rows of the data (quick trials)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (results still print)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads, and the baselines' worker threads (default 1: the model's small "
                        "matrix products gain little from more, and several threads slow down many times over when "
                        "other processes share the cores)")
    if model:
        parser.add_argument("--device", help="torch device, e.g. cpu or cuda:0 (default: cuda if available, else "
                            "cpu)")
        parser.add_argument("--quick", action="store_true", help="sized for a CPU: minutes, not hours (options "
                            "given explicitly still apply)")


def _labels(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--labels", choices=LABEL_SETS, default="raw",
                        help="raw: every row as published (default); curated: repeated compositions merged at their "
                        f"median Tc and the pairs of compositions within L1 {CONFLICT_DISTANCE} (element fractions) "
                        f"labelled 0 K and >= {CONFLICT_TC_K:g} K left out, before the splits (a dataset variant: "
                        "compare only runs of the same labels)")


def _implementation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--implementation", choices=IMPLEMENTATIONS,
                        help="fused: packed varlen attention + fused_moe; plain: padding + SDPA + per-expert loop "
                        "(default: fused on a GPU, plain on the CPU)")


def _screening(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="the model.pt that `supercon train` wrote, e.g. "
                        "runs/supercon/random/model.pt")
    parser.add_argument("--batch-size", type=int, help=f"candidates per batch (default {BATCH_SIZE[0]} on a GPU, "
                        f"{BATCH_SIZE[1]} on the CPU; bench --quick: 4096)")
    parser.add_argument("--mc-samples", type=int, default=8,
                        help="MC-dropout head samples per candidate, for its uncertainty (default 8; 0: none)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help=f"model dtype (default {DTYPE[0]} on a GPU, "
                        f"{DTYPE[1]} on the CPU)")
    parser.add_argument("--min-parent-tc", type=float, default=0.0,
                        help="parents: data compositions with Tc >= this (K, default 0: all)")
    parser.add_argument("--min-dopant-count", type=int, default=20,
                        help="dopants: elements in at least this many data compositions (default 20)")


def _help(name: str, text: str) -> str:
    full, quick = TRAIN_DEFAULTS[name]
    return f"{text} (default {full}" + (f"; {quick} with --quick)" if quick != full else ")")


def add_supercon_parser(commands) -> None:
    """Adds ``supercon`` (with train, baselines, screen, bench) to the ``flashmoe-science`` subcommands."""
    supercon = commands.add_parser("supercon", help="superconductor Tc model: train, screen candidates, benchmark",
                                   description=__doc__.split("\n\n")[0])
    actions = supercon.add_subparsers(dest="action", metavar="{train,baselines,screen,bench}", required=True)

    train = actions.add_parser("train", help="train on the random and the held-out-family splits",
                               description="Trains the composition transformer on each split; writes model.pt, "
                               "metrics.json, parity.png and loss.png per split under --out. Saves its state every "
                               "minute and on Ctrl-C: the same command again resumes.")
    _common(train)
    _labels(train)
    _implementation(train)
    train.add_argument("--out", required=True, help="output folder (one subfolder per split); a rerun with the same "
                       "--out resumes or reuses what is there")
    train.add_argument("--restart", action="store_true", help="start over, ignoring checkpoints and finished runs "
                       "in --out")
    train.add_argument("--splits", type=_splits, default=list(DEFAULT_SPLITS), help=SPLITS_HELP)
    train.add_argument("--seed", type=int, default=0, help="seed of the split, the initial weights and the batch "
                       "order (default 0)")
    train.add_argument("--epochs", type=int, help=_help("epochs", "passes over the training rows"))
    train.add_argument("--batch-size", type=int, help=_help("batch_size", "compositions per training step"))
    train.add_argument("--lr", type=float, help=_help("lr", "peak AdamW learning rate (warm-up, then cosine decay)"))
    train.add_argument("--d-model", type=int, help=_help("d_model", "token width"))
    train.add_argument("--heads", type=int, help=_help("heads", "attention heads (must divide --d-model)"))
    train.add_argument("--layers", type=int, help=_help("layers", "transformer blocks"))
    train.add_argument("--experts", type=int, help=_help("experts", "MoE experts per block"))
    train.add_argument("--top-k", type=int, help=_help("top_k", "experts per token"))
    train.add_argument("--d-ff", type=int, help=_help("d_ff", "hidden width of each expert"))
    train.add_argument("--members", type=_members, default=["extra_trees", "lightgbm"],
                       help="tree models trained beside the transformer on the composition features and blended "
                       "with it (weights fitted on the validation rows): comma-separated from extra_trees, lightgbm "
                       "(default both; needs pip install -e \".[science]\"); none: the transformer alone")
    train.add_argument("--forest-trees", type=int, default=100, help="trees of the extra-trees member (default 100)")
    train.set_defaults(handler=_command(run_train))

    baselines = actions.add_parser("baselines", help="kNN, random forest, extra trees, LightGBM on the same splits",
                                   description="Trains the classical baselines on the model's features and splits "
                                   "(needs pip install -e \".[science]\") and writes the results as JSON and a "
                                   "markdown table (with --ours: beside the model's runs) under --out.")
    _common(baselines, model=False)
    _labels(baselines)
    baselines.add_argument("--out", required=True, help="results folder (supercon-baselines-*.json and .md; "
                           "benchmarks/results publishes the run)")
    baselines.add_argument("--splits", type=_splits, default=list(SPLITS), help=SPLITS_HELP.replace(
        "default random,family", "default all three"))
    baselines.add_argument("--seeds", type=_seeds, default=[0, 1, 2], help="split seeds, comma-separated "
                           "(default 0,1,2)")
    baselines.add_argument("--models", type=_models, default=None,
                           help="comma-separated from knn, random_forest, extra_trees, lightgbm (default all; "
                           "none: only tabulate --ours and --include)")
    baselines.add_argument("--trees", type=int, default=300, help="trees per forest (default 300)")
    baselines.add_argument("--ours", help="a folder of `supercon train` runs (one per seed, e.g. "
                           "runs/supercon/seed0, ...): their test metrics join the table")
    baselines.add_argument("--include", help="an earlier supercon-baselines-*.json: its records join the table "
                           "(the baselines measured once, beside new --ours runs, which replace its own)")
    baselines.set_defaults(handler=_command(run_baselines))

    screen = actions.add_parser("screen", help="score the substitution candidates, write the top N as CSV",
                                description="Scores partial substitutions of the known compositions with a trained "
                                "model and writes the best as top.csv under --out. Saves its state every minute and "
                                "on Ctrl-C: the same command again resumes.")
    _common(screen)
    _implementation(screen)
    _screening(screen)
    screen.add_argument("--out", required=True, help="output folder (top.csv, screen_summary.json, the state)")
    screen.add_argument("--restart", action="store_true", help="start over, ignoring the state saved in --out")
    screen.add_argument("--top", type=int, default=1000, help="how many distinct formulas to keep (default 1000)")
    screen.add_argument("--limit", type=int, help="screen only the first N candidates (default: all, tens of "
                        f"millions; {SCREEN_QUICK_LIMIT:,} with --quick)")
    screen.set_defaults(handler=_command(run_screen))

    bench = actions.add_parser("bench", help="screening and training speed, library vs plain build",
                               description="Times screening and training steps of the library build against the "
                               "plain-PyTorch build on the same weights and checks that their outputs agree.")
    _common(bench)
    _screening(bench)
    bench.add_argument("--out", default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT}/)")
    bench.add_argument("--candidates", type=int, help="candidates per timed screening run (default 2,000,000; "
                       "8192 with --quick)")
    bench.add_argument("--train-batch-size", type=int, default=256,
                       help="compositions per timed training step (default 256)")
    bench.set_defaults(handler=_command(run_bench))
