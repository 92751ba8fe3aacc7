"""This library's attention as SGLang's ``flashmoe`` attention backend (SGLang 0.5.17's backend contract).

SGLang builds the metadata once per batch (`FlashMoEAttnBackend.init_forward_metadata`, or for decode CUDA graphs
`init_forward_metadata_out_graph` before capture and each replay plus `init_forward_metadata_in_graph`, recorded in
the graph) and calls `forward_extend` or `forward_decode` in every layer, which write the layer's new keys to the pool
and run our calls; the translation of a batch into them is `metadata` (no SGLang there). What the backend cannot
honour is refused when SGLang builds it (engine start), one line naming the setting.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from flashmoe_science.integrations.engine_attention import LayerOptions, warm_prefill
from flashmoe_science.integrations.sglang import NAME
from flashmoe_science.integrations.sglang.metadata import (DecodeGraphBuffers, DecodeStep, ExtendStep, PoolLayout,
                                                           build_decode, build_extend, page_size_refusal, run_decode,
                                                           run_extend)

# head sizes the kernels take (SGLang's models use 64, 80, 96, 128, 256)
MAX_HEAD_SIZE = 256


def _refusal(model_runner) -> str | None:
    """None where the engine's settings suit the backend; else one line naming the setting."""
    args = model_runner.server_args
    reason = page_size_refusal(model_runner.page_size)
    if reason is not None:
        return reason
    if model_runner.use_mla_backend:
        return "MLA models (DeepSeek V2/V3, Kimi, ...) are not supported: use --attention-backend triton or fa3"
    if getattr(args, "speculative_algorithm", None):
        return f"speculative decoding (--speculative-algorithm {args.speculative_algorithm}) is not supported"
    if getattr(args, "dcp_size", 1) > 1:
        return f"decode context parallelism (--dcp-size {args.dcp_size}) is not supported"
    if getattr(args, "enable_deterministic_inference", False):
        return "--enable-deterministic-inference is not supported (our splits depend on the batch's shapes)"
    if model_runner.model_config.is_encoder_decoder:
        return "encoder-decoder models (cross attention) are not supported"
    pool = model_runner.token_to_kv_pool
    if type(pool) is not MHATokenToKVPool or getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        return (f"the KV pool {type(pool).__name__} (layout {getattr(pool, 'kv_cache_layout', '?')}) is not "
                f"supported: the backend reads SGLang's plain token-major MHA pool (no hybrid SWA or quantized pool, "
                f"no SGLANG_USE_HND_KVCACHE)")
    if getattr(model_runner.token_to_kv_pool_allocator, "translate_kv_loc", None) is not None:
        return "KV pools with translated slot ids (the unified memory pool) are not supported"
    if model_runner.dtype not in (torch.float16, torch.bfloat16):
        return f"--dtype must be bfloat16 or float16, got {model_runner.dtype}"
    if pool.dtype not in (model_runner.dtype, torch.float8_e4m3fn):
        return f"--kv-cache-dtype must be auto (the model's dtype) or fp8_e4m3, got a {pool.dtype} pool"
    for layer in _attention_layers(model_runner.model):
        reason = _layer_refusal(layer)
        if reason is not None:
            return reason
    return None


def _attention_layers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "tp_q_head_num") and hasattr(m, "layer_id")]


def _layer_refusal(layer) -> str | None:
    name = f"attention layer {layer.layer_id}"
    if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
        return f"{name}: only causal decoder self-attention is supported, got {layer.attn_type}"
    if layer.qk_head_dim != layer.v_head_dim or not 0 < layer.qk_head_dim <= MAX_HEAD_SIZE:
        return (f"{name}: head sizes must be equal and in 1..{MAX_HEAD_SIZE}, got qk {layer.qk_head_dim}, "
                f"v {layer.v_head_dim}")
    if layer.tp_q_head_num % layer.tp_k_head_num:
        return f"{name}: {layer.tp_q_head_num} query heads are not a multiple of {layer.tp_k_head_num} KV heads"
    if layer.logit_cap and layer.logit_cap > 0 and layer.logit_capping_method != "tanh":
        return f"{name}: logit capping {layer.logit_capping_method!r} is not supported (tanh is)"
    if getattr(layer, "xai_temperature_len", -1) > 0:
        return f"{name}: xai_temperature_len is not supported"
    return None


def _options(layer) -> LayerOptions:
    window = layer.sliding_window_size
    # SGLang's sliding_window_size counts the keys before the query's own (triton: q <= k + window)
    return LayerOptions(float(layer.scaling), (window, 0) if window is not None and window > -1 else None,
                        float(layer.logit_cap) if layer.logit_cap and layer.logit_cap > 0 else None)


class FlashMoEAttnBackend(AttentionBackend):
    """Decode batches on the paged decode kernel (CUDA graphs: persistent table and lengths), extend batches on the
    packed varlen forward."""

    needs_cpu_seq_lens = True

    def __init__(self, model_runner):
        super().__init__()
        reason = _refusal(model_runner)
        if reason is not None:
            raise ValueError(f"--attention-backend {NAME}: {reason}")
        self.layout = PoolLayout(model_runner.page_size)
        # SGLang's models read the pools through the backend (`forward_context.get_token_to_kv_pool`: Qwen3's rope
        # writes K and V into the pool itself, then calls attention with save_kv_cache=False)
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.device = torch.device(model_runner.device)
        self.fp8 = self.token_to_kv_pool.dtype == torch.float8_e4m3fn
        self.graph: DecodeGraphBuffers | None = None
        self.forward_metadata: DecodeStep | ExtendStep | None = None
        self._options: dict[int, LayerOptions] = {}
        self._scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the packed forward's builds before CUDA-graph capture and the first request (3-7 s each on an H100), up to
        # a prefill chunk's tokens (unbounded without chunked prefill: no step-sized warm batch then)
        chunk = getattr(model_runner.server_args, "chunked_prefill_size", None)
        step_tokens = chunk if chunk is not None and chunk > 0 else None
        for layer in _attention_layers(model_runner.model):
            warm_prefill(self._layer_options(layer), layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim,
                         model_runner.dtype, self.device, step_tokens)

    def _layer_options(self, layer) -> LayerOptions:
        options = self._options.get(layer.layer_id)
        if options is None:
            options = self._options[layer.layer_id] = _options(layer)
        return options

    def _layer_scales(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (1,) K and V scales of an e4m3 pool (views of the layer's own where it has them)."""
        scales = self._scales.get(layer.layer_id)
        if scales is None:
            scales = self._scales[layer.layer_id] = tuple(
                torch.ones(1, dtype=torch.float32, device=self.device) if s is None
                else s.detach().to(self.device, torch.float32).reshape(1) for s in (layer.k_scale, layer.v_scale))
        return scales

    # metadata

    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_idle() or forward_batch.batch_size == 0:
            self.forward_metadata = None
        elif mode.is_decode():
            self.forward_metadata = build_decode(self.layout, self.req_to_token, forward_batch.req_pool_indices,
                                                 forward_batch.seq_lens, forward_batch.seq_lens_cpu)
        elif mode.is_extend() and not (mode.is_target_verify() or mode.is_draft_extend_v2()):
            seq_lens = forward_batch.extend_seq_lens_cpu
            prefix = forward_batch.extend_prefix_lens_cpu
            if seq_lens is None:
                seq_lens = forward_batch.extend_seq_lens.cpu()
            if prefix is None:
                prefix = forward_batch.extend_prefix_lens.cpu()
            self.forward_metadata = build_extend(self.req_to_token, forward_batch.req_pool_indices, seq_lens, prefix)
        else:
            raise NotImplementedError(f"--attention-backend {NAME}: forward mode {mode.name} is not supported")

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.graph = DecodeGraphBuffers(self.layout, max_bs, self.req_to_token)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError(
                f"--attention-backend {NAME} captures decode CUDA graphs only; prefill graphs: "
                f"--cuda-graph-backend-prefill breakable (the default) or --disable-prefill-cuda-graph")
        self.forward_metadata = self.graph.bind(forward_batch.batch_size)

    def init_forward_metadata_in_graph(self, forward_batch):
        if forward_batch.forward_mode.is_decode_or_idle():
            self.forward_metadata = self.graph.fill(self.req_to_token, forward_batch.req_pool_indices,
                                                    forward_batch.seq_lens)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    # attention

    def _save(self, layer, forward_batch, k, v, clone: bool):
        scaled = self.fp8 and layer.k_scale is not None
        if scaled and clone:  # the pool divides k and v in place by the scales
            k, v = k.clone(), v.clone()
        scales = (layer.k_scale, layer.v_scale) if scaled else ()
        self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, *scales)

    @staticmethod
    def _refuse_extras(sinks, score_mod, aux_tensors, kwargs):
        if sinks is not None or score_mod is not None or aux_tensors is not None or kwargs:
            names = [n for n, x in (("sinks", sinks), ("score_mod", score_mod), ("aux_tensors", aux_tensors))
                     if x is not None] + sorted(kwargs)
            raise NotImplementedError(f"--attention-backend {NAME}: {', '.join(names)} not supported")

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
                       aux_tensors=None, **kwargs):
        self._refuse_extras(sinks, score_mod, aux_tensors, kwargs)
        if save_kv_cache and k is not None:
            self._save(layer, forward_batch, k, v, clone=False)
        query = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = torch.empty_like(query)
        scales = self._layer_scales(layer) if self.fp8 else (None, None)
        k_buffer, v_buffer = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        run_decode(self.forward_metadata, self.layout, self._layer_options(layer), query, k_buffer, v_buffer, o,
                   *scales)
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
                       aux_tensors=None, **kwargs):
        self._refuse_extras(sinks, score_mod, aux_tensors, kwargs)
        if (k is None) != (v is None):
            raise ValueError("forward_extend: k and v must both be given or both be None")
        if save_kv_cache and k is not None:
            self._save(layer, forward_batch, k, v, clone=True)
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        query = q.reshape(-1, heads, dim)
        o = getattr(forward_batch, "_attn_output", None)  # SGLang's piecewise graphs hand out the output buffer
        o = torch.empty_like(query) if o is None else o.view(-1, heads, dim)
        step = self.forward_metadata
        n = step.num_tokens
        scales = self._layer_scales(layer) if self.fp8 else (None, None)
        k_buffer, v_buffer = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        run_extend(step, self._layer_options(layer), query[:n], None if k is None else k[:n],
                   None if v is None else v[:n], k_buffer, v_buffer, o[:n], *scales,
                   new_rows=forward_batch.out_cache_loc[:n])
        return o.view(-1, heads * dim)
