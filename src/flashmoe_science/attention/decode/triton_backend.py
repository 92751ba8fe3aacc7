"""The Triton decode family: the split-KV cache kernel over `splits` key splits per sequence, with the append before
it and the LSE combine after it (`triton/decode.py`); its tiles and splits come from `decode/tiles.py`."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from flashmoe_science.attention.decode.launch import LaunchArgs, append_new_tokens, kernel_refusal
from flashmoe_science.attention.decode.problem import CacheCall, DecodeCall, DecodeProblem
from flashmoe_science.attention.decode.tiles import DecodeTiles, choose_num_splits, decode_tiles
from flashmoe_science.attention.record import ran
from flashmoe_science.device import check_interpreter_operands, device_traits, dot_precision, on_another_cuda_device


@dataclass(frozen=True)
class TritonDecode:
    """The Triton cache kernels (triton/decode.py): the append (with rotary, quantisation) where new keys come, the
    split-KV attention with `splits` key splits per sequence, and the LSE combine where splits > 1."""

    tiles: DecodeTiles
    splits: int
    backend = "triton"
    kernel = "triton.decode._decode_kernel"

    def run(self, call: CacheCall, problem: DecodeProblem):
        check_interpreter_operands("q", call.q)
        # Triton launches on the current device: make it q's
        with torch.cuda.device(call.q.device) if on_another_cuda_device(call.q) else contextlib.nullcontext():
            ran("forward", self.backend, self.kernel)
            return _launch(call, problem, self.tiles, self.splits)


def _launch(call: CacheCall, problem: DecodeProblem, tiles: DecodeTiles, splits: int):
    from flashmoe_science.attention.triton import decode as kernels

    q, k_cache, v_cache = call.q, call.k_cache, call.v_cache
    hq, d = problem.num_q_heads, problem.head_dim
    lq = problem.seqlen_q
    # packed queries: rows after the last sequence are not attended, and read 0
    out = (torch.zeros if problem.packed_q else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    if problem.packed_q:  # (total_q, Hq, D) as a batch of one whose rows each sequence indexes from cu_seqlens_q
        lse = torch.empty(hq, q.shape[0], dtype=torch.float32, device=q.device)
        q_strides, o_strides, lse_strides = (0, *q.stride()[:2]), (0, *out.stride()[:2]), (0, lse.stride(0))
    else:
        lse = torch.empty(problem.batch, hq, lq, dtype=torch.float32, device=q.device)
        q_strides, o_strides, lse_strides = q.stride()[:3], out.stride()[:3], lse.stride()[:2]
    if q.numel() == 0:
        return out, lse
    args = LaunchArgs.of(call, problem, lse)
    q_att = append_new_tokens(call, problem, args)
    slopes = call.alibi_slopes
    slope_batch_stride = slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0
    rows_total = problem.batch * hq * lq
    if splits > 1:
        o_part = torch.empty(splits * rows_total * d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(splits * rows_total, dtype=torch.float32, device=q.device)
    else:
        o_part, lse_part = lse, lse
    cu_q = call.cu_seqlens_q if call.cu_seqlens_q is not None else call.ends
    grid = (splits, problem.batch * problem.num_kv_heads, math.ceil(problem.group * lq / tiles.block_m))
    kernels._decode_kernel[grid](
        q_att, k_cache, v_cache, args.table, call.ends, args.starts, args.rows, cu_q,
        slopes if slopes is not None else lse, args.k_scale, args.v_scale, out, lse, o_part, lse_part,
        *q_strides, *args.cache_strides, args.table.stride(0), slope_batch_stride, *o_strides, *lse_strides,
        args.scale_stride, problem.num_kv_heads, problem.group, lq, problem.num_new, problem.capacity,
        problem.cache_batch, args.num_blocks, args.max_blocks, splits, **_mask_args(problem),
        HEAD_DIM=d, BLOCK_D=args.block_d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        TILE_TOKENS=(tiles.block_m - 1) // problem.group + 2, VARLEN_Q=problem.packed_q, **args.layout,
        ALIBI=slopes is not None, SPLIT=splits > 1, **dot_precision(q), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    if splits > 1:
        kernels._combine_kernel[(rows_total,)](
            o_part, lse_part, out, lse, cu_q, rows_total, splits, hq, lq, *o_strides, *lse_strides,
            HEAD_DIM=d, BLOCK_D=args.block_d, BLOCK_S=min(32, 1 << (splits - 1).bit_length()), VARLEN_Q=problem.packed_q,
            num_warps=4)
    return out, lse


def _mask_args(problem: DecodeProblem) -> dict:
    args = problem.mask.kernel_args(problem.softmax_scale)
    return {name: args[name] for name in ("window_left", "window_right", "qk_scale", "softcap_scale",
                                          "MASK_LEFT", "MASK_RIGHT", "SOFTCAP")}


class TritonDecodeFamily:
    """The Triton cache kernels: every cache layout and feature; CUDA tensors, or CPU ones under TRITON_INTERPRET=1."""

    name = "triton"

    def decline(self, call: DecodeCall) -> str | None:
        return kernel_refusal(call)

    def plan(self, call: DecodeCall) -> TritonDecode:
        problem, traits = call.problem, device_traits(call.q.device)
        tiles = decode_tiles(problem, traits)
        splits = choose_num_splits(problem, tiles, traits.sm_count) if call.num_splits == "auto" else call.num_splits
        return TritonDecode(tiles, max(1, min(splits, math.ceil(problem.capacity / tiles.block_n))))


TRITON = TritonDecodeFamily()
