"""The served app on transformers 5.24's serving stack (``transformers.cli.serving``), which runs the model in the
server's process: its model manager, generation state and continuous-batching manager, subclassed to serve the
prepared model."""

from __future__ import annotations

import copy

from fastapi import HTTPException
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager, TimedModel
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import CBGenerateManager, GenerationState

from flashmoe_science.serving import cb


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
    """transformers' continuous-batching manager, started eagerly, refusing requests the cache cannot hold."""

    max_request_tokens = page_size = None

    def __init__(self, cb_config, kv_scales, graceful_s: float):
        super().__init__(cb_config=cb_config)
        self.kv_scales, self.graceful_s = kv_scales, graceful_s

    def init_cb(self, model, gen_config) -> None:
        if self._cb is not None:
            return
        manager = model.init_continuous_batching(generation_config=gen_config,
                                                 continuous_batching_config=self._cb_config)
        cb.prepare(manager, self.kv_scales)
        manager.warmup()  # builds the paged cache (and captures CUDA graphs when it uses them)
        self.page_size, self.max_request_tokens = cb.request_limit(manager, model)
        manager.start()
        self._cb = manager

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        cb.check_length(len(inputs["input_ids"]), gen_config.max_new_tokens, self.max_request_tokens)
        return super().generate_streaming(model, processor, inputs, gen_config, request_id, response_parser)

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        cb.check_length(len(inputs["input_ids"]), gen_config.max_new_tokens, self.max_request_tokens)
        return await super().generate_non_streaming(model, processor, inputs, gen_config, request_id)

    def stop(self) -> None:
        if self._cb is not None:
            self._cb.stop(block=True, timeout=self.graceful_s, hard_stop=True)
            self._cb = None


class ServedGeneration(GenerationState):
    """Continuous batching of one model through a `CheckedCBManager`."""

    def __init__(self, config, kv_scales, graceful_s: float):
        super().__init__(continuous_batching=True, cb_config=config)
        self._cb_manager = CheckedCBManager(config, kv_scales, graceful_s)

    def get_manager(self, model_id: str, use_cb: bool = False):
        if not use_cb:
            raise HTTPException(status_code=400, detail="this server runs continuous batching only")
        return self._cb_manager

    @property
    def manager(self):
        return self._cb_manager


class Served:
    """The app serving ``model`` as ``name``; ``start()`` builds the cache and starts continuous batching."""

    def __init__(self, name: str, model, tokenizer, config, kv_scales, graceful_s: float):
        self.model = model
        self.models = PreparedModelManager(name, model, tokenizer)
        self.generation = ServedGeneration(config, kv_scales, graceful_s)
        common = dict(model_manager=self.models, generation_state=self.generation)
        self.app = build_server(
            self.models, ChatCompletionHandler(**common), completion_handler=CompletionHandler(**common),
            response_handler=ResponseHandler(**common),
            transcription_handler=TranscriptionHandler(self.models, self.generation),
            systemone_handler=SystemOneHandler(**common), generation_state=self.generation)

    def start(self) -> None:
        generation_config = copy.deepcopy(self.model.generation_config)
        generation_config.use_cache = False  # continuous batching keeps its own paged cache
        self.generation.manager.init_cb(self.model, generation_config)

    @property
    def manager(self):
        """transformers' ``ContinuousBatchingManager`` (after `start`)."""
        return self.generation.manager._cb

    @property
    def limits(self) -> tuple[int, int]:
        return self.generation.manager.page_size, self.generation.manager.max_request_tokens

    def shutdown(self) -> None:
        self.generation.shutdown()
        self.models.shutdown()
