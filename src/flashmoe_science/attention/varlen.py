"""The packed (variable-length) front door: flash-attn's `flash_attn_varlen_func` layout, no padding anywhere.

q `(total_q, Hq, D)`, k and v `(total_k, Hkv, D)`, sequence b at rows `[cu_seqlens[b], cu_seqlens[b + 1])`. The
kernels see the packed tensors without a copy as 4-D `(1, H, total, D)` views (a permute), plus the cumulative
lengths: each program finds its sequence's rows and lengths from them, so the dense kernels' stride machinery
carries over and each sequence has its own diagonal Lk_b - Lq_b (causal and windows are per sequence).
"""

from __future__ import annotations

import torch

from flashmoe_science.attention import reference
from flashmoe_science.attention.api import Dispatch, _dispatch, describe_plan
from flashmoe_science.attention.autograd import run_kernel
from flashmoe_science.attention.checks import (
    check_alibi_slopes,
    check_flags,
    check_scale_and_backend,
    check_triton_layout,
    check_varlen,
)
from flashmoe_science.attention.features import CallFeatures
from flashmoe_science.attention.mask import make_mask
from flashmoe_science.device import on_another_cuda_device


def _packed_as_4d(t: torch.Tensor) -> torch.Tensor:
    """(total, H, D) -> a (1, H, total, D) view (no copy)."""
    return t.permute(1, 0, 2).unsqueeze(0)


def _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
             softcap, alibi_slopes, backend, **flags):
    varlen = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_scale_and_backend(softmax_scale, backend)
    check_flags(causal=causal, **flags)
    mask = make_mask(causal, window, softcap)
    slopes = check_alibi_slopes(alibi_slopes, (varlen.num_seqs,), q.shape[1], q.device)
    scale = float(softmax_scale) if softmax_scale is not None else reference.default_softmax_scale(q.shape[-1])
    features = CallFeatures(mask=mask, alibi_slopes=slopes, varlen=varlen)
    q4, k4, v4 = _packed_as_4d(q), _packed_as_4d(k), _packed_as_4d(v)
    return q4, k4, v4, features, scale


def describe_varlen_dispatch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                             causal: bool = False, window=None, softcap=None, alibi_slopes=None,
                             backend: str = "auto") -> Dispatch:
    """Which kernel `flash_attention_varlen` would run for these inputs, and why."""
    q4, k4, v4, features, _ = _checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                       None, window, softcap, alibi_slopes, backend)
    return describe_plan(q4, k4, v4, features, backend)


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

    The cu_seqlens values are checked with one small device-to-host copy per new pair of cu_seqlens tensors (see
    `checks.check_varlen`).

    Returns:
        `out` `(total_q, Hq, D)` in q's dtype, or `(out, lse)` when `return_lse=True`.
    """
    if torch.compiler.is_compiling():  # torch.compile traces a custom op with a fake implementation instead
        from flashmoe_science.integrations import ops

        return ops.compiled_attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
            softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
            return_lse=return_lse, deterministic=deterministic, backend=backend)
    if on_another_cuda_device(q):
        with torch.cuda.device(q.device):
            return flash_attention_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                softmax_scale=softmax_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                return_lse=return_lse, deterministic=deterministic, backend=backend)
    q4, k4, v4, features, scale = _checked(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap,
        alibi_slopes, backend, return_lse=return_lse, deterministic=deterministic)
    plan, _ = _dispatch(q4, k4, v4, features, backend)
    if plan is None:
        out4, lse4 = reference.attention_reference(q4, k4, v4, features, scale)
    else:
        check_triton_layout(q, k, v)
        out4, lse4 = run_kernel(plan, q4, k4, v4, features, scale, deterministic)
    out = out4.squeeze(0).permute(1, 0, 2)  # back to (total_q, Hq, D): a view of the kernels' packed output
    if not out.is_contiguous():  # the reference's output is (1, H, total, D)-contiguous
        out = out.contiguous()
    return (out, lse4.squeeze(0)) if return_lse else out
