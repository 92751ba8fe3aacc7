"""transformers' OpenAI-compatible app (the one ``transformers serve`` runs) serving one prepared model.

``transformers serve`` loads its model itself and accepts only its own attention names, so ours never reaches it.
This module builds the same app from the same parts (``transformers.cli.serving``: its model manager, generation
state, chat / completions handlers and ``build_server``) around a model loaded by `serving.model`, with three small
subclasses, which is why it is pinned to the transformers versions it was tested on (`SUPPORTED_TRANSFORMERS`; a
clear error on others):

- the model manager hands out the prepared model and tokenizer instead of loading one by name;
- the continuous-batching manager is started with the server, not at the first request: the paged cache (e4m3
  with its scales when given them: `integrations.hf_e4m3_cache`) and any CUDA-graph captures exist before a client
  waits on them, and the cache's size is known. A request whose prompt
  and ``max_tokens`` cannot fit in the cache (or past the model's positions) gets a 400 naming the numbers; in
  transformers it would wait forever for pages that never come;
- on shutdown (SIGINT / SIGTERM, through uvicorn) the generation loop is stopped hard after uvicorn's graceful
  period, so the process exits instead of waiting on its non-daemon thread.

Streams closed by the client are cancelled by transformers' handlers (``cancel_request``), which returns the
request's cache pages to the pool; ``GET /cache`` reports the pool (pages, free fraction, requests), which is how
that is tested.
"""

from __future__ import annotations

import copy
import importlib.util

SUPPORTED_TRANSFORMERS = ("5.24",)  # major.minor versions whose `transformers.cli.serving` this module was tested on
SERVE_PACKAGES = ("fastapi", "uvicorn", "openai")
GRACEFUL_SHUTDOWN_S = 5  # open streams may finish for this long after SIGINT/SIGTERM


def check_serving_stack() -> None:
    """An ImportError naming the ``serve`` extra if a serving package is missing; a RuntimeError naming the
    supported versions if the installed transformers is not one of them."""
    import transformers

    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"{', '.join(missing)} not installed: pip install \"flashmoe-science[serve]\"")
    version = ".".join(transformers.__version__.split(".")[:2])
    if version not in SUPPORTED_TRANSFORMERS:
        raise RuntimeError(f"flashmoe-science serve builds on transformers' serving internals as of transformers "
                           f"{', '.join(SUPPORTED_TRANSFORMERS)}; installed: {transformers.__version__}. Install a "
                           f"supported version (pip install \"transformers=={SUPPORTED_TRANSFORMERS[-1]}.*\").")


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


def _parts():
    """The subclasses of transformers' serving classes (defined on first use: the module imports without them)."""
    from fastapi import HTTPException
    from transformers.cli.serving.model_manager import ModelManager, TimedModel
    from transformers.cli.serving.utils import CBGenerateManager, GenerationState

    from flashmoe_science.integrations.hf_e4m3_cache import use_e4m3_cache

    class PreparedModelManager(ModelManager):
        """Serves one model under ``name``: every request gets the prepared model and tokenizer."""

        def __init__(self, name: str, model, tokenizer):
            super().__init__(device=str(model.device), model_timeout=-1)
            self.force_model = name
            self.loaded_models[name] = TimedModel(model, timeout_seconds=-1, processor=tokenizer)

        def load_model_and_processor(self, model_id_and_revision, progress_callback=None, tqdm_class=None,
                                     gguf_file=None):
            timed = self.loaded_models[self.force_model]
            return timed.model, timed.processor

    class CheckedCBManager(CBGenerateManager):
        """transformers' continuous-batching manager, started eagerly, refusing requests the cache cannot hold; an
        e4m3 paged cache with ``kv_scales`` (`hf_e4m3_cache.KVScales`) when they are given."""

        max_request_tokens = page_size = kv_scales = None

        def init_cb(self, model, gen_config) -> None:
            if self._cb is not None:
                return
            manager = model.init_continuous_batching(generation_config=gen_config,
                                                     continuous_batching_config=self._cb_config)
            if self.kv_scales is not None:
                use_e4m3_cache(manager, self.kv_scales)
            manager.warmup()  # builds the paged cache (and captures CUDA graphs when it uses them)
            cache = manager.batch_processor.cache
            self.page_size = manager.continuous_batching_config.page_size
            capacity = cache.num_blocks * self.page_size
            positions = getattr(model.config.get_text_config(), "max_position_embeddings", None) or capacity
            self.max_request_tokens = min(capacity, positions)
            manager.start()
            self._cb = manager

        def _check_length(self, inputs, gen_config) -> None:
            prompt, new = len(inputs["input_ids"]), gen_config.max_new_tokens
            if prompt + new > self.max_request_tokens:
                raise HTTPException(status_code=400, detail=(
                    f"the prompt ({prompt} tokens) plus max_tokens ({new}) exceeds this server's limit of "
                    f"{self.max_request_tokens} tokens per request (its KV cache and the model's positions)"))

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            self._check_length(inputs, gen_config)
            return super().generate_streaming(model, processor, inputs, gen_config, request_id, response_parser)

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            self._check_length(inputs, gen_config)
            return await super().generate_non_streaming(model, processor, inputs, gen_config, request_id)

        def stop(self) -> None:
            if self._cb is not None:
                self._cb.stop(block=True, timeout=GRACEFUL_SHUTDOWN_S, hard_stop=True)
                self._cb = None

    class ServedGeneration(GenerationState):
        """Continuous batching of one model through a `CheckedCBManager`."""

        def __init__(self, config, kv_scales=None):
            super().__init__(continuous_batching=True, cb_config=config)
            self._cb_manager = CheckedCBManager(cb_config=config)
            self._cb_manager.kv_scales = kv_scales

        def get_manager(self, model_id: str, use_cb: bool = False):
            if not use_cb:
                raise HTTPException(status_code=400, detail="this server runs continuous batching only")
            return self._cb_manager

        @property
        def manager(self):
            return self._cb_manager

    return PreparedModelManager, ServedGeneration


class Server:
    """The app for one prepared model: ``start()`` starts continuous batching, ``app`` is the FastAPI app (run by
    uvicorn in `run`, or by a test's own uvicorn), ``shutdown()`` stops the generation loop and frees the model.
    ``kv_scales`` (`hf_e4m3_cache.KVScales`): the paged cache is e4m3 with these scales; None: the model's dtype."""

    def __init__(self, name: str, model, tokenizer, config, kv_scales=None):
        check_serving_stack()
        from transformers.cli.serving.chat_completion import ChatCompletionHandler
        from transformers.cli.serving.completion import CompletionHandler
        from transformers.cli.serving.response import ResponseHandler
        from transformers.cli.serving.server import build_server
        from transformers.cli.serving.systemone import SystemOneHandler
        from transformers.cli.serving.transcription import TranscriptionHandler

        PreparedModelManager, ServedGeneration = _parts()
        self.name, self.model = name, model
        self.models = PreparedModelManager(name, model, tokenizer)
        self.generation = ServedGeneration(config, kv_scales)
        common = dict(model_manager=self.models, generation_state=self.generation)
        self.app = build_server(
            self.models, ChatCompletionHandler(**common), completion_handler=CompletionHandler(**common),
            response_handler=ResponseHandler(**common),
            transcription_handler=TranscriptionHandler(self.models, self.generation),
            systemone_handler=SystemOneHandler(**common), generation_state=self.generation)
        self.app.add_api_route("/cache", self.cache_statistics, methods=["GET"])

    def start(self) -> None:
        """Starts the continuous-batching loop (what transformers does at the first request)."""
        generation_config = copy.deepcopy(self.model.generation_config)
        generation_config.use_cache = False  # continuous batching keeps its own paged cache
        self.generation.manager.init_cb(self.model, generation_config)

    def cache_statistics(self) -> dict:
        """The model's attention implementation and the paged cache's pool: its dtype (``e4m3`` or the model's),
        pages and bytes, the fractions free and kept only for prefix reuse (unreferenced full pages, evicted when
        pages run out), the requests holding or awaiting pages, and the per-request limit."""
        manager = self.generation.manager
        scheduler = manager.scheduler
        cache = scheduler.cache
        total_bytes = cache.num_sectors * cache.bytes_per_sector
        reusable = sum(len(a.ledger.cached_blocks) * a.bytes_per_block for a in cache.cache_allocators.values())
        kv_dtype = "e4m3" if manager.kv_scales is not None else str(self.model.dtype).removeprefix("torch.")
        return {"attn_implementation": self.model.config._attn_implementation, "kv_cache_dtype": kv_dtype,
                "pages": cache.num_blocks, "cache_bytes": total_bytes, "page_size": manager.page_size, "free_fraction": cache.compute_free_capacity(),
                "reusable_fraction": reusable / total_bytes, "requests_active": len(scheduler.active_requests),
                "requests_waiting": len(scheduler.waiting_requests), "max_request_tokens": manager.max_request_tokens}

    def shutdown(self) -> None:
        self.generation.shutdown()
        self.models.shutdown()


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
