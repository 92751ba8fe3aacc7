"""``flashmoe-science serve-bench``: each model and the same workload served by each backend, one server loaded at a
time.

One ``flashmoe-science serve`` process per server: for each model, each backend, and the ``flashmoe`` backend once
per ``--kv-cache-dtypes`` entry, all with the same cache options, each on a free port, serving its model under the
name of its file (or folder) without the extension. They start together (their model builds, kernel compilations
and CUDA-graph captures overlap) and are all waited for (``/cache`` answers once continuous batching has started)
before any is loaded, so a measured server shares the GPU with idle ones only.
Then each in turn: a warm-up run (every prompt length bucket at the highest concurrency, `WARMUP_NEW_TOKENS` new
tokens: kernel compilations, CUDA-graph captures), not recorded; one `load.run_load` per concurrency, each on fresh
prompts drawn from the same seeded length distribution (uniform over ``--prompt-tokens``); then SIGTERM, and the
server must exit by itself. Records (op ``serve``) carry the backend, KV-cache dtype, concurrency, request rate,
`load.summarize`'s numbers and the server's exit status; the JSON envelope the GPU, versions, commit and date.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from flashmoe_science.integrations.hf_e4m3_cache import KV_CACHE_DTYPES
from flashmoe_science.serving.model import BACKENDS

SERVER_START_TIMEOUT_S = 900  # model build, cache allocation and CUDA-graph captures on a cold GPU
WARMUP_NEW_TOKENS = 16  # enough decode steps to capture the decode graphs; the prompts' prefill is the warm-up's bulk


def _positive_list(convert, what: str):
    """An option's parser: positive values of `convert` (int or float) separated by commas."""
    def parse(text: str) -> list:
        values = [convert(v) for v in text.split(",") if v]
        if not values or min(values) <= 0:
            raise ValueError(f"expected positive {what} separated by commas, got {text!r}")
        return values

    parse.__name__ = f"positive {what}"  # argparse names the type in its error
    return parse


_int_list = _positive_list(int, "integers")
positive_floats = _positive_list(float, "numbers")  # serve-bench's --cache-gib


def _one_or_each(values: list, count: int, option: str, what: str) -> list:
    """``values`` given for ``count`` things: one value for all, or one each; else a ValueError naming ``option``."""
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise ValueError(f"{option}: one number or one per {what} ({count}), got {len(values)}")
    return list(values)


def _names(known: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in known]
        if not names or unknown:
            raise ValueError(f"expected names among {', '.join(known)} separated by commas, got {text!r}")
        return names
    return parse


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise ValueError(f"expected LOW:HIGH token counts with 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def add_bench_arguments(parser) -> None:
    parser.add_argument("--backends", type=_names(BACKENDS), default=list(BACKENDS),
                        help=f"backends to serve, one after the other (default {','.join(BACKENDS)})")
    parser.add_argument("--kv-cache-dtypes", type=_names(KV_CACHE_DTYPES), default=["auto"],
                        help="KV-cache dtypes of the flashmoe backend, one server each (default auto; "
                        "transformers-sdpa: auto only)")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 8, 64],
                        help="concurrent streams per run (default 1,8,64)")
    parser.add_argument("--requests", type=_int_list, default=None,
                        help="requests per run: one number, or one per concurrency (default: 2 x concurrency, at "
                        "least 4)")
    parser.add_argument("--rate", type=float, default=None,
                        help="send requests at this rate (requests/s) instead of closed loop")
    parser.add_argument("--prompt-tokens", type=_length_range, default=(128, 2048),
                        help="prompt lengths, uniform over LOW:HIGH tokens (default 128:2048)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--name", default="serve", help="a label for the records and the file name")
    parser.add_argument("--out", default="bench-results", help="folder for the JSON and PNG")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--commit", help="commit to record (default: $FLASHMOE_COMMIT, else git)")
    parser.add_argument("--after-pid", type=int, default=None,
                        help="load no server before process PID has exited (another job on the GPU, e.g. tests: "
                        "the servers start meanwhile)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(args) -> list[tuple[str, str, str]]:
    """(model, backend, KV-cache dtype) of each server, model by model: ``flashmoe`` once per ``--kv-cache-dtypes``
    entry, the other backends on their own cache (``auto``)."""
    return [(model, backend, dtype) for model in args.models for backend in args.backends
            for dtype in (args.kv_cache_dtypes if backend == "flashmoe" else ["auto"])]


def model_label(model: str) -> str:
    """The name a model is served and recorded under: its config file's or folder's name without the extension."""
    return Path(model).name if Path(model).is_dir() else Path(model).stem


def requests_per_run(args) -> list[int]:
    """Requests of each concurrency's run: ``--requests`` (one number, or one per concurrency), else 2 x
    concurrency, at least 4."""
    if args.requests is None:
        return [max(4, 2 * concurrency) for concurrency in args.concurrency]
    return _one_or_each(args.requests, len(args.concurrency), "--requests", "concurrency")


def cache_gib_of(args, model: str) -> float | None:
    """The ``--cache-gib`` of ``model``'s servers (one number for all models, or one per model in their order: a
    cache that holds the same share of each model's workload); None when the caches are sized in tokens."""
    if args.cache_gib is None:
        return None
    return _one_or_each(args.cache_gib, len(args.models), "--cache-gib", "model")[args.models.index(model)]


def serve_command(model: str, backend: str, kv_cache_dtype: str, port: int, args) -> list[str]:
    """The ``flashmoe-science serve`` command line of one server, with the bench's cache options."""
    command = [sys.executable, "-m", "flashmoe_science.cli", "serve", model, "--served-model-name",
               model_label(model), "--backend", backend, "--kv-cache-dtype", kv_cache_dtype, "--port", str(port),
               "--page-size", str(args.page_size), "--max-batch-tokens", str(args.max_batch_tokens),
               "--seed", str(args.seed)]
    gib = cache_gib_of(args, model)
    command += ["--cache-tokens", str(args.cache_tokens)] if gib is None else ["--cache-gib", str(gib)]
    for flag, value in (("--device", args.device), ("--dtype", args.dtype)):
        if value:
            command += [flag, value]
    return command + (["--no-cuda-graphs"] if args.no_cuda_graphs else [])


class ServerProcess:
    """A ``flashmoe-science serve`` subprocess: started, waited for until ``/cache`` answers, stopped by SIGTERM."""

    def __init__(self, command: list[str], port: int, log_path=None):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout_s: float = SERVER_START_TIMEOUT_S) -> dict:
        """The server's ``/cache`` statistics once it answers; a RuntimeError if the process exits first."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode} before it was ready")
            try:
                return httpx.get(f"{self.url}/cache", timeout=5).raise_for_status().json()
            except (httpx.HTTPError, ValueError):
                time.sleep(0.5)
        raise RuntimeError(f"the server did not answer on {self.url} within {timeout_s} s")

    def terminate(self) -> None:
        """SIGTERM if it is running (`stop` waits for it)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, then the exit status (SIGKILL and -9 if it has not exited after ``timeout_s``)."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()
        return self.process.returncode


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie, exited but not yet reaped, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc: existing is running
        return True
    return state != "Z"


def served_model_name(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=10).raise_for_status().json()["data"][0]["id"]


def make_prompts(model: str, count: int, lengths: tuple[int, int], seed: int) -> list[str]:
    """``count`` prompts with lengths uniform over ``lengths`` tokens: random words of the word tokenizer for a
    config file, random token ids decoded by the model's tokenizer for a model directory (then the lengths are
    those of the ids; a re-encoding may differ slightly, and the records count the server's tokens)."""
    import random

    from flashmoe_science.serving.model import words

    draw = random.Random(seed)
    if Path(model).is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        vocab, decode = tokenizer.vocab_size, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    else:
        vocab, decode = json.loads(Path(model).read_text())["vocab_size"], words
    return [decode([draw.randrange(vocab) for _ in range(draw.randint(*lengths))]) for _ in range(count)]


def _measure(server: ServerProcess, args, log, measured) -> list[dict]:
    from flashmoe_science.serving.load import run_load, summarize
    from flashmoe_science.serving.model import default_placement

    device, dtype = default_placement(args.device, args.dtype)
    name = served_model_name(server.url)
    label = server.label
    top = max(args.concurrency)
    warmup = make_prompts(server.model, top, args.prompt_tokens, seed=args.seed + 1)
    summary = summarize(run_load(server.url, name, warmup, min(args.new_tokens, WARMUP_NEW_TOKENS), top))
    log(f"{label}: warm-up {summary['requests']} requests, {summary['errors']} errors, {summary['seconds']} s")
    records = []
    for index, (concurrency, count) in enumerate(zip(args.concurrency, requests_per_run(args))):
        prompts = make_prompts(server.model, count, args.prompt_tokens, seed=args.seed + 100 + index)
        summary = summarize(run_load(server.url, name, prompts, args.new_tokens, concurrency, args.rate))
        records.append({"op": "serve", "name": args.name, "backend": server.backend,
                        "kv_cache_dtype": server.kv_cache_dtype, "model": name, "device": device, "dtype": dtype,
                        "concurrency": concurrency, "rate": args.rate, "prompt_tokens_range": list(args.prompt_tokens),
                        "new_tokens": args.new_tokens, **summary})
        log(f"{label}: concurrency {concurrency}: {summary['tokens_per_s']} tokens/s, TTFT p50 "
            f"{summary['ttft_ms_p50']} ms, ITL p50 {summary['itl_ms_p50']} ms, {summary['errors']} errors")
        measured(records)
    return records


def server_label(model: str, backend: str, kv_cache_dtype: str) -> str:
    return f"{model} {backend}" + ("" if kv_cache_dtype == "auto" else f" {kv_cache_dtype}")


def start_server(args, model: str, backend: str, kv_cache_dtype: str, log_dir=None) -> ServerProcess:
    """A ``flashmoe-science serve`` process of one server on a free port (not waited for)."""
    port = free_port()
    label = server_label(model_label(model), backend, kv_cache_dtype)
    log_path = None
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log_path = Path(log_dir) / f"server-{label.replace(' ', '-')}.log"
    server = ServerProcess(serve_command(model, backend, kv_cache_dtype, port, args), port, log_path)
    server.model, server.backend, server.kv_cache_dtype, server.label = model, backend, kv_cache_dtype, label
    return server


def bench_server(server: ServerProcess, args, log, measured=lambda records: None) -> list[dict]:
    """Waits for the started server, measures every concurrency (``measured``: called with the server's records so
    far after each), stops it; its records carry the exit status and the cache's pages."""
    try:
        started = time.monotonic()
        cache = server.wait_ready()
        log(f"{server.label}: ready after another {time.monotonic() - started:.0f} s, cache {cache}")
        records = _measure(server, args, log, measured)
    finally:
        status = server.stop()
    log(f"{server.label}: server exited with status {status}")
    for record in records:
        record.update(server_exit_status=status, cache_pages=cache["pages"], page_size=cache["page_size"],
                      cache_bytes=cache["cache_bytes"])
    return records


def plot_serve(records: list[dict], path, title: str):
    from flashmoe_science.bench.report import plot_panels

    panels = {}
    for metric, label in (("tokens_per_s", "tokens/s"), ("ttft_ms_p50", "TTFT p50 (ms)"),
                          ("itl_ms_p50", "ITL p50 (ms)")):
        for record in records:
            if record.get(metric) is not None:
                name = server_label(record["model"], record["backend"], record["kv_cache_dtype"])
                panels.setdefault(label, {}).setdefault(name, []).append((record["concurrency"], record[metric]))
    return plot_panels(path, panels, xlabel="concurrent streams", ylabel="", suptitle=title)


def run_bench(args) -> int:
    from flashmoe_science.bench.report import PartialResults, environment_metadata, resolve_commit, write_results

    requests_per_run(args)  # its ValueError (and cache_gib_of's) before any server starts
    cache_gib_of(args, args.models[0])
    missing = [model for model in args.models if not Path(model).exists()]
    if missing:
        raise ValueError(f"MODEL_OR_CONFIG: no such file or folder: {', '.join(missing)}")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    import httpx
    import transformers

    envelope = {**environment_metadata(resolve_commit(args.commit)), "transformers": transformers.__version__,
                "suite": f"serve-{args.name}"}
    partial = PartialResults(args.out, envelope)  # what was measured survives a killed run
    # SIGTERM (a timeout) stops the servers too: SystemExit runs the `finally` below
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = [start_server(args, *server, log_dir=args.out) for server in servers(args)]
    records, failed = [], 0
    try:
        ready = []
        for server in started:  # all ready before any is loaded: none still compiles or captures meanwhile
            try:
                server.wait_ready()
                ready.append(server)
            except RuntimeError as error:  # the others are still measured
                failed += 1
                log(f"{server.label}: {error}")
        log(f"{len(ready)} of {len(started)} servers ready")
        if args.after_pid is not None and process_running(args.after_pid):
            log(f"waiting for process {args.after_pid} to exit before the loads")
            while process_running(args.after_pid):
                time.sleep(0.5)
        for server in ready:
            try:
                records += bench_server(server, args, log, measured=lambda current: partial(records + current))
            except (RuntimeError, httpx.HTTPError) as error:
                failed += 1
                log(f"{server.label}: {type(error).__name__}: {error}")
            partial(records)
    finally:
        for server in started:  # all signalled, then each waited for
            server.terminate()
        for server in started:
            server.stop()
    path = write_results(args.out, envelope, records)
    partial.finish()
    print(json.dumps(records, indent=1))
    print(f"results: {path}", file=sys.stderr)
    if records and not args.no_plot:
        plot_serve(records, path.with_suffix(".png"), title=f"{args.name}, {path.stem}")
    return 1 if failed else 0
