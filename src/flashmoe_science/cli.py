"""flashmoe-science: fast, exact attention and Mixture-of-Experts kernels for PyTorch, from the command line.

Commands:
  info                     this machine: GPU, versions, which kernels can run here, and which one a sample
                           attention call takes and why; each integration's framework and whether it is in range
  bench [attention]        our attention against every SDPA backend and FlexAttention (TFLOP/s, ms, memory);
                           on a CPU a small smoke test (the PyTorch reference against SDPA), not a speed claim
  bench moe                the MoE layer against a loop over experts and torch._grouped_mm
  bench decode             KV-cache decode bandwidth (GPU only)
  bench --suite varlen,window,mods,packed,mask-mods   packed sequences and masks against SDPA/Flex/FA3/FA4
  bench --suite distributed          ring attention / expert-parallel MoE scaling (under torchrun)
  bench --suite ladder               every rung of attention.ladder, from the CPU loop to the Gluon kernel
  warmup --hf-config DIR --seq-len L       compile a model's attention kernels before its job (Triton's cache)
  supercon train|screen|bench|baselines   the superconductor critical-temperature model and its baselines

Examples:
  flashmoe-science info
  flashmoe-science bench                          # results in ./flashmoe-results/
  flashmoe-science bench --pass fwd,bwd --rounds 5 --out benchmarks/results

Errors print one line (exit status 2); `flashmoe-science --debug ...` shows the full traceback instead.
`bench` prints a table, writes `<out>/<gpu>-<date>-<commit>.json` and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from importlib import metadata

import torch

from flashmoe_science.bench import attention as attention_bench
from flashmoe_science.bench.moe import MODELS as MOE_MODELS
from flashmoe_science.bench.report import (
    DEFAULT_OUT,
    PartialResults,
    Progress,
    check_out_dir,
    environment_metadata,
    gpu_properties,
    noise_note,
    records_table,
    resolve_commit,
    software_versions,
    write_results,
)
from flashmoe_science.errors import CommandError

PROG = "flashmoe-science"
PUBLISHED_OUT = "benchmarks/results"
DEFAULT_ROUNDS = 3
INFO_SAMPLE_SHAPE = (2, 8, 1024, 64)  # (B, H, L, D) of the call `info` describes
# MoE table rows: the fields present among these, in this order ("model": a name such as "mixtral-8x7b")
MOE_ROW_FIELDS = ("model", "E", "top_k", "d_model", "d_ff", "T", "pass", "timing")
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
# optional modules -> the extra of pyproject.toml that installs them
EXTRAS = {"tqdm": "cli", "matplotlib": "cli", "tokenizers": "demo", "transformers": "hf"}


def require_extra(*modules: str) -> None:
    """A CommandError naming the `pip install` that brings ``modules`` when one of them is not installed."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            raise CommandError(_missing_extra_message(name))


def _missing_extra_message(module: str) -> str:
    return f'{module} is not installed: pip install "flashmoe-science[{EXTRAS[module]}]"'


# --------------------------------------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------------------------------------
def _package_version() -> str:
    try:
        return metadata.version("flashmoe-science")
    except metadata.PackageNotFoundError:  # running from a source tree (PYTHONPATH=src)
        import flashmoe_science

        return flashmoe_science.__version__


def _print_key_values(pairs: list[tuple[str, object]]) -> None:
    width = max(len(key) for key, _ in pairs)
    for key, value in pairs:
        print(f"{key.ljust(width)}  {'n/a' if value is None else value}")


def kernels_here() -> str:
    """Which kernel families `backend="auto"` can run on this machine, in one line."""
    from flashmoe_science.device import triton_interpreter_on

    if not torch.cuda.is_available():
        if triton_interpreter_on():
            return ("the PyTorch reference (backend='auto' on CPU tensors); the Triton kernels through the "
                    "interpreter (TRITON_INTERPRET=1 is set: backend='triton', slow, for tests)")
        return ("the PyTorch reference (backend='auto' on CPU tensors); the Triton kernels only under "
                "TRITON_INTERPRET=1 (an interpreter, for tests); the GPU kernels need a CUDA GPU")
    from flashmoe_science.architectures import ARCHITECTURES
    from flashmoe_science.device import current_traits

    arch = current_traits().arch
    here = [f"the {a.title}" for a in ARCHITECTURES if a.arch == arch]
    elsewhere = "; ".join(f"the {a.title} need {a.arch}" for a in ARCHITECTURES if a.arch != arch)
    portable = f"the portable Triton kernels ({arch}{'; ' + elsewhere if elsewhere else ''})" if not here \
        else "the portable Triton kernels"
    return f"{', '.join([*here, portable])} and the reference"


def architecture_lines() -> list[tuple[str, str]]:
    """One line per architecture's own kernels (architectures.ARCHITECTURES): whether they run here, on this GPU
    first, then on this triton."""
    from flashmoe_science.architectures import ARCHITECTURES
    from flashmoe_science.device import current_traits

    traits = current_traits()
    lines = []
    for a in ARCHITECTURES:
        if traits is None:
            status = f"not on this machine: they need an {a.arch} GPU and there is no CUDA GPU"
        elif traits.arch != a.arch:
            status = f"not on this GPU: they need an {a.arch} GPU, this one is {traits.arch}"
        else:
            status = a.status()
        lines.append((a.title, status))
    return lines


def integration_lines() -> list[tuple[str, str]]:
    """One line per integration (integrations.versions): its framework's installed release and whether the
    integration supports it."""
    from flashmoe_science.integrations import versions

    return [(f"integration {name}", versions.status(name)) for name in versions.INTEGRATIONS]


def run_info(args: argparse.Namespace) -> int:
    print(f"flashmoe-science {_package_version()}")
    props = gpu_properties()
    if props is None:
        pairs = [("GPU", "none: no CUDA GPU found (torch.cuda.is_available() is False)")]
    else:
        smem = props["smem_per_block_optin_bytes"]
        l2 = props["l2_bytes"]
        pairs = [
            ("GPU", props["name"]),
            ("compute capability", props["capability"]),
            ("SMs", props["sm_count"]),
            ("shared memory/block", None if smem is None else f"{smem} bytes ({smem / 1024:.0f} KiB, opt-in max)"),
            ("L2 cache", None if l2 is None else f"{l2 / 2**20:.0f} MiB"),
            ("GPU memory", f"{props['memory_bytes'] / 2**30:.1f} GiB"),
        ]
    labels = {"torch": "torch", "triton": "triton", "cuda": "CUDA", "cudnn": "cuDNN", "python": "python"}
    pairs += [(labels[key], version) for key, version in software_versions().items()]
    pairs.append(("kernels here", kernels_here()))
    pairs += architecture_lines()
    pairs += integration_lines()
    _print_key_values(pairs)
    print()
    _print_sample_dispatch()
    return 0


def _print_sample_dispatch() -> None:
    """Which kernel backend="auto" picks for a sample call, and why (bf16 on a GPU, float32 on the CPU)."""
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    print(f'backend="auto" for q, k, v of shape {INFO_SAMPLE_SHAPE}, {str(dtype).removeprefix("torch.")} on {device}:')
    try:
        from flashmoe_science.attention.api import describe_dispatch

        q, k, v = (torch.randn(INFO_SAMPLE_SHAPE, device=device, dtype=dtype) for _ in range(3))
    except Exception as error:  # info reports what it can even when one part fails
        print(f"  cannot describe the dispatch: {type(error).__name__}: {error}")
        return
    for label, kwargs in (("non-causal", {}), ("causal", dict(causal=True)),
                          ("causal, window (256, 0), softcap 30", dict(causal=True, window=(256, 0), softcap=30.0))):
        try:
            dispatch = describe_dispatch(q, k, v, backend="auto", **kwargs)
        except Exception as error:
            print(f"  {label}: describe_dispatch raised {type(error).__name__}: {error}")
            continue
        print(f"  {label}: {dispatch.backend} / {dispatch.kernel}")
        print(f"    why: {dispatch.reason}")
        if dispatch.tiles:
            print("    tiles: " + ", ".join(f"{name}={value}" for name, value in dispatch.tiles.items()))


# --------------------------------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------------------------------
def _comma_list(allowed: tuple[str, ...] | None = None):
    """argparse type: "a,b" -> ["a", "b"], each checked against `allowed`."""

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if allowed is not None and item not in allowed]
        if not items or unknown:
            choices = f" from {', '.join(allowed)}" if allowed is not None else ""
            raise argparse.ArgumentTypeError(f"expected a comma-separated list{choices}; got {text!r}")
        return list(dict.fromkeys(items))

    return parse


def _shape_list(text: str) -> list[attention_bench.AttentionShape]:
    try:
        return [shape for item in _comma_list()(text) for shape in attention_bench.parse_shape(item)]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _partial_results(args: argparse.Namespace) -> PartialResults:
    """Where a running benchmark keeps what it has measured so far (see bench.report.PartialResults)."""
    partial = PartialResults(args.out, environment_metadata(resolve_commit(args.commit)))
    print(f"(partial results are kept in {partial.path} until the run completes)", flush=True)
    return partial


def _save(args: argparse.Namespace, records: list[dict], partial: PartialResults):
    """Write the JSON result (environment + records), drop the partial file, and say where."""
    path = write_results(args.out, partial.envelope, records)
    partial.finish()
    print(f"\nresults: {path}")
    return path


def _save_and_plot(args: argparse.Namespace, records: list[dict], partial: PartialResults, plot, name: str) -> None:
    """`_save`, then `plot(records, png_path, title=...)` beside the JSON unless --no-plot."""
    path = _save(args, records, partial)
    if not args.no_plot and records:
        written = plot(records, path.with_suffix(".png"), title=f"{name}, {path.stem}")
        if written is not None:
            print(f"plot:    {written}")


def _print_noise_note(records: list[dict]) -> None:
    note = noise_note(records)
    if note:
        print()
        print(note)


FEATURE_SUITES = frozenset(("varlen", "window", "mods", "packed", "mask-mods"))
GPU_ONLY = "it needs a CUDA GPU and this machine has none (`flashmoe-science bench` runs the CPU smoke test)"


def _check_bench_device(device: str | None, on_gpu: bool) -> None:
    """bench --device: cuda needs a CUDA device; cpu runs the smoke test where there is none (with a GPU the
    benchmark times the GPU)."""
    from flashmoe_science.device import check_device_option

    if device is None:
        return
    try:
        check_device_option(device)
    except ValueError as error:
        raise CommandError(str(error)) from None
    if device == "cpu" and on_gpu:
        raise CommandError("bench --device cpu: with a CUDA GPU the benchmark times the GPU kernels; the CPU smoke "
                           "test runs on machines without one")


def run_bench(args: argparse.Namespace) -> int:
    require_extra("tqdm", *(() if args.no_plot else ("matplotlib",)))
    suites = args.suite or [args.what]
    if suites in (["moe"], ["decode"], ["attention"], ["distributed"], ["ladder"]):
        what = suites[0]
    elif set(suites) <= FEATURE_SUITES:
        what = "features"
    else:
        raise CommandError(f"bench --suite: attention, moe, decode, distributed and ladder each run on their own; "
                           f"varlen, window, mods, packed and mask-mods combine; got {','.join(suites)}")
    on_gpu = torch.cuda.is_available()
    _check_bench_device(args.device, on_gpu)
    if what == "decode" and not on_gpu:
        raise CommandError(f"bench decode measures the bandwidth of CUDA-graph replays against the GPU's: {GPU_ONLY}")
    if not on_gpu and args.dtype is not None:
        raise CommandError(f"bench --dtype {args.dtype}: {GPU_ONLY}; on a CPU the comparison runs float32")
    if args.dtype is not None and what != "attention":
        raise CommandError(f"bench --dtype applies to the attention benchmark, not {what}")
    if args.ops is not None and what != "distributed":
        raise CommandError(f"bench --ops applies to --suite distributed, not {what}")
    check_out_dir(args.out)  # a bad --out fails now, not when the first result is saved
    if what == "ladder":
        from flashmoe_science.bench.ladder import run_from_cli as run_ladder

        return run_ladder(args)
    if what == "distributed":
        from flashmoe_science.bench.distributed import run_from_cli

        return run_from_cli(args)
    if args.rounds > 1:
        print(f"{args.rounds} rounds: each case's median time is recorded, with the spread of the rounds "
              "((max - min) / median)", flush=True)
    if what == "features":
        return _bench_features(args)
    if what == "moe":
        return _bench_moe(args)
    if what == "decode":
        return _bench_decode(args)
    return _bench_attention(args)


def _bench_decode(args: argparse.Namespace) -> int:
    if args.shapes or args.backends or args.models or args.passes != ["fwd"]:
        raise CommandError("bench decode: --shapes, --backends, --models and --pass do not apply (fixed grid; "
                           "--quick for fewer contexts)")
    from flashmoe_science.bench import decode as decode_bench

    contexts = decode_bench.GPU_CONTEXTS[:2] if args.quick else None
    print(f"decode benchmark on {torch.cuda.get_device_name(0)}")
    print(decode_bench.bandwidth_note(), flush=True)
    partial = _partial_results(args)
    skips: list[str] = []
    with Progress(desc="decode") as progress:
        records = decode_bench.run_decode_bench(progress, skips, contexts, on_case_done=partial)
    with Progress(desc="prefill chunks") as progress:
        cases = decode_bench.QUICK_CHUNK_CASES if args.quick else decode_bench.CHUNK_CASES
        records += decode_bench.run_chunk_bench(progress, skips, cases,
                                                on_case_done=lambda chunks: partial(records + chunks))
    with Progress(desc="ragged decode steps") as progress:
        records += decode_bench.run_serving_decode_bench(progress, skips,
                                                         on_case_done=lambda steps: partial(records + steps))
    print()
    print(decode_bench.decode_table(records))
    print()
    print(decode_bench.serving_decode_table(records))
    print()
    print(decode_bench.chunk_table(records))
    if skips:
        print("\nnot run:\n  " + "\n  ".join(skips))
    _save_and_plot(args, records, partial, decode_bench.plot_decode, "decode")
    return 0


def _bench_attention(args: argparse.Namespace) -> int:
    if args.models:
        raise CommandError("bench attention: --models applies to the MoE benchmark (bench moe)")
    if torch.cuda.is_available():
        device, dtype, timer = torch.device("cuda"), torch.bfloat16, attention_bench.cuda_median_ms
        shapes = args.shapes or attention_bench.gpu_shapes(quick=args.quick)
        backend_names = args.backends or [name for name in attention_bench.BACKEND_ORDER
                                           if name not in attention_bench.FP8_BACKENDS]
        if args.dtype == "fp8":  # FP8 is forward-only: ours in e4m3 beside ours and cuDNN in bf16, same run
            shapes = args.shapes or attention_bench.fa3_grid_shapes(
                seqlens=(1024, 4096, 16384) if args.quick else attention_bench.FA3_SEQLENS)
            backend_names = args.backends or list(attention_bench.FP8_RUN_BACKENDS)
            if args.passes != ["fwd"]:
                raise CommandError("bench --dtype fp8: FP8 attention is forward-only; leave out --pass")
        baselines = attention_bench.GPU_BASELINES
        print(f"attention benchmark on {torch.cuda.get_device_name(0)}: bf16, median of triton.testing.do_bench")
    else:
        device, dtype, timer = torch.device("cpu"), torch.float32, attention_bench.cpu_median_ms
        shapes = args.shapes or attention_bench.cpu_shapes()
        backend_names = args.backends or list(attention_bench.CPU_BACKENDS)
        baselines = attention_bench.CPU_BASELINES
        print("No CUDA GPU found: a smoke test of the benchmark on the CPU, not a speed claim. It compares the "
              "PyTorch reference (what backend='auto' runs on CPU tensors) with SDPA's math kernel on small float32 "
              "shapes, timed by time.perf_counter; the kernels' numbers need a GPU.")
    print(f"{len(shapes)} shapes x {len(backend_names)} backends x passes {','.join(args.passes)}"
          + (f" x {args.rounds} rounds" if args.rounds > 1 else ""), flush=True)

    skips = attention_bench.SkipLog()
    partial = _partial_results(args)
    with Progress(desc="attention") as progress:
        records = attention_bench.run_attention_bench(
            shapes, backend_names, args.passes, device, dtype, timer, progress, skips, on_shape_done=partial,
            rounds=args.rounds,
        )
    print()
    print(attention_bench.attention_table(records, baselines, backend_names))
    print()
    print(attention_bench.geomean_table(records, baselines))
    if skips.entries:
        print()
        print(skips.summary())
    _print_noise_note(records)
    _save_and_plot(args, records, partial, attention_bench.plot_attention, "attention")
    return 0


def _bench_features(args: argparse.Namespace) -> int:
    ignored = _attention_only_flags(args) + (["--models"] if args.models else [])
    if ignored:
        raise CommandError(f"bench --suite {','.join(args.suite)}: {', '.join(ignored)} apply to the dense attention "
                           "and MoE benchmarks; the suites time forward and backward of their fixed cases (graph "
                           "replays forward only; --quick for fewer)")
    from flashmoe_science.bench import features as features_bench

    on_gpu = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if on_gpu else (torch.device("cpu"), torch.float32)
    timer = attention_bench.cuda_median_ms if on_gpu else attention_bench.cpu_median_ms
    print(f"masked/packed attention suites {','.join(args.suite)} on "
          + (torch.cuda.get_device_name(0) if on_gpu
             else f"the CPU: sizes / {features_bench.CPU_SHRINK}, a smoke test of the harness, not a speed claim"),
          flush=True)
    partial = _partial_results(args)
    with Progress(desc="features") as progress:
        records = features_bench.run_features_bench(args.suite, args.quick, device, dtype, timer, progress,
                                                    on_case_done=partial, rounds=args.rounds)
    print()
    print(features_bench.features_tables(records))
    _print_noise_note(records)
    _save_and_plot(args, records, partial, features_bench.plot_features, "attention features")
    return 0


def _attention_only_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that only the dense attention benchmark reads."""
    return [flag for flag, given in (("--shapes", args.shapes), ("--backends", args.backends),
                                     ("--pass", args.passes != ["fwd"])) if given]


def _bench_moe(args: argparse.Namespace) -> int:
    attention_only = _attention_only_flags(args)
    if attention_only:
        raise CommandError(f"bench moe: {', '.join(attention_only)} apply to the attention benchmark; the MoE "
                           "benchmark times forward and backward of its fixed model configs (--quick for fewer)")
    from flashmoe_science.bench import moe as moe_bench

    if not torch.cuda.is_available():
        print(f"No CUDA GPU found: the MoE layer at 1/{moe_bench.CPU_SHRINK} of the models' widths and "
              f"T={','.join(map(str, moe_bench.CPU_TOKENS))} on the CPU, float32: a smoke test of the harness, "
              "not a speed claim", flush=True)
    partial = _partial_results(args)
    with Progress(desc="moe") as progress:
        records = moe_bench.run_moe_bench(quick=args.quick, progress=progress, on_case_done=partial,
                                          rounds=args.rounds, models=args.models)
    row_fields = [name for name in MOE_ROW_FIELDS if any(name in record for record in records)]
    print()
    print("TFLOP/s of the expert GEMMs (n/a: backend unsupported or skipped)")
    print(records_table(records, row_fields=row_fields))
    _print_noise_note(records)
    _save(args, records, partial)
    return 0


# --------------------------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: `flashmoe-science: error: <what>; see <command> --help` (exit status 2)."""

    def error(self, message: str):
        self.exit(EXIT_ERROR, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    commands = parser.add_subparsers(dest="command", metavar="{info,bench,warmup,supercon,serve,serve-bench}")

    info = commands.add_parser("info", help="GPU, versions, which kernels run here, and which one a sample call takes")
    info.set_defaults(handler=run_info)

    bench = commands.add_parser(
        "bench", help="time our kernels against SDPA and FlexAttention (or the MoE layer)",
        description="Time our kernels against PyTorch's. Without a CUDA GPU: a small CPU smoke test, not a speed "
        "claim. Each sweep runs --rounds times; tables show each case's median and the rounds' spread.")
    bench.add_argument("what", nargs="?", choices=("attention", "moe", "decode"), default="attention")
    bench.add_argument("--device", choices=("cuda", "cpu"), default=None,
                       help="cuda (the default where there is a CUDA GPU: the benchmark) or cpu (the default "
                       "elsewhere: a smoke test, not a speed claim)")
    bench.add_argument("--quick", action="store_true", help="a small subset of shapes (under 2 minutes on an H200)")
    bench.add_argument("--out", default=DEFAULT_OUT,
                       help=f"folder for the JSON and PNG (default ./{DEFAULT_OUT}; {PUBLISHED_OUT} publishes a "
                       "run beside the measured ones the README cites)")
    bench.add_argument(
        "--pass", dest="passes", type=_comma_list(attention_bench.PASSES), default=["fwd"],
        help="passes to time: fwd (default), bwd, or fwd,bwd",
    )
    bench.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    bench.add_argument(
        "--dtype", choices=("bf16", "fp8"),
        help="attention inputs on a GPU: bf16 (default) or fp8 (our e4m3 forward beside our bf16 forward and cuDNN, "
        "FA3 grid); a CPU runs float32 only",
    )
    bench.add_argument("--commit", help="commit to record (default: $FLASHMOE_COMMIT, else git, else 'unknown')")
    bench.add_argument(
        "--shapes", type=_shape_list,
        help="attention shapes instead of the default grid, e.g. 4x8x2048x64,2x16x8192x128 (BxHxLxD; each run "
        "non-causal and causal)",
    )
    bench.add_argument(
        "--backends", type=_comma_list(attention_bench.BACKEND_ORDER),
        help=f"attention backends to run (default: all on a GPU): {','.join(attention_bench.BACKEND_ORDER)}",
    )
    bench.add_argument(
        "--suite", type=_comma_list(("attention", "moe", "decode", *sorted(FEATURE_SUITES), "distributed", "ladder")),
        help="the benchmark(s) to run instead of the positional name: attention, moe or decode; or the masked/packed "
        "attention suites, which combine: varlen, window, mods (softcap, ALiBi, bias), packed (equal lengths, "
        "eager and graphed), mask-mods (user mask_mod functions against Flex); see bench/features.py. Or "
        "distributed (alone): ring attention and expert-parallel MoE scaling under "
        "`torchrun --nproc-per-node N -m flashmoe_science.cli bench --suite distributed`, or without torchrun on "
        "one GPU a ring step's overlap and one EP rank's expert work (bench/distributed.py). Or ladder (alone): every "
        "rung of attention.ladder from the CPU to the warp-specialised Gluon kernel (bench/ladder.py)",
    )
    bench.add_argument(
        "--ops", type=_comma_list(("ep-moe", "ring-attention")),
        help="--suite distributed under torchrun: the parts to run (default: both): ep-moe, ring-attention",
    )
    bench.add_argument(
        "--models", type=_comma_list(tuple(MOE_MODELS)),
        help=f"MoE models to run (default: all): {', '.join(MOE_MODELS)}",
    )
    bench.add_argument(
        "--rounds", type=_positive_int, default=DEFAULT_ROUNDS,
        help=f"repeat the sweep N times (default {DEFAULT_ROUNDS}) and record each case's median, its rounds' times "
        "(ms_rounds) and their spread; a row whose spread passes 10%% is marked as noisy",
    )
    bench.set_defaults(handler=run_bench)

    from flashmoe_science.science.cli import add_supercon_parser
    from flashmoe_science.warmup import add_warmup_parser

    add_warmup_parser(commands)
    add_supercon_parser(commands)
    from flashmoe_science.serving.cli import add_serve_parsers

    add_serve_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `flashmoe-science` command: runs the subcommand and returns its exit status. A CommandError prints one
    line and returns 2 (with --debug: raises); Ctrl-C prints one line and returns 130."""
    parser = build_parser()
    args = parser.parse_args(argv)
    PartialResults.left.clear()  # this run's, named if it is interrupted
    if args.command is None:
        parser.print_help()
        return EXIT_ERROR
    try:
        return args.handler(args)
    except CommandError as error:
        if args.debug:
            raise
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except ModuleNotFoundError as error:
        if args.debug or (error.name or "").split(".")[0] not in EXTRAS:
            raise
        print(f"{PROG}: error: {_missing_extra_message(error.name.split('.')[0])}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        if args.debug:
            traceback.print_exc()
        kept = [str(path) for path in PartialResults.left if path.exists()]
        where = f"; what it measured is in {', '.join(kept)}" if kept else ""
        print(f"{PROG}: interrupted{where}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
