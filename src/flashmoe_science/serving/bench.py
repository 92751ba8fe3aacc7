"""``flashmoe-science serve-bench``: the same model and workload served by each backend, one server at a time.

For each backend a ``flashmoe-science serve`` process is started on a free port with the same cache options and
waited for (``/cache`` answers once continuous batching has started); a warm-up run (every prompt length bucket at
the highest concurrency: kernel compilations, CUDA-graph captures) is not recorded; then one `load.run_load` per
concurrency, each on fresh prompts drawn from the same seeded length distribution (uniform over
``--prompt-tokens``). The server is stopped with SIGTERM and must exit by itself. Records (op ``serve``) carry the
backend, concurrency, request rate, `load.summarize`'s numbers and the server's exit status; the JSON envelope the
GPU, versions, commit and date.
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

from flashmoe_science.serving.model import BACKENDS

SERVER_START_TIMEOUT_S = 900  # model build, cache allocation and CUDA-graph captures on a cold GPU


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise ValueError(f"expected LOW:HIGH token counts with 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def add_bench_arguments(parser) -> None:
    parser.add_argument("--backends", type=lambda t: t.split(","), default=list(BACKENDS),
                        help=f"backends to serve, one after the other (default {','.join(BACKENDS)})")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 8, 64],
                        help="concurrent streams per run (default 1,8,64)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per run (default: 2 x concurrency, at least 4)")
    parser.add_argument("--rate", type=float, default=None,
                        help="send requests at this rate (requests/s) instead of closed loop")
    parser.add_argument("--prompt-tokens", type=_length_range, default=(128, 2048),
                        help="prompt lengths, uniform over LOW:HIGH tokens (default 128:2048)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--name", default="serve", help="a label for the records and the file name")
    parser.add_argument("--out", default="bench-results", help="folder for the JSON and PNG")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--commit", help="commit to record (default: $FLASHMOE_COMMIT, else git)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, backend: str, port: int, args) -> list[str]:
    """The ``flashmoe-science serve`` command line of one backend, with the bench's cache options."""
    command = [sys.executable, "-m", "flashmoe_science.cli", "serve", model, "--backend", backend, "--port",
               str(port), "--page-size", str(args.page_size), "--cache-tokens", str(args.cache_tokens),
               "--max-batch-tokens", str(args.max_batch_tokens), "--seed", str(args.seed)]
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

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, then the exit status (SIGKILL and -9 if it has not exited after ``timeout_s``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()
        return self.process.returncode


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


def _measure(server: ServerProcess, args, backend: str, log) -> list[dict]:
    from flashmoe_science.serving.load import run_load, summarize
    from flashmoe_science.serving.model import default_placement

    device, dtype = default_placement(args.device, args.dtype)
    name = served_model_name(server.url)
    top = max(args.concurrency)
    warmup = make_prompts(args.model, top, args.prompt_tokens, seed=args.seed + 1)
    summary = summarize(run_load(server.url, name, warmup, args.new_tokens, top))
    log(f"{backend}: warm-up {summary['requests']} requests, {summary['errors']} errors, {summary['seconds']} s")
    records = []
    for index, concurrency in enumerate(args.concurrency):
        count = args.requests or max(4, 2 * concurrency)
        prompts = make_prompts(args.model, count, args.prompt_tokens, seed=args.seed + 100 + index)
        summary = summarize(run_load(server.url, name, prompts, args.new_tokens, concurrency, args.rate))
        records.append({"op": "serve", "name": args.name, "backend": backend, "model": name, "device": device,
                        "dtype": dtype,
                        "concurrency": concurrency, "rate": args.rate, "prompt_tokens_range": list(args.prompt_tokens),
                        "new_tokens": args.new_tokens, **summary})
        log(f"{backend}: concurrency {concurrency}: {summary['tokens_per_s']} tokens/s, TTFT p50 "
            f"{summary['ttft_ms_p50']} ms, ITL p50 {summary['itl_ms_p50']} ms, {summary['errors']} errors")
    return records


def bench_backend(args, backend: str, log, log_dir=None) -> list[dict]:
    """Starts the backend's server, measures every concurrency, stops it; its records carry the exit status."""
    port = free_port()
    log_path = None
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log_path = Path(log_dir) / f"server-{args.name}-{backend}.log"
    server = ServerProcess(serve_command(args.model, backend, port, args), port, log_path)
    try:
        started = time.monotonic()
        cache = server.wait_ready()
        log(f"{backend}: ready in {time.monotonic() - started:.0f} s, cache {cache}")
        records = _measure(server, args, backend, log)
    finally:
        status = server.stop()
    log(f"{backend}: server exited with status {status}")
    for record in records:
        record.update(server_exit_status=status, cache_pages=cache["pages"], page_size=cache["page_size"])
    return records


def plot_serve(records: list[dict], path, title: str):
    from flashmoe_science.bench.report import plot_panels

    panels = {}
    for metric, label in (("tokens_per_s", "tokens/s"), ("ttft_ms_p50", "TTFT p50 (ms)"),
                          ("itl_ms_p50", "ITL p50 (ms)")):
        for record in records:
            if record.get(metric) is not None:
                panels.setdefault(label, {}).setdefault(record["backend"], []).append(
                    (record["concurrency"], record[metric]))
    return plot_panels(path, panels, xlabel="concurrent streams", ylabel="", suptitle=title)


def run_bench(args) -> int:
    from flashmoe_science.bench.report import PartialResults, environment_metadata, resolve_commit, write_results

    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"--backends: unknown {', '.join(unknown)} (known: {', '.join(BACKENDS)})")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    import transformers

    envelope = {**environment_metadata(resolve_commit(args.commit)), "transformers": transformers.__version__,
                "suite": f"serve-{args.name}"}
    partial = PartialResults(args.out, envelope)  # what was measured survives a killed run
    records = []
    for backend in args.backends:
        records += bench_backend(args, backend, log, log_dir=args.out)
        partial(records)
    path = write_results(args.out, envelope, records)
    partial.finish()
    print(json.dumps(records, indent=1))
    print(f"results: {path}", file=sys.stderr)
    if not args.no_plot:
        plot_serve(records, path.with_suffix(".png"), title=f"{args.name}, {path.stem}")
    return 0
