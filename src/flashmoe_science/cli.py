"""The `flashmoe-science` command.

    flashmoe-science info                 GPU, versions, and which kernel a sample call would use and why
    flashmoe-science bench [attention]    ours against every SDPA backend and FlexAttention (TFLOP/s, ms, memory)
    flashmoe-science bench moe            the MoE layer benchmark
    flashmoe-science bench --suite decode KV-cache decode bandwidth against SDPA, FlexAttention and a pure read
    flashmoe-science bench --suite varlen,window,mods   packed sequences and masks against SDPA/FlexAttention
    flashmoe-science bench --suite distributed   ring attention / expert-parallel MoE scaling (under torchrun)
    flashmoe-science bench --suite ladder  every rung of attention.ladder, from the CPU to the Hopper kernel
    flashmoe-science supercon train|screen|bench   the superconductor Tc model (flashmoe_science.science.cli)

`bench` prints a table, writes `<out>/<gpu>-<date>-<commit>.json` and a PNG plot beside it. Without a CUDA GPU it
runs a small CPU comparison instead, so the command works everywhere.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

import torch

from flashmoe_science.bench import attention as attention_bench
from flashmoe_science.bench.report import (
    PartialResults,
    Progress,
    environment_metadata,
    gpu_properties,
    records_table,
    resolve_commit,
    software_versions,
    write_results,
)

DEFAULT_OUT = "benchmarks/results"
INFO_SAMPLE_SHAPE = (2, 8, 1024, 64)  # (B, H, L, D) of the call `info` describes
# MoE table rows: the fields present among these, in this order ("model": a name such as "mixtral-8x7b")
MOE_ROW_FIELDS = ("model", "E", "top_k", "d_model", "d_ff", "T", "pass", "timing")
EXIT_UNAVAILABLE = 2


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


def run_info(args: argparse.Namespace) -> int:
    print(f"flashmoe-science {_package_version()}")
    props = gpu_properties()
    if props is None:
        pairs = [("GPU", "none: no CUDA GPU found (torch.cuda.is_available() is False); CPU calls use the reference")]
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
    from flashmoe_science.gluon.availability import describe as gluon_status

    pairs.append(("Gluon sm_90 kernels", gluon_status()))
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
    return PartialResults(args.out, environment_metadata(resolve_commit(args.commit)))


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


FEATURE_SUITES = frozenset(("varlen", "window", "mods"))


def run_bench(args: argparse.Namespace) -> int:
    suites = args.suite or [args.what]
    if suites in (["moe"], ["decode"], ["attention"], ["distributed"], ["ladder"]):
        what = suites[0]
    elif set(suites) <= FEATURE_SUITES:
        return _bench_features(args)
    else:
        print(f"bench --suite: attention, moe, decode, distributed and ladder each run on their own; varlen, window "
              f"and mods combine; got {','.join(suites)}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if what == "ladder":
        from flashmoe_science.bench.ladder import run_from_cli as run_ladder

        return run_ladder(args)
    if what == "distributed":
        from flashmoe_science.bench.distributed import run_from_cli

        return run_from_cli(args)
    if what == "moe":
        return _bench_moe(args)
    if what == "decode":
        return _bench_decode(args)
    return _bench_attention(args)


def _bench_decode(args: argparse.Namespace) -> int:
    from flashmoe_science.bench import decode as decode_bench

    if args.shapes or args.backends or args.models or args.passes != ["fwd"]:
        print("bench decode: --shapes, --backends, --models and --pass do not apply (fixed grid; --quick for "
              "fewer contexts)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    on_gpu = torch.cuda.is_available()
    contexts = None
    if args.quick:
        contexts = decode_bench.GPU_CONTEXTS[:2] if on_gpu else decode_bench.CPU_CONTEXTS[:1]
    print(f"decode benchmark on {torch.cuda.get_device_name(0)}" if on_gpu else
          "No CUDA GPU found: a small CPU comparison instead (float32; ours = the PyTorch reference)")
    print(decode_bench.bandwidth_note(), flush=True)
    partial = _partial_results(args)
    skips: list[str] = []
    with Progress(desc="decode") as progress:
        records = decode_bench.run_decode_bench(progress, skips, contexts, on_case_done=partial)
    print()
    print(decode_bench.decode_table(records))
    if skips:
        print("\nnot run:\n  " + "\n  ".join(skips))
    _save_and_plot(args, records, partial, decode_bench.plot_decode, "decode")
    return 0


def _bench_attention(args: argparse.Namespace) -> int:
    if args.models:
        print("bench attention: --models applies to the MoE benchmark (bench moe)", file=sys.stderr)
        return EXIT_UNAVAILABLE
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
                print("bench --dtype fp8: FP8 attention is forward-only; timing fwd", file=sys.stderr)
                args.passes = ["fwd"]
        baselines = attention_bench.GPU_BASELINES
        print(f"attention benchmark on {torch.cuda.get_device_name(0)}: bf16, median of triton.testing.do_bench")
    else:
        device, dtype, timer = torch.device("cpu"), torch.float32, attention_bench.cpu_median_ms
        shapes = args.shapes or attention_bench.cpu_shapes()
        backend_names = args.backends or list(attention_bench.CPU_BACKENDS)
        baselines = attention_bench.CPU_BASELINES
        print(
            "No CUDA GPU found: running a small CPU comparison instead "
            "(float32; ours = the PyTorch reference; median of time.perf_counter)."
        )
    print(f"{len(shapes)} shapes x {len(backend_names)} backends x passes {','.join(args.passes)}"
          + (f" x {args.rounds} rounds (median recorded)" if args.rounds > 1 else ""), flush=True)

    skips = attention_bench.SkipLog()
    partial = _partial_results(args)
    print(f"(partial results are kept in {partial.path} until the run completes)", flush=True)
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

    _save_and_plot(args, records, partial, attention_bench.plot_attention, "attention")
    return 0


def _bench_features(args: argparse.Namespace) -> int:
    from flashmoe_science.bench import features as features_bench

    on_gpu = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if on_gpu else (torch.device("cpu"), torch.float32)
    timer = attention_bench.cuda_median_ms if on_gpu else attention_bench.cpu_median_ms
    print(f"masked/packed attention suites {','.join(args.suite)} on "
          + (torch.cuda.get_device_name(0) if on_gpu else "the CPU (sizes / 64: a smoke test)"), flush=True)
    partial = _partial_results(args)
    with Progress(desc="features") as progress:
        records = features_bench.run_features_bench(args.suite, args.quick, device, dtype, timer, progress,
                                                    on_case_done=partial, rounds=args.rounds)
    print()
    print(features_bench.features_tables(records))
    path = _save(args, records, partial)
    if not args.no_plot and records:
        plot = features_bench.plot_features(records, path.with_suffix(".png"), title=f"attention features, {path.stem}")
        if plot is not None:
            print(f"plot:    {plot}")
    return 0


def _bench_moe(args: argparse.Namespace) -> int:
    attention_only = [flag for flag, given in (("--shapes", args.shapes), ("--backends", args.backends),
                                              ("--pass", args.passes != ["fwd"])) if given]
    if attention_only:
        print(f"bench moe: {', '.join(attention_only)} apply to the attention benchmark; the MoE benchmark times "
              "forward and backward of its fixed model configs (--quick for fewer)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        from flashmoe_science.bench.moe import run_moe_bench
    except ImportError as error:
        print(f"the MoE benchmark is not available in this build ({error})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    partial = _partial_results(args)
    with Progress(desc="moe") as progress:
        records = run_moe_bench(quick=args.quick, progress=progress, on_case_done=partial, rounds=args.rounds,
                                models=args.models)
    row_fields = [name for name in MOE_ROW_FIELDS if any(name in record for record in records)]
    print()
    print("TFLOP/s of the expert GEMMs (n/a: backend unsupported or skipped)")
    print(records_table(records, row_fields=row_fields))
    _save(args, records, partial)
    return 0


# --------------------------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashmoe-science", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", metavar="{info,bench,supercon}")

    info = commands.add_parser("info", help="GPU, versions, and which kernel a sample call would use and why")
    info.set_defaults(handler=run_info)

    bench = commands.add_parser("bench", help="time our kernels against SDPA and FlexAttention (or the MoE layer)")
    bench.add_argument("what", nargs="?", choices=("attention", "moe", "decode"), default="attention")
    bench.add_argument("--quick", action="store_true", help="a small subset of shapes (under 2 minutes on an H200)")
    bench.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the JSON and PNG (default {DEFAULT_OUT})")
    bench.add_argument(
        "--pass", dest="passes", type=_comma_list(attention_bench.PASSES), default=["fwd"],
        help="passes to time: fwd (default), bwd, or fwd,bwd",
    )
    bench.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    bench.add_argument(
        "--dtype", choices=("bf16", "fp8"), default="bf16",
        help="attention inputs: bf16 (default) or fp8 (our e4m3 forward beside our bf16 forward and cuDNN, FA3 grid)",
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
        "attention suites, which combine: varlen, window, mods (softcap, ALiBi, "
        "bias); see bench/features.py. Or distributed (alone): ring attention and expert-parallel MoE scaling under "
        "`torchrun --nproc-per-node N -m flashmoe_science.cli bench --suite distributed`, or without torchrun on "
        "one GPU a ring step's overlap and one EP rank's expert work (bench/distributed.py). Or ladder (alone): every "
        "rung of attention.ladder from the CPU to the Hopper kernel (bench/ladder.py)",
    )
    bench.add_argument(
        "--models", type=_comma_list(),
        help="MoE models to run (default: all): mixtral-8x7b, qwen3-30b-a3b",
    )
    bench.add_argument(
        "--rounds", type=_positive_int, default=1,
        help="repeat the sweep (attention or moe) N times and record each case's median (its times in ms_rounds): "
        "one sweep's rows vary by several percent",
    )
    bench.set_defaults(handler=run_bench)

    from flashmoe_science.science.cli import add_supercon_parser

    add_supercon_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 1
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
