"""An SGLang batch as this library's attention calls: the metadata translation, with no SGLang import.

SGLang's MHA pool holds, per layer, K and V as token-major buffers ``(size + page_size, Hkv, D)``: slot ``s`` is row
``s``, and ``req_to_token[req_pool_indices[b], i]`` is the slot of request ``b``'s position ``i``. With ``--page-size
p`` the allocator hands out whole pages: positions ``j*p .. j*p + p - 1`` of a request sit in the ``p`` slots of one
page, so a buffer viewed as ``(num_pages, p, Hkv, D)`` is the paged cache the kernels read (`PoolLayout.pages`), with
the block table ``req_to_token[req_pool_indices, ::p] // p`` (`PoolLayout.block_table`).

- A decode batch (one new token per request, its key already written) is `flash_attention_decode` over
  ``seq_lens[b]`` keys (`DecodeStep`). Under CUDA graphs the table and lengths are persistent buffers
  (`DecodeGraphBuffers`), refilled by ops the graph records from SGLang's own static input buffers.
- An extend batch (prefills, chunked prefills, prefix-cache hits; a MIXED batch's decodes are one-token extends)
  packs each request's ``extend_seq_lens[b]`` new tokens in order, after ``extend_prefix_lens[b]`` keys already in
  the pool: one `flash_attention_varlen` call (`ExtendStep`). Without prefixes its keys are the step's own k and v;
  with prefixes, every key of every request is gathered from the pool (its new keys written first), one
  ``index_select`` per tensor. Gathered rather than the paged varlen call (``block_table=``): that call runs the cache
  kernels, which ran paged chunks at 0.65x of the packed sm_90 forward on an H100 (docs/perf-notes.md, "Serving
  calls"), while the gather moves each key once per layer, small beside the attention over it; and it is the path
  the vLLM backend runs and measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashmoe_science.integrations.engine_attention import (LayerOptions, decode_into, packed_keys, packed_lengths,
                                                             prefill_into, read_rows)

# the cache kernels' page sizes; pages above MAX_DIRECT_PAGE rows are read as several smaller adjacent pages
# (`attention.decode.pages`)
PAGE_MULTIPLE, MAX_DIRECT_PAGE = 16, 256


def page_size_refusal(page_size: int) -> str | None:
    """None where SGLang's ``--page-size`` suits the kernels (a multiple of 16); else a line saying what to pass."""
    if page_size >= PAGE_MULTIPLE and page_size % PAGE_MULTIPLE == 0:
        return None
    return (f"the flashmoe attention backend reads SGLang's KV pool as pages of a multiple of {PAGE_MULTIPLE} tokens: "
            f"pass --page-size 16 (or larger: 32, 64, 128, ...); got --page-size {page_size}")


@dataclass(frozen=True)
class PoolLayout:
    """SGLang's token-major MHA pool read as pages of ``page_size`` rows."""

    page_size: int

    def pages(self, buffer: torch.Tensor) -> torch.Tensor:
        """A layer's K or V buffer ``(size + page_size, Hkv, D)`` as ``(num_pages, page_size, Hkv, D)`` (a view)."""
        rows = buffer.shape[0]
        if rows % self.page_size:
            raise ValueError(f"the KV pool's {rows} rows are not whole pages of page_size {self.page_size}")
        return buffer.view(rows // self.page_size, self.page_size, *buffer.shape[1:])

    def table_width(self, req_to_token: torch.Tensor) -> int:
        """Pages of the longest request ``req_to_token`` holds."""
        return -(-req_to_token.shape[1] // self.page_size)

    def block_table(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    width: int | None = None) -> torch.Tensor:
        """int32 ``(bs, width)``: the pages of each request's first ``width * page_size`` positions (all by default);
        device ops only."""
        starts = req_to_token[:, ::self.page_size]
        if width is not None:
            starts = starts[:, :width]
        return torch.div(starts.index_select(0, req_pool_indices.to(torch.int64)), self.page_size,
                         rounding_mode="floor").to(torch.int32)


@dataclass
class DecodeStep:
    """A decode batch: request ``b``'s query against its first ``seq_lens[b]`` keys."""

    seq_lens: torch.Tensor  # int32 (bs,)
    block_table: torch.Tensor  # int32 (bs, width)


def build_decode(layout: PoolLayout, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                 seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor | None = None) -> DecodeStep:
    """`DecodeStep` of an eager decode batch; ``seq_lens_cpu`` (SGLang's host copy) narrows the table to the longest
    request's pages (without it: every page ``req_to_token`` can hold, no host read)."""
    width = None
    if seq_lens_cpu is not None and seq_lens_cpu.numel():
        width = max(1, -(-int(seq_lens_cpu.max()) // layout.page_size))
    table = layout.block_table(req_to_token, req_pool_indices, width)
    return DecodeStep(seq_lens.to(torch.int32), table)


class DecodeGraphBuffers:
    """Persistent decode metadata for CUDA graphs: `bind` (host, before capture and each replay) hands out views of
    the first ``bs`` rows; `fill` (device ops of static shapes, recorded in the graph) writes them from SGLang's
    static ``req_pool_indices`` and ``seq_lens`` buffers. The table spans every page ``req_to_token`` can hold, so the
    kernels' split choice depends on shapes only."""

    def __init__(self, layout: PoolLayout, max_bs: int, req_to_token: torch.Tensor):
        self.layout = layout
        device = req_to_token.device
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_bs, layout.table_width(req_to_token), dtype=torch.int32, device=device)

    def bind(self, bs: int) -> DecodeStep:
        if bs > self.seq_lens.shape[0]:
            raise ValueError(f"a CUDA-graph decode batch of {bs} requests exceeds max_bs {self.seq_lens.shape[0]}")
        return DecodeStep(self.seq_lens[:bs], self.block_table[:bs])

    def fill(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> DecodeStep:
        bs = req_pool_indices.shape[0]
        step = self.bind(bs)
        step.seq_lens.copy_(seq_lens)
        step.block_table.copy_(self.layout.block_table(req_to_token, req_pool_indices))
        return step


def run_decode(step: DecodeStep, layout: PoolLayout, options: LayerOptions, query: torch.Tensor,
               k_buffer: torch.Tensor, v_buffer: torch.Tensor, output: torch.Tensor,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A decode batch's attention into ``output`` ``(bs, Hq, D)``: ``query`` ``(bs, Hq, D)``; ``k_buffer``/``v_buffer``
    a layer's pool buffers ``(size + page_size, Hkv, D)`` in the query's dtype, or e4m3 with float32 ``(1,)``
    scales (the pool holds ``x / scale``)."""
    decode_into(output, options, query, layout.pages(k_buffer), layout.pages(v_buffer), step.seq_lens,
                step.block_table, k_scale, v_scale)
    return output


@dataclass
class ExtendStep:
    """An extend batch as one packed varlen call."""

    num_tokens: int  # packed new tokens
    cu_seqlens_q: torch.Tensor  # int32 (bs + 1,)
    max_seqlen_q: int
    cu_seqlens_k: torch.Tensor  # int32 (bs + 1,)
    max_seqlen_k: int
    k_rows: torch.Tensor | None  # int64 pool rows of every key, request after request; None: no request has a prefix


def build_extend(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, extend_seq_lens_cpu,
                 extend_prefix_lens_cpu) -> ExtendStep:
    """`ExtendStep` from SGLang's host copies of the new-token and prefix counts (sequences or tensors); built once
    per batch, its tensors shared by every layer (a new ``cu_seqlens`` pair costs the varlen call a work list)."""
    q_lens = np.asarray(extend_seq_lens_cpu, dtype=np.int64).reshape(-1)
    prefix = np.asarray(extend_prefix_lens_cpu, dtype=np.int64).reshape(-1)
    if q_lens.shape != prefix.shape or q_lens.shape[0] != req_pool_indices.shape[0]:
        raise ValueError(f"extend_seq_lens ({q_lens.shape[0]}), extend_prefix_lens ({prefix.shape[0]}) and "
                         f"req_pool_indices ({req_pool_indices.shape[0]}) must have one entry per request")
    device = req_to_token.device
    cu_q_host = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
    cu_q = packed_lengths(cu_q_host, device)
    max_q = int(q_lens.max()) if q_lens.size else 0
    if not prefix.any():
        return ExtendStep(int(cu_q_host[-1]), cu_q, max_q, cu_q, max_q, None)
    k_lens = q_lens + prefix
    cu_k_host, requests, positions = packed_keys(k_lens)
    cu_k = packed_lengths(cu_k_host, device)
    req = req_pool_indices.to(torch.int64)[torch.from_numpy(requests).to(device, non_blocking=True)]
    pos = torch.from_numpy(positions).to(device, non_blocking=True)
    k_rows = req_to_token[req, pos].to(torch.int64)
    return ExtendStep(int(cu_q_host[-1]), cu_q, max_q, cu_k, int(k_lens.max()), k_rows)


def run_extend(step: ExtendStep, options: LayerOptions, query: torch.Tensor, key: torch.Tensor | None,
               value: torch.Tensor | None, k_buffer: torch.Tensor, v_buffer: torch.Tensor, output: torch.Tensor,
               k_scale: torch.Tensor | float | None = None, v_scale: torch.Tensor | float | None = None,
               new_rows: torch.Tensor | None = None) -> torch.Tensor:
    """An extend batch's causal attention into ``output`` ``(num_tokens, Hq, D)``.

    ``query`` ``(num_tokens, Hq, D)``; ``key``/``value`` ``(num_tokens, Hkv, D)``, the step's new keys as the model
    computed them (already written to the pool), or None to read them from the pool at ``new_rows`` (SGLang's
    ``out_cache_loc``); ``k_buffer``/``v_buffer`` as `run_decode`'s.
    """
    if step.k_rows is not None:
        keys = read_rows(k_buffer, step.k_rows, k_scale, query.dtype)
        values = read_rows(v_buffer, step.k_rows, v_scale, query.dtype)
    elif key is None or value is None:
        if new_rows is None:
            raise ValueError("run_extend needs key and value, or new_rows to read them from the pool")
        rows = new_rows.to(torch.int64)
        keys = read_rows(k_buffer, rows, k_scale, query.dtype)
        values = read_rows(v_buffer, rows, v_scale, query.dtype)
    else:
        keys, values = key, value
    prefill_into(output, options, query, keys, values, step.cu_seqlens_q, step.cu_seqlens_k, step.max_seqlen_q,
                 step.max_seqlen_k)
    return output
