"""transformers' OpenAI-compatible app (the one ``transformers serve`` runs) serving one prepared model.

``transformers serve`` loads its model itself and accepts only its own attention names, so ours never reaches it.
This module builds the same app from the same parts (``transformers.cli.serving``: its handlers and
``build_server``) around a model loaded by `serving.model`, with a few subclasses of its serving internals, which
moved between releases: `stack_5_24` (the model in the server's process, behind a model manager and a
continuous-batching manager) and `stack_5_25` (an engine client per model, the model in a process of its own, here a
thread). Hence the supported releases (`integrations.versions`; a one-line error on others). Both:

- serve the prepared model and tokenizer instead of loading one by name;
- start continuous batching with the server, not at the first request: the paged cache (e4m3 with its scales when
  given them: `integrations.hf_e4m3_cache`) and any CUDA-graph captures exist before a client waits on them, and the
  cache's size is known. A request whose prompt and ``max_tokens`` cannot fit in the cache (or past the model's
  positions) gets a 400 naming the numbers (`cb.check_length`); in transformers it would wait forever for pages that
  never come;
- on shutdown (SIGINT / SIGTERM, through uvicorn) stop the generation loop hard after uvicorn's graceful period, so
  the process exits instead of waiting on its non-daemon thread.

Streams closed by the client are cancelled by transformers' handlers, which returns the request's cache pages to the
pool; ``GET /cache`` reports the pool (pages, free fraction, requests), which is how that is tested.
"""

from __future__ import annotations

import importlib
import importlib.util

from flashmoe_science.integrations import versions

SERVE_PACKAGES = ("fastapi", "uvicorn", "openai")
GRACEFUL_SHUTDOWN_S = 5  # open streams may finish for this long after SIGINT/SIGTERM


def check_serving_stack() -> None:
    """An ImportError naming the ``serve`` extra if a serving package is missing; a RuntimeError naming the
    supported releases if the installed transformers is not one of them (`integrations.versions`)."""
    missing = [name for name in ("transformers", *SERVE_PACKAGES) if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"{', '.join(missing)} not installed: pip install \"flashmoe-science[serve]\"")
    versions.require("transformers-cb")


def _stack():
    """The module serving the app on the installed transformers' serving internals."""
    from transformers.cli.serving import model_manager

    name = "stack_5_25" if hasattr(model_manager, "EngineClient") else "stack_5_24"
    return importlib.import_module(f"flashmoe_science.serving.{name}")


def cb_config(backend: str, page_size: int, cache_tokens: int, max_batch_tokens: int, cuda_graphs=None):
    """transformers' ``ContinuousBatchingConfig`` with a cache of ``cache_tokens`` tokens (rounded up to pages) for
    ``backend``: the SDPA baseline is kept on SDPA (not switched to a flash_attn package)."""
    from flashmoe_science.integrations import hf

    options = dict(num_blocks=-(-cache_tokens // page_size), max_batch_tokens=max_batch_tokens)
    if cuda_graphs is not None:
        options["use_cuda_graph"] = cuda_graphs
    if backend == "transformers-sdpa":
        hf.paged_sdpa(options)
    return hf.continuous_batching_config(page_size, **options)


class Server:
    """The app for one prepared model: ``start()`` starts continuous batching, ``app`` is the FastAPI app (run by
    uvicorn in `run`, or by a test's own uvicorn), ``shutdown()`` stops the generation loop and frees the model.
    ``kv_scales`` (`hf_e4m3_cache.KVScales`): the paged cache is e4m3 with these scales; None: the model's dtype."""

    def __init__(self, name: str, model, tokenizer, config, kv_scales=None):
        check_serving_stack()
        self.name, self.model, self.kv_scales = name, model, kv_scales
        self.served = _stack().Served(name, model, tokenizer, config, kv_scales, GRACEFUL_SHUTDOWN_S)
        self.app = self.served.app
        self.app.add_api_route("/cache", self.cache_statistics, methods=["GET"])

    def start(self) -> None:
        """Builds the paged cache and starts the continuous-batching loop (what transformers does at the first
        request)."""
        self.served.start()

    def cache_statistics(self) -> dict:
        """The model's attention implementation and the paged cache's pool: its dtype (``e4m3`` or the model's),
        pages and bytes, the fractions free and kept only for prefix reuse (unreferenced full pages, evicted when
        pages run out), the requests holding or awaiting pages, and the per-request limit."""
        processor = self.served.manager.batch_processor
        scheduler, cache = processor.scheduler, processor.cache
        page_size, max_request_tokens = self.served.limits
        total_bytes = cache.num_sectors * cache.bytes_per_sector
        reusable = sum(len(a.ledger.cached_blocks) * a.bytes_per_block for a in cache.cache_allocators.values())
        kv_dtype = "e4m3" if self.kv_scales is not None else str(self.model.dtype).removeprefix("torch.")
        return {"attn_implementation": self.model.config._attn_implementation, "kv_cache_dtype": kv_dtype,
                "pages": cache.num_blocks, "cache_bytes": total_bytes, "page_size": page_size,
                "free_fraction": cache.compute_free_capacity(), "reusable_fraction": reusable / total_bytes,
                "requests_active": len(scheduler.active_requests),
                "requests_waiting": len(scheduler.waiting_requests), "max_request_tokens": max_request_tokens}

    def shutdown(self) -> None:
        self.served.shutdown()


def _exit_after_sigterm(signum, frame):
    raise SystemExit(0)


def run(server: Server, host: str, port: int, log_level: str = "warning") -> None:
    """Serves until SIGINT or SIGTERM, then stops the generation loop and returns (SIGTERM: exits with status 0;
    SIGINT: KeyboardInterrupt). uvicorn handles the signal first (new connections refused, open streams given
    `GRACEFUL_SHUTDOWN_S`), then restores the handlers it found and raises the signal again: the SIGTERM handler
    set here turns that into SystemExit, so the generation loop is stopped instead of the process killed."""
    import signal

    import uvicorn

    server.start()
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    previous = signal.signal(signal.SIGTERM, _exit_after_sigterm)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.shutdown()
