"""The served app on transformers 5.25's serving stack (``transformers.cli.serving``).

5.25 runs each model in a process of its own (its ``EngineClient`` sends the requests there and reads the results
back over queues), which would load the model again by name. The prepared model stays in this process instead:
`PreparedEngine` is an ``EngineClient`` whose engine is a thread (`EngineThread`) running transformers'
continuous-batching runner (``CBGenerateRunner``) on that model, with the requests and results on in-process queues;
the handlers, the app and the streaming are transformers' own.
"""

from __future__ import annotations

import queue
import threading

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import EngineClient, ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import CBGenerateRunner, GenerationState, canonical_model_id, prompt_length

from flashmoe_science.serving import cb


class PreparedLoader:
    """What an ``EngineClient`` reads of its model in the API server, from the prepared model."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def load_config(self, model_id: str):
        return self.model.config, self.model.generation_config

    def load_processor(self, model_id: str):
        return self.tokenizer


class PreparedRunner(CBGenerateRunner):
    """transformers' continuous-batching runner, its cache e4m3 when given ``kv_scales``; knows its request limit."""

    def __init__(self, model, tokenizer, send_results, config, kv_scales, context_length):
        self.kv_scales = kv_scales
        super().__init__(model, tokenizer, send_results, config, context_length)  # builds the cache, starts
        self.page_size, self.max_request_tokens = cb.request_limit(self.manager, model)

    def _start_continuous_batching(self, model, cb_config, context_length):
        init = model.init_continuous_batching

        def init_prepared(*args, **kwargs):
            manager = init(*args, **kwargs)
            cb.prepare(manager, self.kv_scales)
            return manager

        model.init_continuous_batching = init_prepared  # before transformers' warm-up builds the cache
        try:
            return super()._start_continuous_batching(model, cb_config, context_length)
        finally:
            del model.init_continuous_batching


class RequestQueue(queue.Queue):
    """The engine's requests, in this process (``EngineClient.shutdown`` calls ``cancel_join_thread``, which a
    process's queue has)."""

    def cancel_join_thread(self) -> None:
        pass


class EngineThread:
    """The model's engine as a thread of this process, with what ``EngineClient`` calls on a model's process."""

    exitcode = None

    def __init__(self, runner: PreparedRunner, requests: RequestQueue, graceful_s: float):
        self.runner, self.requests, self.graceful_s = runner, requests, graceful_s
        self.thread = threading.Thread(target=self._serve, name="model", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        """As transformers' engine loop: each request to the runner; an error fails that request only."""
        while (message := self.requests.get()) is not None:
            method, request_id, *args = message
            try:
                getattr(self.runner, method)(request_id, *args)
            except ValueError as error:  # the request's fault: a 400
                self.runner.send_results([], [], [(request_id, ValueError(str(error)))])
            except Exception as error:
                self.runner.send_results([], [], [(request_id, RuntimeError(f"{type(error).__name__}: {error}"))])

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def terminate(self) -> None:
        """Stops continuous batching (open requests get `graceful_s`), then the thread."""
        self.runner.manager.stop(block=True, timeout=self.graceful_s, hard_stop=True)
        self.requests.put(None)

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def kill(self) -> None:
        pass


class PreparedEngine(EngineClient):
    """The prepared model served under ``name``, its engine a thread of this process (`EngineThread`), refusing
    requests its cache cannot hold."""

    runner = None

    def __init__(self, name: str, model, tokenizer, generation: GenerationState, kv_scales, graceful_s: float):
        self.model, self.kv_scales, self.graceful_s = model, kv_scales, graceful_s
        super().__init__(canonical_model_id(name), PreparedLoader(model, tokenizer), generation)

    def start_process(self, model_id, loader, generation_state, api_servers=1, on_progress=None):
        requests, results = RequestQueue(), queue.Queue()
        self.runner = PreparedRunner(self.model, loader.tokenizer, lambda *message: results.put(message),
                                     generation_state.cb_config, self.kv_scales,
                                     generation_state.context_length(self.model.config))
        return EngineThread(self.runner, requests, self.graceful_s), requests, [results]

    def _check_length(self, inputs: dict, generation_kwargs: dict) -> None:
        cb.check_length(prompt_length(inputs), generation_kwargs["max_new_tokens"], self.runner.max_request_tokens)

    def generate_streaming(self, inputs, generation_kwargs, response_parser=None):
        self._check_length(inputs, generation_kwargs)
        return super().generate_streaming(inputs, generation_kwargs, response_parser)

    async def generate_non_streaming(self, inputs, generation_kwargs):
        self._check_length(inputs, generation_kwargs)
        return await super().generate_non_streaming(inputs, generation_kwargs)


class PreparedModels(ModelManager):
    """Serves one model, the prepared one, under its name."""

    def __init__(self, name: str, engine: PreparedEngine):
        super().__init__(loader=engine.loader, generation_state=engine.generation_state, model_timeout=-1)
        self.force_model = name
        self.engines[engine.model_id] = engine


class Served:
    """The app serving ``model`` as ``name``; ``start()`` builds the cache and starts continuous batching."""

    def __init__(self, name: str, model, tokenizer, config, kv_scales, graceful_s: float):
        generation = GenerationState(continuous_batching=True, cb_config=config)
        self.engine = PreparedEngine(name, model, tokenizer, generation, kv_scales, graceful_s)
        self.models = PreparedModels(name, self.engine)
        common = dict(model_manager=self.models, generation_state=generation)
        self.app = build_server(
            self.models, ChatCompletionHandler(**common), completion_handler=CompletionHandler(**common),
            response_handler=ResponseHandler(**common), transcription_handler=TranscriptionHandler(self.models),
            systemone_handler=SystemOneHandler(**common))

    def start(self) -> None:
        self.engine.start()

    @property
    def manager(self):
        """transformers' ``ContinuousBatchingManager`` (after `start`)."""
        return self.engine.runner.manager

    @property
    def limits(self) -> tuple[int, int]:
        return self.engine.runner.page_size, self.engine.runner.max_request_tokens

    def shutdown(self) -> None:
        self.models.shutdown()
