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
page's rows are adjacent for the gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashmoe_science import flash_attention_decode, flash_attention_varlen


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
        device = query_start_loc.device
        cu_q = query_start_loc[num_decodes:] - token_start
        k_rows = None
        if np.array_equal(q_lens, k_lens):
            cu_k = cu_q
        else:
            cu_k_host = np.concatenate(([0], np.cumsum(k_lens))).astype(np.int32)
            cu_k = torch.from_numpy(cu_k_host).to(device, non_blocking=True)
            requests = np.repeat(np.arange(num_decodes, num_reqs, dtype=np.int64), k_lens)
            positions = np.arange(int(cu_k_host[-1]), dtype=np.int64) - np.repeat(cu_k_host[:-1].astype(np.int64),
                                                                                 k_lens)
            k_rows = layout.rows(block_table, requests, positions)
        prefill = PrefillPart(token_start, cu_q.to(torch.int32), int(q_lens.max()), cu_k.to(torch.int32),
                              int(k_lens.max()), k_rows)
    return StepMetadata(num_actual_tokens, num_decodes, seq_lens, block_table, prefill)


@dataclass(frozen=True)
class LayerOptions:
    """One attention layer's fixed settings, in this library's terms."""

    softmax_scale: float
    window: tuple[int, int] | None = None  # (left, right), -1 unbounded
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None  # float32 (Hq,)


# Packed batches whose calls build every variant of the sm_90 varlen forward a step can meet (its two tile shapes,
# chosen by sequence length, each for one sequence and for several; keys longer than queries): the kernel compiles
# one build per variant on first use, 3-7 s each on an H100, and vLLM's start runs attention without metadata.
WARM_BATCHES = (([608], [608]), ([1744], [1744]), ([300, 400, 278], [300, 400, 278]),
                ([1955, 1800, 1000], [1955, 1800, 1000]), ([64, 500], [1000, 3000]), ([4000], [4000]))
_WARMED: set = set()


def warm_prefill(options: LayerOptions, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
    """Compile the packed forward's builds for one layer's shape and masks (once per process and kind; CUDA only)."""
    alibi = options.alibi_slopes
    key = (num_heads, num_kv_heads, head_size, dtype, str(device), options.window, options.softcap is None,
           alibi is None)
    if key in _WARMED or device.type != "cuda":
        return
    _WARMED.add(key)
    masks = dict(softmax_scale=options.softmax_scale, window=options.window, softcap=options.softcap,
                 alibi_slopes=None if alibi is None else alibi.to(device))
    for q_lens, k_lens in WARM_BATCHES:
        cu_q, cu_k = (torch.tensor(np.concatenate(([0], np.cumsum(n))), dtype=torch.int32, device=device)
                      for n in (q_lens, k_lens))
        q = torch.randn(sum(q_lens), num_heads, head_size, dtype=dtype, device=device)
        k, v = (torch.randn(sum(k_lens), num_kv_heads, head_size, dtype=dtype, device=device) for _ in range(2))
        flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=True, check_values=False,
                               **masks)


def run_step(meta: StepMetadata, options: LayerOptions, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one step's queries into ``output`` ``(num_tokens, Hq, D)``.

    ``query`` ``(num_tokens, Hq, D)``; ``key``/``value`` ``(num_tokens, Hkv, D)``, this step's keys (already in the
    cache); ``kv_cache`` in `CacheLayout`, the dtype of ``query`` or float8_e4m3fn with float32 ``k_scale`` and
    ``v_scale`` (one value each: the cache holds ``x / scale``).
    """
    k_cache, v_cache = CacheLayout.split(kv_cache)
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    common = dict(softmax_scale=options.softmax_scale, window=options.window, softcap=options.softcap,
                  alibi_slopes=options.alibi_slopes)
    nd = meta.num_decodes
    if nd:
        scales = dict(k_scale=k_scale.reshape(1), v_scale=v_scale.reshape(1)) if fp8 else {}
        out = flash_attention_decode(query[:nd].unsqueeze(1), k_cache, v_cache, meta.seq_lens[:nd],
                                     block_table=meta.block_table[:nd], causal=True, check_values=False, **scales,
                                     **common)
        output[:nd].copy_(out.squeeze(1))
    part = meta.prefill
    if part is not None:
        start, end = part.token_start, meta.num_actual_tokens
        if part.k_rows is None:
            keys, values = key[start:end], value[start:end]
        else:
            rows = kv_cache.view(-1, *kv_cache.shape[3:])
            keys = rows.index_select(0, part.k_rows)
            values = rows.index_select(0, part.k_rows + k_cache.shape[1])
            if fp8:
                keys = (keys.to(torch.float32) * k_scale).to(query.dtype)
                values = (values.to(torch.float32) * v_scale).to(query.dtype)
        out = flash_attention_varlen(query[start:end], keys, values, part.cu_seqlens_q, part.cu_seqlens_k,
                                     part.max_seqlen_q, part.max_seqlen_k, causal=True, check_values=False, **common)
        output[start:end].copy_(out)
    return output
