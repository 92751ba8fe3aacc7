"""A vLLM batch as this library's attention calls: the metadata translation, with no vLLM import.

vLLM hands an attention backend one flat batch per step: ``num_actual_tokens`` query rows, request ``r`` at rows
``[query_start_loc[r], query_start_loc[r + 1])``, its keys the first ``seq_lens[r]`` positions of its block-table
row (the step's own keys included: they are written to the cache before attention runs). With
``reorder_batch_threshold = 1`` the one-token requests (decodes) come first. A step becomes at most two calls:

- the decodes: `flash_attention_decode` on the paged cache (split-KV, shapes only: the path full CUDA graphs
  capture);
- the rest (prefills, chunked prefills, prefix-cache hits): `flash_attention_varlen`, the packed forward, on keys
  read as packed rows. A request whose keys are all new this step reads them from the step's own key and value
  tensors; when any request has keys from earlier steps, the prefill requests' keys are gathered from the cache
  in one `index_select` per tensor (`CacheLayout.rows`).

The cache holds K and V of a block side by side, ``(num_blocks, 2, block_size, num_kv_heads, head_dim)``: a block
is one page of K then one of V, so K is the strided view ``cache[:, 0]`` (the layout the cache kernels read) and a
page's rows are adjacent for the gather. The calls themselves are `integrations.engine_attention`'s (shared with the
SGLang backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashmoe_science.integrations.engine_attention import (WARM_BATCHES, LayerOptions, decode_into, packed_keys,
                                                             packed_lengths, prefill_into, read_rows, warm_prefill)

__all__ = ["CacheLayout", "LayerOptions", "PrefillPart", "StepMetadata", "WARM_BATCHES", "build_step", "count_decodes",
           "run_step", "warm_prefill"]


@dataclass(frozen=True)
class CacheLayout:
    """One layer's cache, ``(num_blocks, 2, block_size, num_kv_heads, head_dim)``."""

    block_size: int

    @staticmethod
    def shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``(num_blocks, block_size, num_kv_heads, head_dim)`` views."""
        return kv_cache[:, 0], kv_cache[:, 1]

    def rows(self, block_table: torch.Tensor, requests: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Rows of K in the cache viewed as ``(num_blocks * 2 * block_size, Hkv, D)`` for each (request, position)
        (int64 on the table's device; V's are these plus ``block_size``)."""
        device = block_table.device
        req = torch.from_numpy(requests).to(device, non_blocking=True)
        pos = torch.from_numpy(positions).to(device, non_blocking=True)
        blocks = block_table[req, pos // self.block_size].to(torch.int64)
        return blocks * (2 * self.block_size) + pos % self.block_size


@dataclass
class PrefillPart:
    """The requests after the decodes, as one packed varlen call."""

    token_start: int  # their first query row
    cu_seqlens_q: torch.Tensor  # int32 (P + 1,), from 0
    max_seqlen_q: int
    cu_seqlens_k: torch.Tensor  # int32 (P + 1,)
    max_seqlen_k: int
    k_rows: torch.Tensor | None  # None: every key is new this step (read from the step's key/value)


@dataclass
class StepMetadata:
    """What `run_step` needs for one step, built once and shared by every layer."""

    num_actual_tokens: int
    num_decodes: int  # leading one-token requests
    seq_lens: torch.Tensor  # int32 (num_reqs,), keys per request (the persistent buffer CUDA graphs read)
    block_table: torch.Tensor  # int32 (num_reqs, max_blocks)
    prefill: PrefillPart | None


def count_decodes(query_start_loc_cpu: torch.Tensor) -> int:
    """The number of leading requests with one query token (vLLM puts them first)."""
    lens = (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).numpy()
    longer = np.flatnonzero(lens > 1)
    return int(longer[0]) if longer.size else int(lens.size)


def build_step(layout: CacheLayout, query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor,
               seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor | None, block_table: torch.Tensor,
               num_actual_tokens: int, max_query_len: int) -> StepMetadata:
    """`StepMetadata` from vLLM's per-step tensors.

    ``seq_lens_cpu`` (the host's copy of ``seq_lens``; exact for the prefill requests) is read only when the batch
    has prefill requests; None there copies ``seq_lens`` to the host.
    """
    num_reqs = query_start_loc_cpu.shape[0] - 1
    num_decodes = num_reqs if max_query_len <= 1 else count_decodes(query_start_loc_cpu)
    prefill = None
    if num_decodes < num_reqs:
        if seq_lens_cpu is None:
            seq_lens_cpu = seq_lens.cpu()
        starts = query_start_loc_cpu[num_decodes:].numpy().astype(np.int64)
        q_lens = np.diff(starts)
        k_lens = seq_lens_cpu[num_decodes:num_reqs].numpy().astype(np.int64)
        token_start = int(starts[0])
        cu_q = packed_lengths(query_start_loc[num_decodes:] - token_start)
        k_rows = None
        if np.array_equal(q_lens, k_lens):
            cu_k = cu_q
        else:
            cu_k_host, requests, positions = packed_keys(k_lens)
            cu_k = packed_lengths(cu_k_host, query_start_loc.device)
            k_rows = layout.rows(block_table, requests + num_decodes, positions)
        prefill = PrefillPart(token_start, cu_q, int(q_lens.max()), cu_k, int(k_lens.max()), k_rows)
    return StepMetadata(num_actual_tokens, num_decodes, seq_lens, block_table, prefill)


def run_step(meta: StepMetadata, options: LayerOptions, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one step's queries into ``output`` ``(num_tokens, Hq, D)``.

    ``query`` ``(num_tokens, Hq, D)``; ``key``/``value`` ``(num_tokens, Hkv, D)``, this step's keys (already in the
    cache); ``kv_cache`` in `CacheLayout`, the dtype of ``query`` or float8_e4m3fn with float32 ``k_scale`` and
    ``v_scale`` (one value each: the cache holds ``x / scale``).
    """
    k_cache, v_cache = CacheLayout.split(kv_cache)
    nd = meta.num_decodes
    if nd:
        scales = (k_scale.reshape(1), v_scale.reshape(1)) if kv_cache.dtype == torch.float8_e4m3fn else (None, None)
        decode_into(output[:nd], options, query[:nd], k_cache, v_cache, meta.seq_lens[:nd], meta.block_table[:nd],
                    *scales)
    part = meta.prefill
    if part is not None:
        start, end = part.token_start, meta.num_actual_tokens
        if part.k_rows is None:
            keys, values = key[start:end], value[start:end]
        else:
            rows = kv_cache.view(-1, *kv_cache.shape[3:])
            keys = read_rows(rows, part.k_rows, k_scale, query.dtype)
            values = read_rows(rows, part.k_rows + k_cache.shape[1], v_scale, query.dtype)
        prefill_into(output[start:end], options, query[start:end], keys, values, part.cu_seqlens_q,
                     part.cu_seqlens_k, part.max_seqlen_q, part.max_seqlen_k)
    return output
