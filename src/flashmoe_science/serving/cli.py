"""``flashmoe-science serve`` and ``flashmoe-science serve-bench``: their arguments and what they run."""

from __future__ import annotations

import argparse

from flashmoe_science.errors import CommandError
from flashmoe_science.integrations.hf_e4m3_cache import KV_CACHE_DTYPES
from flashmoe_science.serving.model import BACKENDS, default_placement

DEFAULT_PORT = 8000


def _cache_arguments(parser, per_model: bool = False) -> None:
    """The cache and model options of ``serve`` and ``serve-bench`` (``per_model``: ``--cache-gib`` takes one
    number or one per model)."""
    parser.add_argument("--device", default=None, help="cuda if available, else cpu (the reference kernels)")
    parser.add_argument("--dtype", default=None, help="model dtype: bfloat16 on CUDA, float32 on the CPU by default")
    parser.add_argument("--page-size", type=int, default=256, help="tokens per KV-cache page (default 256)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--cache-tokens", type=int, default=131072,
                      help="KV-cache size in tokens, all requests together (default 131072); a request whose "
                      "prompt plus max_tokens exceeds it is refused with a 400")
    if per_model:
        from flashmoe_science.serving.bench import positive_floats

        gib_type, each = positive_floats, "; one number, or one per MODEL_OR_CONFIG in their order"
    else:
        gib_type, each = float, ""
    size.add_argument("--cache-gib", type=gib_type, default=None,
                      help="KV-cache size in GiB instead of tokens: as many tokens as that memory holds in the "
                      f"cache's dtype (an e4m3 cache twice a bf16 one's){each}")
    parser.add_argument("--max-batch-tokens", type=int, default=8192,
                        help="most tokens one continuous-batching step computes (default 8192)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run every step eagerly (default: transformers decides)")
    parser.add_argument("--seed", type=int, default=0, help="seed of a config's random weights (default 0)")


def add_serve_parsers(commands) -> None:
    """Adds ``serve`` and ``serve-bench`` to the ``flashmoe-science`` subcommands."""
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible server (transformers' app, continuous batching) on our kernels",
        description="Serves /v1/chat/completions and /v1/completions (streaming or not), /v1/models, /health and "
        "/cache with transformers' serving stack and continuous batching, on our attention and MoE kernels "
        "(--backend flashmoe) or transformers' SDPA (--backend transformers-sdpa). MODEL_OR_CONFIG: a local model "
        "directory, or a config.json (random weights, a word tokenizer t0 t1 ...). Stops on Ctrl-C or SIGTERM.")
    serve.add_argument("model", metavar="MODEL_OR_CONFIG")
    serve.add_argument("--backend", choices=BACKENDS, default="flashmoe")
    serve.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="auto: the model's dtype; e4m3: one byte a value with per-layer, per-KV-head scales "
                       "calibrated at start (--backend flashmoe only)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--served-model-name", help="the model name clients send (default: MODEL_OR_CONFIG)")
    serve.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    _cache_arguments(serve)
    serve.set_defaults(handler=run_serve)

    from flashmoe_science.serving.bench import add_bench_arguments

    bench = commands.add_parser(
        "serve-bench", help="load-test servers on our kernels and on transformers' SDPA with the openai client",
        description="Starts `flashmoe-science serve` once per model and backend (all together), then loads each "
        "in turn with N concurrent streams (closed loop, or --rate requests/s) of prompts drawn from a length range, "
        "and writes tokens/s, time to first token and inter-token latency (p50/p99) as JSON and a plot.")
    bench.add_argument("models", metavar="MODEL_OR_CONFIG", nargs="+")
    _cache_arguments(bench, per_model=True)
    add_bench_arguments(bench)
    bench.set_defaults(handler=run_serve_bench)


def check_stack() -> None:
    """The serving stack's check (`server.check_serving_stack`) as the command's one-line error."""
    from flashmoe_science.serving.server import check_serving_stack

    try:
        check_serving_stack()
    except (ImportError, RuntimeError) as error:
        raise CommandError(str(error)) from None


def run_serve(args: argparse.Namespace) -> int:
    from flashmoe_science.serving import server
    from flashmoe_science.serving.model import cache_tokens_in, check_kv_cache_dtype, kv_cache_scales, load_model

    check_stack()
    try:
        device, dtype = default_placement(args.device, args.dtype)
        check_kv_cache_dtype(args.backend, args.kv_cache_dtype)
        model, tokenizer = load_model(args.model, args.backend, device, dtype, seed=args.seed)
        kv_scales = kv_cache_scales(model, args.kv_cache_dtype, seed=args.seed)
        cache_tokens = args.cache_tokens
        if args.cache_gib is not None:
            cache_tokens = cache_tokens_in(args.cache_gib, model.config, args.kv_cache_dtype, model.dtype)
    except ValueError as error:
        raise CommandError(str(error)) from None
    config = server.cb_config(args.backend, args.page_size, cache_tokens, args.max_batch_tokens,
                              False if args.no_cuda_graphs else None)
    app = server.Server(args.served_model_name or args.model, model, tokenizer, config, kv_scales)
    print(f"serving {args.model} ({args.backend}, {device}, {dtype}, KV cache {args.kv_cache_dtype}) on "
          f"http://{args.host}:{args.port}/v1", flush=True)
    server.run(app, args.host, args.port, args.log_level)
    return 0


def run_serve_bench(args: argparse.Namespace) -> int:
    from flashmoe_science.serving.bench import run_bench

    check_stack()
    try:
        default_placement(args.device, args.dtype)  # a bad --device fails before any server starts
        return run_bench(args)
    except ValueError as error:
        raise CommandError(str(error)) from None
