"""What the cache kernels share (`triton/decode.py`): their launch arguments (`LaunchArgs`), the append of new keys and
values (rotated, quantised; `append_new_tokens`) that the Triton cache kernels and a dense chunk both run first, and
the rule for where the Triton kernels can run at all (`kernel_refusal`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmoe_science.attention.decode.problem import CacheCall, DecodeCall, DecodeProblem
from flashmoe_science.attention.decode.reference import q_positions_per_token
from flashmoe_science.device import triton_interpreter_on


@dataclass(frozen=True)
class LaunchArgs:
    """The cache kernels' shared arguments, with placeholder pointers where an optional tensor is absent."""

    table: torch.Tensor
    starts: torch.Tensor
    rows: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    scale_stride: int
    cache_strides: tuple
    num_blocks: int
    max_blocks: int
    block_d: int
    layout: dict

    @classmethod
    def of(cls, call: CacheCall, problem: DecodeProblem, placeholder: torch.Tensor) -> "LaunchArgs":
        ends, k_cache, v_cache = call.ends, call.k_cache, call.v_cache
        table = call.block_table if call.block_table is not None else ends
        cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3]) if k_cache.dim() == 4 else \
            (0, *k_cache.stride()[:2], 0, *v_cache.stride()[:2])  # a packed (total_k, Hkv, D) key tensor: one row
        return cls(table, call.starts if call.starts is not None else ends,
                   call.cache_rows if call.cache_rows is not None else ends,
                   call.k_scale if call.k_scale is not None else placeholder,
                   call.v_scale if call.v_scale is not None else placeholder,
                   call.k_scale.stride(0) if call.k_scale is not None and call.k_scale.shape[0] > 1 else 0,
                   cache_strides, k_cache.shape[0], table.shape[1] if call.block_table is not None else 1,
                   max(16, 1 << (problem.head_dim - 1).bit_length()),
                   dict(PAGED=problem.paged, PAGE_SIZE=problem.block_size if problem.paged else 1,
                        HAS_STARTS=call.starts is not None, HAS_CACHE_ROWS=call.cache_rows is not None,
                        FP8=problem.fp8))


def append_new_tokens(call: CacheCall, problem: DecodeProblem, args: LaunchArgs) -> torch.Tensor:
    """Writes k_new/v_new into the cache (rotated, quantised) where given; returns the queries to attend with (q
    rotated into a new tensor when rotary applies, else q)."""
    from flashmoe_science.attention.triton import decode as kernels

    q = call.q
    if call.k_new is None:
        return q
    rotary = call.rotary_cos is not None
    q_att = torch.empty_like(q) if rotary else q
    cos, sin = (call.rotary_cos, call.rotary_sin) if rotary else (q, q)
    hq, lq = problem.num_q_heads, problem.seqlen_q
    kernels._append_kernel[(max(lq, problem.num_new), problem.batch, hq + problem.num_kv_heads)](
        q, q_att, call.k_new, call.v_new, call.k_cache, call.v_cache, args.table, call.ends, args.starts, args.rows,
        cos, sin, args.k_scale, args.v_scale,
        *q.stride()[:3], *q_att.stride()[:3], *call.k_new.stride()[:3], *call.v_new.stride()[:3],
        *args.cache_strides, args.table.stride(0), cos.stride(0), args.scale_stride,
        lq, problem.num_new, hq, problem.capacity, problem.cache_batch, args.num_blocks, args.max_blocks, cos.shape[0],
        HEAD_DIM=problem.head_dim, BLOCK_D=args.block_d, **args.layout, ROTARY=rotary,
        ROTARY_DIM=2 * call.rotary_cos.shape[1] if rotary else 16, INTERLEAVED=call.rotary_interleaved,
        Q_POSITIONS_PER_TOKEN=q_positions_per_token(problem), num_warps=1)
    return q_att


def kernel_refusal(call: DecodeCall) -> str | None:
    """Why the Triton kernels (the cache kernels, and the append before a dense chunk) cannot run a call, or None."""
    if call.q.dtype == torch.float64:
        return "it has no float64 kernel: use bfloat16, float16 or float32"
    if not call.q.is_cuda and not triton_interpreter_on():
        return "it needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)"
    return None
