"""Megatron-core's ``core_attention`` on our kernels: :class:`FlashCoreAttention`.

Megatron's attention layers (``SelfAttention``) hand their core attention ``[s, b, heads, d]`` query, key and value
(``[t, heads, d]`` for packed ``thd`` batches), already split over tensor-parallel ranks by heads and already
rotated (RoPE). The core attention returns ``[s, b, heads·d]`` (``[t, heads·d]`` packed). This module takes the
``DotProductAttention`` constructor and forward and runs:

- dense batches through ``flash_attention_science`` on ``(b, heads, s, d)`` views (no copy of q, k, v);
- packed batches (``PackedSeqParams`` with ``qkv_format="thd"``) through ``flash_attention_varlen``;
- GQA natively (``num_query_groups`` key/value heads, never repeated);
- the layer's mask type: ``causal`` / ``padding_causal`` causal, ``no_mask`` / ``padding`` bidirectional (the
  padding types only with packed sequences, where Megatron's TE path uses them: each sequence attends within
  itself); as in Megatron's TE attention, the mask type decides and an ``attention_mask`` tensor is not read;
- Megatron's sliding window (``config.window_size`` on the layers ``window_attn_skip_freq`` selects) as our
  ``window``, both bottom-right aligned (query i sees key j iff ``i + sk - sq - left <= j <= i + sk - sq + right``,
  Megatron's ``get_sliding_window_causal_mask``); -1 is an unbounded side, as in TE and flash-attn;
- ``attention_bias`` (dense batches) as our additive ``attn_bias``, with its gradient when it requires one;
- ``config.deterministic_mode`` as our ``deterministic`` (bit-identical gradients run to run, as TE's attention
  under that mode).

Refused when built (``ValueError`` naming the config field): attention dropout, context parallelism, softmax types
other than "vanilla", QK-clip (it reads the softmax's logits), ``arbitrary`` masks, a causal layer whose window
looks right of the diagonal.
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.varlen import flash_attention_varlen

CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)
DENSE_TYPES = (AttnMaskType.causal, AttnMaskType.no_mask)
PACKED_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.no_mask, AttnMaskType.padding)


def _longest(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def check_config(config, attention_dropout) -> None:
    """The config fields this module cannot honour, refused by name."""
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise ValueError(f"FlashCoreAttention has no attention dropout: set attention_dropout=0.0 (got {dropout})")
    if config.context_parallel_size != 1:
        raise ValueError(f"FlashCoreAttention does not take context parallelism: context_parallel_size must be 1, "
                         f"got {config.context_parallel_size}")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ValueError(f"FlashCoreAttention computes the vanilla softmax only: softmax_type={config.softmax_type!r}")
    if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
        raise ValueError("FlashCoreAttention does not expose the attention logits: qk_clip and "
                         "log_max_attention_logit must be False")


def layer_window(config, layer_number: int, causal: bool) -> tuple[int, int] | None:
    """This layer's ``(left, right)`` window as our ``window`` (None: no window)."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, right = (int(side) for side in config.window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size sides must be >= -1 (-1: unbounded), got {tuple(config.window_size)}")
    if causal and right != 0:
        raise ValueError(f"a causal layer's window_size must have right side 0, got {tuple(config.window_size)}")
    return left, right


class FlashCoreAttention(MegatronModule):
    """Megatron-core's core attention (``DotProductAttention``'s constructor and forward) on flashmoe-science's
    kernels; see the module docstring for what it takes. ``backend``: our kernels' backend ("auto": Hopper's Gluon
    kernels or the portable Triton ones on a GPU, the PyTorch reference on the CPU); a spec passes it through
    ``ModuleSpec.params`` or ``functools.partial``."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, backend: str = "auto"):
        super().__init__(config=config)
        check_config(config, attention_dropout)
        if attn_mask_type not in PACKED_TYPES:
            raise ValueError(f"FlashCoreAttention takes attn_mask_type causal, padding_causal, no_mask or padding, "
                             f"got {attn_mask_type}")
        self.attn_mask_type = attn_mask_type
        self.layer_number = max(1, layer_number)
        # query-key layer scaling divides the scores by layer_number and the softmax multiplies them back: the net
        # scale is the plain one. The heads arrive split over tensor-parallel ranks already (pg_collection unused).
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.window = layer_window(config, self.layer_number, attn_mask_type in CAUSAL_TYPES)
        self.deterministic = bool(getattr(config, "deterministic_mode", False))
        self.backend = backend

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in CAUSAL_TYPES
        if packed_seq_params is not None:
            if attention_bias is not None:
                raise ValueError("attention_bias is not taken with packed_seq_params (packed sequences)")
            if mask_type not in PACKED_TYPES:
                raise ValueError(f"attn_mask_type {mask_type} is not taken with packed sequences")
            return self._packed(query, key, value, packed_seq_params, causal)
        if mask_type not in DENSE_TYPES:
            raise ValueError(f"attn_mask_type {mask_type} needs packed_seq_params (padding masks run as packed "
                             f"sequences)")
        # [s, b, heads, d] -> (b, heads, s, d) views: the kernels take any strides
        out = flash_attention_science(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), causal=causal,
            softmax_scale=self.softmax_scale, window=self.window, attn_bias=attention_bias, backend=self.backend,
            deterministic=self.deterministic)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query, key, value, params, causal: bool):
        if params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {params.qkv_format!r}")
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_kv
        padded_q, padded_k = params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded
        if padded_q is not None or padded_k is not None:
            # padding sits at each sequence's end: causal queries never reach the padding after them, so the
            # padded lengths give every real token its exact output; bidirectional ones would attend the padding
            if not causal:
                raise ValueError("packed_seq_params with cu_seqlens_*_padded is taken by causal layers only")
            cu_q = cu_q if padded_q is None else padded_q
            cu_k = cu_k if padded_k is None else padded_k
        # the longest padded sequence sizes the grids, which max_seqlen_* may not state: then measured (one sync)
        max_q = _longest(cu_q) if params.max_seqlen_q is None or padded_q is not None else params.max_seqlen_q
        max_k = _longest(cu_k) if params.max_seqlen_kv is None or padded_k is not None else params.max_seqlen_kv
        if query.dim() == 4:  # [t, 1, heads, d]: the packed batch's dummy dim
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        out = flash_attention_varlen(query, key, value, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q),
                                     int(max_k), causal=causal, softmax_scale=self.softmax_scale,
                                     window=self.window, backend=self.backend, deterministic=self.deterministic)
        return out.reshape(out.shape[0], -1)
