"""This library's attention as vLLM's ``CUSTOM`` attention backend (vLLM's v1 backend contract).

vLLM builds `FlashMoEMetadataBuilder.build` once per step and calls `FlashMoEAttentionImpl.do_kv_cache_update`
then `forward` in every layer; the translation of a step into this library's calls is `metadata` (no vLLM there).
What the backend declares here is what vLLM validates at engine start: a model or setting it cannot honour is
refused then with vLLM's own message ("head_size not supported", "kv_cache_dtype not supported", ...).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm import _custom_ops as vllm_ops
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata)

from flashmoe_science.integrations.vllm.metadata import (CacheLayout, LayerOptions, StepMetadata, build_step, run_step,
                                                         warm_prefill)

# head sizes the kernels take (vLLM's models use 64, 80, 96, 128, 256)
MAX_HEAD_SIZE = 256
# page sizes the cache kernels read (`attention.decode.checks`)
BLOCK_SIZES = [16, 32, 64, 128, 256]
# the page vLLM gets unless `--block-size` says otherwise: the decode kernel's 64-key tile then reads one block-table
# entry per tile instead of one per key
PREFERRED_BLOCK_SIZE = 64


class FlashMoEAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[FlashMoEAttentionImpl]:
        return FlashMoEAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashMoEMetadataBuilder]:
        return FlashMoEMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return BLOCK_SIZES

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return PREFERRED_BLOCK_SIZE

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return CacheLayout.shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return tuple(range(6 if include_num_layers_dimension else 5))

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 0 < head_size <= MAX_HEAD_SIZE

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


class FlashMoEMetadataBuilder(AttentionMetadataBuilder[StepMetadata]):
    """One step's `StepMetadata`. Full CUDA graphs capture decode-only batches (their path reads only the
    persistent seq_lens and block-table buffers and chooses its splits from shapes); other batches run eagerly
    between vLLM's piecewise graphs."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: int | None = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.layout = CacheLayout(kv_cache_spec.block_size)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> StepMetadata:
        m = common_attn_metadata
        return build_step(self.layout, m.query_start_loc, m.query_start_loc_cpu, m.seq_lens,
                          m.seq_lens_cpu_upper_bound, m.block_table_tensor, m.num_actual_tokens, m.max_query_len)


class FlashMoEAttentionImpl(AttentionImpl[StepMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        if sinks is not None:
            raise NotImplementedError("the CUSTOM (flashmoe-science) attention backend has no attention sinks")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        self.options = LayerOptions(self.scale, None if sliding_window is None else (sliding_window - 1, 0),
                                    logits_soft_cap or None, slopes)
        self.fp8 = kv_cache_dtype.startswith("fp8")
        # the layers are built under the engine's config: its step's token budget sizes the largest warm batch
        config = get_current_vllm_config_or_none()
        self.step_tokens = None if config is None else config.scheduler_config.max_num_batched_tokens

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # before vLLM's profiling run and graph capture: the first requests then find the prefill kernels built
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            warm_prefill(self.options, self.num_heads, self.num_kv_heads, self.head_size, act_dtype, device,
                         self.step_tokens)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        # slot = block * block_size + offset; the op reads each cache view's own strides
        k_cache, v_cache = CacheLayout.split(kv_cache)
        vllm_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping, self.kv_cache_dtype,
                                         layer._k_scale, layer._v_scale)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: StepMetadata | None, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the CUSTOM (flashmoe-science) attention backend has no fused output "
                                      "quantization")
        if attn_metadata is None or attn_metadata.num_actual_tokens == 0:  # the profiling run, an empty step
            return output
        options = self.options
        if options.alibi_slopes is not None and options.alibi_slopes.device != query.device:
            options = self.options = LayerOptions(options.softmax_scale, options.window, options.softcap,
                                                  options.alibi_slopes.to(query.device))
        out = output.view(-1, self.num_heads, self.head_size)
        if self.fp8:
            kv_cache = kv_cache.view(torch.float8_e4m3fn)
            run_step(attn_metadata, options, query, key, value, kv_cache, out, layer._k_scale, layer._v_scale)
        else:
            run_step(attn_metadata, options, query, key, value, kv_cache, out)
        return output
