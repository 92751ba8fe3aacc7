"""The dense decode family: a prefill chunk on a contiguous cache run by the dense packed forward over views of the
cache (`DenseChunk`; on Hopper the Gluon kernels where they take it), after the cache kernels' append."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from flashmoe_science.attention.decode.launch import LaunchArgs, append_new_tokens, kernel_refusal
from flashmoe_science.attention.decode.problem import CacheCall, DecodeCall, DecodeProblem
from flashmoe_science.attention.decode.tiles import DECODE_ROWS
from flashmoe_science.attention.record import ran
from flashmoe_science.device import on_another_cuda_device


@dataclass(frozen=True)
class DenseChunk:
    """A prefill chunk on a contiguous cache as the dense packed forward (`call.packed_forward`: the Gluon sm_90
    kernels where they take the call, else the portable ones) over views of the cache, no copy: the cache
    (B, Lmax, Hkv, D) is the packed key tensor (B·Lmax, Hkv, D), and sequence b is two packed sequences, its Lq
    queries against its rows [b·Lmax, b·Lmax + Lk_b), then no queries against the rest of its rows (cu_seqlens built
    on the device from cache_seqlens: no host read, so a CUDA graph captures it). Each packed sequence has its own
    diagonal Lk_b - Lq, the bottom-right alignment of every mask here. The append (rotary, new keys) runs first, as
    in the cache kernel. A sequence whose length is out of range attends no key and gets NaN (the cache kernel's
    rule)."""

    backend = "dense"
    kernel = "decode.dense_chunk"

    def run(self, call: CacheCall, problem: DecodeProblem):
        with torch.cuda.device(call.q.device) if on_another_cuda_device(call.q) else contextlib.nullcontext():
            ran("forward", self.backend, self.kernel)
            placeholder = torch.empty(0, dtype=torch.float32, device=call.q.device)
            q = append_new_tokens(call, problem, LaunchArgs.of(call, problem, placeholder))
            return dense_chunk(q, call.k_cache, call.v_cache, call.ends, problem)


def dense_chunk(q, k_cache, v_cache, ends, problem: DecodeProblem):
    """(out (B, Lq, Hq, D), lse (B, Hq, Lq)) of `DenseChunk`: q against contiguous caches already appended to."""
    from flashmoe_science.attention.call import packed_forward

    import triton

    from flashmoe_science.attention.triton import decode as kernels

    batch, lq, hq, d = q.shape
    lmax, mask = problem.capacity, problem.mask
    cu_q = torch.empty(2 * batch + 1, dtype=torch.int32, device=q.device)
    cu_k = torch.empty_like(cu_q)
    invalid = torch.empty(batch, dtype=torch.bool, device=q.device)
    kernels._chunk_bounds_kernel[(1,)](ends, cu_q, cu_k, invalid, batch, problem.num_new, lmax, lq,
                                       BLOCK_B=triton.next_power_of_2(batch))
    window = (mask.window_left, mask.window_right) if mask.bounded_left or mask.bounded_right else None
    keys = (t.view(batch * lmax, problem.num_kv_heads, d) for t in (k_cache, v_cache))
    out, lse = packed_forward(q.reshape(batch * lq, hq, d), *keys, cu_q, cu_k, lq, lmax, causal=mask.causal,
                              softmax_scale=problem.softmax_scale, window=window, softcap=mask.softcap or None,
                              return_lse=True)
    out = out.view(batch, lq, hq, d)
    lse = lse.view(hq, batch, lq).transpose(0, 1).contiguous()
    out.masked_fill_(invalid.view(batch, 1, 1, 1), float("nan"))
    lse.masked_fill_(invalid.view(batch, 1, 1), float("nan"))
    return out, lse


def dense_chunk_refusal(problem: DecodeProblem, num_splits) -> str | None:
    """Why a cache call is not a `DenseChunk` (None when it is): the rule that sends prefill chunks to the dense
    forward. It takes what that forward computes exactly, and more rows than a decode step's tile: the cache
    kernel reads each KV head once for up to DECODE_ROWS rows, which the dense kernels would not."""
    if problem.group * problem.seqlen_q <= DECODE_ROWS:
        return f"a decode step ({problem.group * problem.seqlen_q} <= {DECODE_ROWS} query rows per KV head)"
    for refused, why in ((problem.packed_q, "packed queries (the paged varlen path)"),
                         (problem.paged, "a paged cache (the dense kernels read no block table)"),
                         (problem.fp8, "an e4m3 cache"),
                         (problem.rows_indexed, "cache_leftpad or cache_batch_idx"),
                         (problem.alibi, "ALiBi slopes"),
                         (not problem.packed_cache, "a cache that is not contiguous"),
                         (problem.batch * problem.capacity >= 2**31, "more cache rows than int32 cu_seqlens count"),
                         (num_splits != "auto", "an explicit num_splits (the cache kernel's)")):
        if refused:
            return f"not a dense chunk: {why}"
    return None


class DenseChunkFamily:
    """Prefill chunks on a contiguous cache that the dense packed forward computes exactly (`dense_chunk_refusal`)."""

    name = "dense"

    def decline(self, call: DecodeCall) -> str | None:
        return kernel_refusal(call) or dense_chunk_refusal(call.problem, call.num_splits)

    def plan(self, call: DecodeCall) -> DenseChunk:
        return DenseChunk()


DENSE = DenseChunkFamily()
