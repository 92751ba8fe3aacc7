"""A checked cache call: its shapes and options (`DecodeProblem`: everything a launch depends on besides tensor values),
its tensors as the families run them (`CacheCall`) and what the families decide on (`DecodeCall`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmoe_science.attention.mask import MaskSpec
from flashmoe_science.fp8_format import FP8

FP8_CACHE = FP8  # the e4m3 caches


@dataclass(frozen=True)
class DecodeProblem:
    """A checked call's shapes and options (everything a kernel launch depends on besides tensor values)."""

    batch: int  # sequences
    seqlen_q: int  # query tokens per sequence (packed queries: the longest sequence's)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    paged: bool
    block_size: int  # paged block size, or Lmax for a contiguous cache (one "block" per sequence)
    capacity: int  # the last cache position + 1 a sequence may use: Lmax, or max_blocks * block_size
    num_new: int
    mask: MaskSpec
    softmax_scale: float
    cache_batch: int = 0  # rows of a contiguous cache (cache_batch_idx indexes them)
    packed_q: bool = False  # queries packed (total_q, Hq, D) with cu_seqlens_q
    fp8: bool = False
    dtype: torch.dtype = torch.bfloat16  # q's
    rows_indexed: bool = False  # cache_leftpad or cache_batch_idx given: sequences do not start at row 0 of row b
    alibi: bool = False
    packed_cache: bool = False  # a contiguous cache whose rows are one (B·Lmax, Hkv, D) tensor without a copy

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class CacheCall:
    """One checked call's tensors as the executors take them: the queries (decode (B, Lq, Hq, D), or packed
    (total_q, Hq, D) with cu_seqlens_q), the caches, each sequence's end (before the append) and optional first
    position and cache row, and the optional append, rotary, ALiBi and FP8 scales."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ends: torch.Tensor
    starts: torch.Tensor | None = None
    cache_rows: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    k_new: torch.Tensor | None = None
    v_new: torch.Tensor | None = None
    rotary_cos: torch.Tensor | None = None
    rotary_sin: torch.Tensor | None = None
    rotary_interleaved: bool = False
    alibi_slopes: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None



@dataclass(frozen=True, eq=False)
class DecodeCall:
    """What the decode backends decide on: the checked problem, q (device and dtype) and num_splits."""

    problem: DecodeProblem
    q: torch.Tensor
    num_splits: int | str
