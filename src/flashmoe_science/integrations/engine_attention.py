"""An inference engine's attention step as this library's calls: what the vLLM and SGLang backends share (no engine
import).

A step becomes at most two calls:

- one-token requests (decodes): `flash_attention_decode` on the paged cache, split-KV chosen from shapes only (the
  path full CUDA graphs capture), `decode_into`;
- the others (prefills, chunked prefills, prefix-cache hits): `flash_attention_varlen`, the packed forward, on keys
  as packed rows, `prefill_into`. Where every key of those requests is new, the rows are the step's own key and value
  tensors; else every key of each request is gathered from the cache (`packed_keys` lists them as (request,
  position) pairs, the engine maps those to its cache rows, `read_rows` gathers and dequantises).

Each engine's module (`integrations.vllm.metadata`, `integrations.sglang.metadata`) maps its batch and cache layout
onto these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashmoe_science import flash_attention_decode, flash_attention_varlen
from flashmoe_science.attention.call import packed_forward
from flashmoe_science.device import on_another_cuda_device


@dataclass(frozen=True)
class LayerOptions:
    """One attention layer's fixed settings, in this library's terms."""

    softmax_scale: float
    window: tuple[int, int] | None = None  # (left, right), -1 unbounded
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None  # float32 (Hq,)

    def masks(self) -> dict:
        return dict(softmax_scale=self.softmax_scale, window=self.window, softcap=self.softcap,
                    alibi_slopes=self.alibi_slopes)


def packed_keys(k_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The keys of requests with ``k_lens`` keys each, packed request after request: ``cu_seqlens_k`` int32
    ``(R + 1,)``, and per packed key its request (0..R-1) and position, int64 ``(total,)``."""
    k_lens = np.asarray(k_lens, dtype=np.int64)
    cu = np.concatenate(([0], np.cumsum(k_lens)))
    requests = np.repeat(np.arange(k_lens.size, dtype=np.int64), k_lens)
    positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], k_lens)
    return cu.astype(np.int32), requests, positions


def packed_lengths(cu_seqlens: torch.Tensor | np.ndarray, device: torch.device | None = None) -> torch.Tensor:
    """A step's cumulative lengths (a host array, or a tensor) as int32 on `device` (a tensor's own by default), made
    outside inference mode. Engines build their steps under `torch.inference_mode`, whose tensors carry no version
    counter, and the packed forward remembers the work list it derives from a cu_seqlens tensor only for one that has
    a counter (`prepared_cache.TensorMemo`): with these, every layer after a step's first reuses the first's work list
    instead of computing it again (two launches and their host time per layer)."""
    with torch.inference_mode(False):
        t = torch.from_numpy(cu_seqlens) if isinstance(cu_seqlens, np.ndarray) else cu_seqlens
        return t.to(device=t.device if device is None else device, dtype=torch.int32, non_blocking=True, copy=True)


def read_rows(rows: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | float | None,
              dtype: torch.dtype) -> torch.Tensor:
    """``rows.index_select(0, index)`` in ``dtype``: an e4m3 cache (which holds ``x / scale``) dequantised."""
    out = rows.index_select(0, index)
    if out.dtype == torch.float8_e4m3fn:
        out = (out.to(torch.float32) * (1.0 if scale is None else scale)).to(dtype)
    return out


def decode_into(output: torch.Tensor, options: LayerOptions, query: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """One query per request, ``query`` ``(B, Hq, D)``, against its first ``seq_lens[b]`` keys in the paged cache
    ``(num_blocks, block_size, Hkv, D)``, into ``output`` ``(B, Hq, D)``; an e4m3 cache with float32 ``(1,)``
    scales. No host read."""
    scales = dict(k_scale=k_scale, v_scale=v_scale) if k_cache.dtype == torch.float8_e4m3fn else {}
    out = flash_attention_decode(query.unsqueeze(1), k_cache, v_cache, seq_lens, block_table=block_table, causal=True,
                                 check_values=False, **scales, **options.masks())
    output.copy_(out.squeeze(1))


def prefill_into(output: torch.Tensor, options: LayerOptions, query: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                 max_seqlen_k: int) -> None:
    """Causal attention of packed requests (each request's diagonal is its own ``Lk - Lq``) into ``output``: from a
    signature's second call the kernels write it in place (`call.packed_forward`'s out), else a copy."""
    if on_another_cuda_device(query):
        out = flash_attention_varlen(query, keys, values, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     causal=True, check_values=False, **options.masks())
    else:
        out, _ = packed_forward(query, keys, values, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal=True, check_values=False, out=output, **options.masks())
    if out.data_ptr() != output.data_ptr():
        output.copy_(out)


# Packed batches whose calls build every variant of the sm_90 varlen forward a step can meet (its two tile shapes,
# chosen by sequence length, each for one sequence and for several; keys longer than queries): the kernel compiles
# one build per variant on first use, 3-7 s each on an H100, and an engine's start may run attention without
# metadata.
WARM_BATCHES = (([608], [608]), ([1744], [1744]), ([300, 400, 278], [300, 400, 278]),
                ([1955, 1800, 1000], [1955, 1800, 1000]), ([64, 500], [1000, 3000]), ([4000], [4000]))
_WARMED: set = set()


# sequences of the warm batch as large as an engine's step: mean rows this long take the work-list order that a
# step's largest batches can take (the causal order for K/V that outgrows L2 is its own build)
STEP_WARM_SEQUENCE = 2048


def warm_batches(step_tokens: int | None) -> tuple:
    """WARM_BATCHES, and where the engine's step may hold more tokens than they do, one batch of `step_tokens` tokens
    in sequences of STEP_WARM_SEQUENCE (the last shorter)."""
    largest = max(sum(q_lens) for q_lens, _ in WARM_BATCHES)
    if step_tokens is None or step_tokens <= largest:
        return WARM_BATCHES
    lengths = [STEP_WARM_SEQUENCE] * (step_tokens // STEP_WARM_SEQUENCE)
    if step_tokens % STEP_WARM_SEQUENCE:
        lengths.append(step_tokens % STEP_WARM_SEQUENCE)
    return (*WARM_BATCHES, (lengths, lengths))


def warm_prefill(options: LayerOptions, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                 device: torch.device, step_tokens: int | None = None) -> None:
    """Compile the packed forward's builds for one layer's shape and masks (once per process and kind; CUDA only);
    `step_tokens`: the most tokens the engine's step holds (its largest prefill batch), if known."""
    alibi = options.alibi_slopes
    key = (num_heads, num_kv_heads, head_size, dtype, str(device), options.window, options.softcap is None,
           alibi is None, step_tokens)
    if key in _WARMED or device.type != "cuda":
        return
    _WARMED.add(key)
    masks = dict(softmax_scale=options.softmax_scale, window=options.window, softcap=options.softcap,
                 alibi_slopes=None if alibi is None else alibi.to(device))
    for q_lens, k_lens in warm_batches(step_tokens):
        cu_q, cu_k = (torch.tensor(np.concatenate(([0], np.cumsum(n))), dtype=torch.int32, device=device)
                      for n in (q_lens, k_lens))
        q = torch.randn(sum(q_lens), num_heads, head_size, dtype=dtype, device=device)
        k, v = (torch.randn(sum(k_lens), num_kv_heads, head_size, dtype=dtype, device=device) for _ in range(2))
        flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=True, check_values=False,
                               **masks)
