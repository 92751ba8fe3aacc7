"""An e4m3 paged KV cache for transformers' continuous batching (``generate_batch``, ``flashmoe-science serve``),
read by this library's block-table decode with its per-KV-head scales.

transformers' paged cache (``PagedAttentionCache``) keeps keys and values in the model's dtype, in one flat byte
tensor viewed per layer. `E4m3PagedCache` keeps that layout at one byte a value (half a bf16 cache's bytes for the
same tokens), with a float32 scale per layer and KV head (a cache value times its scale is the key or value, the
decode kernels' convention):

- the index path (prefill steps; every step on the CPU) writes ``e4m3(value / scale)``, saturated at +-448
  (`attention.decode.reference.quantize_to_cache`, the kernels' rule for the keys they append), and hands the
  step's attention ``cache value x scale`` in the model's dtype, the new tokens' included: every attention sees the
  keys and values the cache holds;
- the decode fast path (CUDA, ``hf.register_flash``) hands ``flash_attn_with_kvcache`` the e4m3 pages and the
  layer's ``k_scale`` / ``v_scale``: the kernel appends the new token as e4m3 and attends the e4m3 cache.

The scales are fixed before the first request, since a value written under one scale is read under the same one:
`calibrate_scales` runs one forward over random tokens and takes ``HEADROOM x amax / 448`` per layer and head of its
keys and values (vLLM's ``calculate_kv_scales`` likewise divides the first batch's amax by a constant below 448).
Larger values saturate at ``448 x scale``.

transformers builds the cache inside its manager (``ContinuousBatchingManager._create_batch_processor``) and has no
option for its dtype: `use_e4m3_cache` makes one manager build `E4m3PagedCache` instead. That reaches into its
internals, so it supports the transformers releases it was tested on (`integrations.versions`: 5.24 and 5.25, whose
paged cache differs only where MLA layers are, which `check_config` refuses), with a one-line error on others.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from flashmoe_science.attention.decode.reference import quantize_to_cache
from flashmoe_science.fp8_format import FP8, FP8_MAX
from flashmoe_science.integrations import versions

HEADROOM = 2.0  # scale = HEADROOM x calibration amax / 448: values up to twice the calibration's largest are kept
CALIBRATION_SHAPE = (4, 512)  # random sequences x tokens (at most the model's positions) of the calibration forward
KV_CACHE_DTYPES = ("auto", "e4m3")  # "auto": the model's dtype (transformers' own cache)


@dataclass(frozen=True)
class KVScales:
    """float32 scales of an e4m3 cache, ``(layers, Hkv)`` each: ``k[layer]`` and ``v[layer]`` are the
    ``k_scale`` / ``v_scale`` of that layer's ``flash_attn_with_kvcache`` call."""

    k: torch.Tensor
    v: torch.Tensor

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]


def check_config(config) -> None:
    """A ValueError if the model has layers the e4m3 cache does not hold: sliding-window layers (transformers keeps
    them in a ring of pages that the block-table decode does not read) and MLA layers (transformers 5.25 caches
    their latents, not keys and values)."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    text = config.get_text_config()
    if getattr(text, "kv_lora_rank", None) is not None:
        raise ValueError("the e4m3 KV cache holds keys and values; this model's MLA layers cache latents "
                         f"(config.kv_lora_rank={text.kv_lora_rank})")
    kinds = set(group_layers_by_attn_type(text))
    if kinds != {"full_attention"}:
        raise ValueError(f"the e4m3 KV cache holds full-attention layers only; this model has "
                         f"{', '.join(sorted(kinds))} layers")


def _recording_cache(config):
    from transformers import DynamicCache

    class AmaxCache(DynamicCache):
        """A DynamicCache that records each layer's per-KV-head amax of the keys and values it is given."""

        def __init__(self):
            super().__init__(config=config)
            self.amax = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            # (batch, Hkv, tokens, D) -> (Hkv,)
            self.amax[layer_idx] = tuple(t.detach().abs().amax(dim=(0, 2, 3)).float()
                                         for t in (key_states, value_states))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return AmaxCache()


@torch.no_grad()
def calibrate_scales(model, seed: int = 0) -> KVScales:
    """The e4m3 cache's scales for ``model``: one forward over `CALIBRATION_SHAPE` random tokens (seeded), then
    ``HEADROOM x amax / 448`` of each layer's keys and values per KV head (a head whose values are all zero gets
    scale 1)."""
    config = model.config.get_text_config()
    batch, length = CALIBRATION_SHAPE
    length = min(length, getattr(config, "max_position_embeddings", None) or length)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(config.vocab_size, (batch, length), generator=generator).to(model.device)
    recorder = _recording_cache(config)
    model(input_ids=ids, cache=recorder, use_cache=True)
    layers = range(config.num_hidden_layers)
    missing = [i for i in layers if i not in recorder.amax]
    if missing:
        raise ValueError(f"the calibration forward wrote no keys for layers {missing}: the e4m3 cache needs every "
                         f"layer's attention to use the cache")
    scales = []
    for part in (0, 1):
        amax = torch.stack([recorder.amax[i][part] for i in layers])
        scales.append(torch.where(amax > 0, HEADROOM * amax / FP8_MAX, torch.ones_like(amax)).contiguous())
    return KVScales(*scales)


def _cache_class():
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    class E4m3PagedCache(PagedAttentionCache):
        """transformers' paged cache stored as e4m3 with per-layer, per-KV-head scales (the module docstring)."""

        def __init__(self, *args, scales: KVScales, dtype: torch.dtype, continuous_batching_config, **kwargs):
            if continuous_batching_config.num_blocks is None:
                # transformers sizes an unsized cache by the activations' dtype, which is the cache's here
                raise ValueError("the e4m3 KV cache needs its size: ContinuousBatchingConfig(num_blocks=...)")
            # one byte a value: uint8 views of transformers' byte tensor, read as e4m3 (index_copy_ has no e4m3
            # kernel on the CPU)
            super().__init__(*args, dtype=torch.uint8, continuous_batching_config=continuous_batching_config,
                             **kwargs)
            self.model_dtype, self.scales = dtype, scales

        @torch.compiler.disable  # as transformers' own update: views of the cache tensor
        def update(self, key_states, value_states, layer_idx, kwargs):
            k_scale, v_scale = self.scales.layer(layer_idx)
            if kwargs.get("block_table") is not None:  # the decode fast path: the kernel writes and reads
                out = super().update(key_states, value_states, layer_idx, kwargs)
                kwargs["k_cache"], kwargs["v_cache"] = kwargs["k_cache"].view(FP8), kwargs["v_cache"].view(FP8)
                kwargs["k_scale"], kwargs["v_scale"] = k_scale, v_scale
                return out
            stored = [_quantize(t, s) for t, s in ((key_states, k_scale), (value_states, v_scale))]
            keys, values = super().update(*stored, layer_idx, kwargs)
            return _dequantize(keys, k_scale, self.model_dtype), _dequantize(values, v_scale, self.model_dtype)

    return E4m3PagedCache


def _quantize(states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(1, Hkv, L, D) states -> their e4m3 bytes (uint8, same shape)."""
    return quantize_to_cache(states.transpose(1, 2), scale).transpose(1, 2).view(torch.uint8)


def _dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, Hkv, L, D) e4m3 bytes -> values x scale in ``dtype``."""
    return (stored.view(FP8).to(torch.float32) * scale[:, None, None]).to(dtype)


def use_e4m3_cache(manager, scales: KVScales) -> None:
    """Makes transformers' continuous-batching ``manager`` (``model.init_continuous_batching(...)``, before its
    warm-up or start) build its paged cache as `E4m3PagedCache` with ``scales``."""
    versions.require("transformers-cb")
    check_config(manager.model.config)
    from transformers.generation.continuous_batching import continuous_api

    cache_class, create = _cache_class(), manager._create_batch_processor

    def e4m3_cache(*args, **kwargs):
        return cache_class(*args, scales=scales, **kwargs)

    def create_batch_processor():
        with _replaced(continuous_api, "PagedAttentionCache", e4m3_cache):
            return create()

    manager._create_batch_processor = create_batch_processor


@contextlib.contextmanager
def _replaced(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
