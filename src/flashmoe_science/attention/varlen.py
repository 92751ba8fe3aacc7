"""The packed (variable-length) front door: flash-attn's `flash_attn_varlen_func` layout, no padding anywhere.

q `(total_q, Hq, D)`, k and v `(total_k, Hkv, D)`, sequence b at rows `[cu_seqlens[b], cu_seqlens[b + 1])`. The
kernels see the packed tensors without a copy as 4-D `(1, H, total, D)` views (a permute), plus the cumulative
lengths: each program finds its sequence's rows and lengths from them, so the dense kernels' stride machinery
carries over and each sequence has its own diagonal Lk_b - Lq_b (causal and windows are per sequence).
"""

from __future__ import annotations

import torch

from flashmoe_science.attention import call, ops
from flashmoe_science.attention.checks import check_flags
from flashmoe_science.attention.decode.call import cache_varlen_call
from flashmoe_science.attention.plan import Dispatch, describe, plan_attention
from flashmoe_science.attention.problem import packed_problem
from flashmoe_science.attention.reference import default_softmax_scale
from flashmoe_science.device import on_another_cuda_device


def describe_varlen_dispatch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                             causal: bool = False, window=None, softcap=None, alibi_slopes=None,
                             backend: str = "auto", mask_mod=None, score_mod=None) -> Dispatch:
    """Which kernels `flash_attention_varlen` would run for these inputs (forward and backward), and why."""
    problem = packed_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                             window=window, softcap=softcap, alibi_slopes=alibi_slopes, backend=backend,
                             mask_mod=mask_mod, score_mod=score_mod)
    return describe(plan_attention(problem))


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str = "auto",
    block_table: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    check_values: bool | None = None,
    mask_mod=None,
    score_mod=None,
):
    """Attention over a batch of packed sequences of different lengths (flash-attn's varlen layout).

    Args:
        q: `(total_q, Hq, D)`, the batch's queries one sequence after the other; k, v: `(total_k, Hkv, D)`,
            `Hq % Hkv == 0` (GQA/MQA), any D in [1, 256]. Unit stride in the last dim.
        cu_seqlens_q, cu_seqlens_k: int32 `(batch + 1,)` on q's device, cumulative lengths starting at 0 and
            ending at total_q / total_k. Zero-length sequences are legal (their queries get zeros, lse -inf).
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence (they size the kernels' grids).
        causal, softmax_scale, window, softcap: as `flash_attention_science`, per sequence (each sequence's
            diagonal is its own Lk_b - Lq_b).
        alibi_slopes: float32 `(Hq,)` or `(batch, Hq)`.
        return_lse: also return the natural-log log-sum-exp, float32 `(Hq, total_q)` (flash-attn's packed layout).
        deterministic, backend: as `flash_attention_science`.
        block_table: int32 `(batch, max_blocks)`: k and v are then a paged cache `(num_blocks, block_size, Hkv, D)`
            and sequence b's keys are positions [0, seqused_k[b]) (else cu_seqlens_k's lengths) of its table row.
        seqused_k: int32 `(batch,)`: sequence b uses only its first seqused_k[b] keys (of the rows from
            cu_seqlens_k[b] in packed k/v, or of its table row).
        check_values: None (default) checks the values on the host in eager calls and not during CUDA-graph
            capture; False never (no synchronisation: the caller guarantees the values); True always (refused during
            capture). With block_table or seqused_k, as `flash_attention_decode`'s (out-of-range values give NaN
            rows). Without, unchecked cu_seqlens may end short of total_q / total_k: the rows after the last sequence
            are padding, attended by no sequence, their outputs unspecified (as flash_attn's for the rows its
            cu_seqlens leave out).
        mask_mod, score_mod: as `flash_attention_science`'s, per sequence: b is the sequence's index, q_idx and
            kv_idx positions within it (a mod reading packed tensors adds the offsets, e.g. from a captured
            cu_seqlens). Not with block_table or seqused_k.
        Calls with block_table or seqused_k run the cache kernels (`attention.decode.call.cache_varlen_call`), any mask
        and GQA; their max_seqlen_k is not used. They have no backward: with inputs that require grad the forward
        runs (as flash_attn's) and a backward through its output raises a RuntimeError.

    Unless check_values=False, the cu_seqlens values are checked with one small device-to-host copy per new pair of
    cu_seqlens tensors (see `checks.check_varlen`).

    Returns:
        `out` `(total_q, Hq, D)` in q's dtype, or `(out, lse)` when `return_lse=True`.
    """
    if block_table is not None or seqused_k is not None:
        check_flags(return_lse=return_lse)
        if mask_mod is not None or score_mod is not None:
            raise ValueError("mask_mod and score_mod run on packed k and v: not with block_table or seqused_k")

        def run(q, k, v):
            return cache_varlen_call(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k=cu_seqlens_k,
                                     seqused_k=seqused_k, block_table=block_table, causal=causal,
                                     softmax_scale=softmax_scale, window=window, softcap=softcap,
                                     alibi_slopes=alibi_slopes, backend=backend, check_values=check_values)

        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            out, lse = _ForwardOnlyCacheCall.apply(q, k, v, run)
        else:
            out, lse = run(q, k, v)
        return (out, lse) if return_lse else out
    mods = dict(mask_mod=mask_mod, score_mod=score_mod) if mask_mod is not None or score_mod is not None else {}
    if mods and torch.compiler.is_compiling():  # a function is no custom op argument: run this call eagerly
        return _eager_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                             softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                             return_lse=return_lse, deterministic=deterministic, backend=backend,
                             check_values=check_values, **mods)
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        check_flags(return_lse=return_lse)
        out, lse = ops.attention_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
            default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale,
            None if window is None else [int(side) for side in window], softcap, alibi_slopes, backend,
            deterministic, check_values)
        return (out, lse) if return_lse else out
    if on_another_cuda_device(q):
        with torch.cuda.device(q.device):
            return flash_attention_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                return_lse=return_lse, deterministic=deterministic, backend=backend, check_values=check_values,
                **mods)
    out, lse = call.packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                   softmax_scale=softmax_scale, window=window, softcap=softcap,
                                   alibi_slopes=alibi_slopes, backend=backend, deterministic=deterministic,
                                   return_lse=return_lse, check_values=check_values, **mods)
    return (out, lse) if return_lse else out


# A call with mods inside a compiled region: a graph break, then the eager call (as api.py's).
_eager_varlen = torch.compiler.disable(flash_attention_varlen,
                                       reason="mask_mod/score_mod are functions: no custom op takes them")


class _ForwardOnlyCacheCall(torch.autograd.Function):
    """A cache call (paged or ``seqused_k``) on inputs that require grad: the output joins the graph, as
    flash_attn's does, and a backward through it raises (the cache kernels have no backward)."""

    @staticmethod
    def forward(ctx, q, k, v, run):
        out, lse = run(q, k, v)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        raise RuntimeError("flash_attention_varlen with block_table or seqused_k has no backward: the cache kernels "
                           "compute the forward only; call it on packed k and v without them to train")
