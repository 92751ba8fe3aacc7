"""The attention kernels behind autograd: one forward launch, one backward launch, shared by every front door.

`kernel_forward` runs the planned forward kernel (Gluon sm_90 or Triton) and `kernel_backward` the backward
kernels (Gluon sm_90 where it takes the call, else Triton) from a given out and lse; `_KernelAttention` wraps the
two for autograd, and `api.attention_forward_lse` / `api.attention_backward_lse` call them directly (ring
attention merges partial results and runs the backward with the merged out and lse).
"""

from __future__ import annotations

import torch

from flashmoe_science.attention.features import CallFeatures, feature_names, sm90_missing
from flashmoe_science.attention.tiles import ForwardPlan, device_traits
from flashmoe_science.gluon.availability import run_gluon
from flashmoe_science.prepared_cache import remember, tensor_signature

# The sm_90 one-pass backward's launches per call signature (bwd_sm90.PreparedBackward): a call whose signature
# ran before skips Triton's binding of its three launches (host time: docs/perf-notes.md, session 15).
_PREPARED_BACKWARD: dict[tuple, object] = {}


def _backward_key(tensors, causal: bool, softmax_scale: float) -> tuple:
    """What the sm_90 backward's launches freeze from a call: each tensor's shape, strides, dtype, device and
    16-byte alignment, the mask and the scale."""
    return (*map(tensor_signature, tensors), causal, softmax_scale)


def _sm90_backward(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features: CallFeatures,
                   softmax_scale: float) -> None:
    """attention_backward_sm90, through a PreparedBackward where the one-pass kernel runs a plain (dense or
    causal) call (head dims up to 128); calls with features launch directly (their slopes and cu_seqlens are
    per-call tensors a prepared launch would freeze)."""
    from flashmoe_science.attention.hopper import bwd_sm90

    tensors = (q, k, v, out, lse, grad_out, delta, dq, dk, dv)
    if bwd_sm90.is_deterministic(q.shape[-1]) or not features.is_plain:
        # the D=256 kernels (fewer, larger problems) and feature calls: not prepared
        bwd_sm90.attention_backward_sm90(*tensors, features, softmax_scale)
        return
    causal = features.causal
    key = _backward_key(tensors, causal, softmax_scale)
    prepared = _PREPARED_BACKWARD.get(key)
    if prepared is None:
        bwd_sm90.attention_backward_sm90(*tensors, causal, softmax_scale)  # compiles what has not run yet
        remember(_PREPARED_BACKWARD, key, bwd_sm90.PreparedBackward(*tensors, causal, softmax_scale))
        return
    prepared(*tensors)


def _sm90_backward_runs(q, grad_out, softmax_scale: float, deterministic: bool, seqlen_q: int | None = None) -> bool:
    """Whether the Gluon sm_90 backward takes a call on Hopper whose q, k, v are TMA-compatible bf16/fp16 (known
    after an sm_90 forward; else `_sm90_backward_inputs`): its head dims, determinism where asked for, a positive
    scale (its masks are -inf scores), grad_out's strides, and where it measured faster than the Triton backward
    (tiles.sm90_backward_wins; seqlen_q: the longest sequence's queries, default q's rows). Features: see
    `sm90_missing(..., "backward")`."""
    from flashmoe_science.attention.hopper.bwd_sm90 import SUPPORTED_BLOCK_D, is_deterministic
    from flashmoe_science.attention.tiles import padded_head_dim, sm90_backward_wins
    from flashmoe_science.attention.layout import tma_compatible

    return (padded_head_dim(q.shape[-1]) in SUPPORTED_BLOCK_D and softmax_scale > 0
            and (is_deterministic(q.shape[-1]) or not deterministic)
            and sm90_backward_wins(q.shape[-1], q.shape[-2] if seqlen_q is None else seqlen_q)
            and tma_compatible(grad_out))


def _sm90_backward_inputs(q, k, v) -> bool:
    """Whether q, k, v suit the Gluon sm_90 backward when the forward ran on Triton (a feature the sm_90 forward
    does not take): Hopper, bf16/fp16, TMA-compatible strides, Gluon importable."""
    from flashmoe_science.attention.layout import tma_compatible

    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and device_traits(q.device).is_hopper
            and tma_compatible(q, k, v)):
        return False
    try:
        import flashmoe_science.attention.hopper.bwd_sm90  # noqa: F401
    except ImportError:
        return False
    return True


def new_outputs(q) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernels' out (keeps q's strides when q is dense, e.g. a transposed (B, L, H, D) buffer) and lse."""
    return torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)


def kernel_forward(q, k, v, features: CallFeatures, softmax_scale, plan: ForwardPlan, out=None, lse=None):
    """(out, lse) of the planned forward kernel on checked 4-D views (varlen: (1, H, total, D); lse (1, H, total))."""
    if out is None:
        out, lse = new_outputs(q)
    if plan.kernel == "sm90":
        from flashmoe_science.attention.hopper.fwd_sm90 import BLOCK_M, attention_forward_sm90
        from flashmoe_science.attention.seqlen import VarlenBatch, varlen_tile_offsets

        num_ctas = device_traits(q.device).sm_count if plan.persistent else None
        varlen = features.varlen
        if varlen is not None:  # the kernel numbers the real query tiles only: their running count per sequence
            offsets = varlen_tile_offsets(varlen.cu_seqlens_q, BLOCK_M)
            varlen = VarlenBatch(varlen.cu_seqlens_q, varlen.cu_seqlens_k, offsets)
        if run_gluon("attention forward", lambda: attention_forward_sm90(
                q, k, v, out, lse, features.causal, softmax_scale, plan.tiles, num_ctas, plan.q_buffers,
                plan.cross_item, mask=features.mask, alibi_slopes=features.alibi_slopes, varlen=varlen),
                plan.strict):
            return out, lse
        from flashmoe_science.attention.api import triton_plan  # (api imports this module)

        plan = triton_plan(q, k, v, features)  # it did not build on this triton (warned once)
    from flashmoe_science.attention.triton_fwd import attention_forward

    attention_forward(q, k, v, out, lse, features, softmax_scale, plan.tiles)
    return out, lse


def _bias_grad_buffer(bias: torch.Tensor, full_shape, deterministic: bool) -> tuple[torch.Tensor, bool]:
    """The float32 buffer the dQ kernel writes the bias's gradient into, and whether it adds with atomics.

    A bias without broadcast dims gets each element from one program: stored, deterministic. A broadcast bias
    sums over programs: float32 atomics into a buffer of its own shape (O(bias) memory, last bits may vary), or,
    when determinism is asked for, a (B, H, Lq, Lk) buffer summed afterwards (O(B·H·Lq·Lk) memory)."""
    broadcast = tuple(bias.shape) != tuple(full_shape)
    if broadcast and deterministic:
        return torch.zeros(full_shape, dtype=torch.float32, device=bias.device), False
    return torch.zeros(bias.shape, dtype=torch.float32, device=bias.device), broadcast


def kernel_backward(q, k, v, out, lse, grad_out, features: CallFeatures, softmax_scale: float, *,
                    plan: ForwardPlan, deterministic: bool, need_dq=True, need_dkdv=True, need_dbias=False):
    """(dq, dk, dv, dbias) from the backward kernels on checked 4-D views (None for what is not needed), after the
    forward `plan` (an sm_90 forward vouches for the Gluon backward's inputs; a portable one keeps to Triton)."""
    from flashmoe_science.attention.tiles import backward_tiles, padded_head_dim
    from flashmoe_science.attention.triton_bwd import attention_backward

    if grad_out.stride(-1) != 1:  # e.g. the stride-0 gradient of out.sum(): the kernels need unit last stride
        grad_out = grad_out.contiguous()
    need_dq = need_dq or need_dbias  # the dQ kernel forms the bias's gradient
    dq = torch.empty_like(q) if need_dq else None  # empty_like keeps the input's strides when it is dense
    dk = torch.empty_like(k) if need_dkdv else None
    dv = torch.empty_like(v) if need_dkdv else None
    if not (need_dq or need_dkdv):
        return dq, dk, dv, None
    delta = torch.empty_like(lse)
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    names = feature_names(features, q.shape[-1], need_dbias)
    varlen = features.varlen
    if (dq is not None and dk is not None and not plan.portable and not sm90_missing(names, "backward")
            and _sm90_backward_runs(q, grad_out, softmax_scale, deterministic,
                                    None if varlen is None else varlen.max_seqlen_q)
            and (plan.kernel == "sm90" or _sm90_backward_inputs(q, k, v))
            and run_gluon("attention backward", lambda: _sm90_backward(
                q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale))):
        # Hopper: one pass for all three gradients (D <= 128; dQ summed by TMA reduce-adds, last bits may
        # vary), or the dK/dV and dQ kernels (D 129..256, deterministic); where they do not build on this triton
        # (hopper.availability, warned once), the Triton kernels below
        return dq, dk, dv, None
    tiles = backward_tiles(q.shape[-1], q.dtype, features.causal, device_traits(q.device))
    # dQ and dK/dV both wanted, determinism not asked for, no bias gradient (formed by the dQ kernel) and the fused
    # single pass (5 products per tile pair instead of 7, dQ summed with float32 atomics into dq_accum) measured
    # faster on this GPU: take it. Otherwise the two-pass path: no atomics, bit-identical gradients run to run.
    dq_accum = None
    if dq is not None and dk is not None and not deterministic and not need_dbias and tiles.fused is not None:
        dq_accum = torch.empty(*q.shape[:3], padded_head_dim(q.shape[-1]), dtype=torch.float32, device=q.device)
    dbias = dbias_atomic = None
    bias = features.attn_bias
    if need_dbias:
        full_shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        dbias, dbias_atomic = _bias_grad_buffer(bias, full_shape, deterministic)
    attention_backward(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale, tiles, dq_accum,
                       dbias=dbias, dbias_atomic=dbias_atomic)
    if dbias is not None:
        if dbias.shape != bias.shape:  # the deterministic broadcast case: sum over the broadcast dims
            dims = [d for d in range(4) if bias.shape[d] == 1 and dbias.shape[d] != 1]
            dbias = dbias.sum(dim=dims, keepdim=True)
        dbias = dbias.to(bias.dtype)
    return dq, dk, dv, dbias


class _KernelAttention(torch.autograd.Function):
    """Forward through the planned kernel (Gluon sm_90 or Triton); backward through `kernel_backward` (the Gluon
    sm_90 kernels after an sm_90 forward where they take the call, else the Triton kernels). Saves only the
    inputs, out and lse (O(L) memory; the bias's gradient is O(bias), see `_bias_grad_buffer`). `bias` is
    `features.attn_bias`, passed on its own so autograd sees it."""

    @staticmethod
    def forward(ctx, q, k, v, bias, features, softmax_scale, plan, deterministic):
        out, lse = kernel_forward(q, k, v, features, softmax_scale, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.features, ctx.softmax_scale, ctx.deterministic = features, softmax_scale, deterministic
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # double backward raises "trying to differentiate twice ..."
    def backward(ctx, grad_out, grad_lse):
        # grad_lse is always None or zeros: lse is marked non-differentiable.
        q, k, v, out, lse = ctx.saved_tensors
        need_dq, need_dk, need_dv, need_dbias = ctx.needs_input_grad[:4]
        dq, dk, dv, dbias = kernel_backward(
            q, k, v, out, lse, grad_out, ctx.features, ctx.softmax_scale, plan=ctx.plan,
            deterministic=ctx.deterministic, need_dq=need_dq, need_dkdv=need_dk or need_dv, need_dbias=need_dbias)
        # the rest: features, scale, plan, deterministic
        return (dq if need_dq else None, dk if need_dk else None, dv if need_dv else None, dbias,
                None, None, None, None)


class _NoKeys(torch.autograd.Function):
    """Attention with nothing to attend over (Lk == 0 or an empty q): zeros out, zero gradients."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def run_kernel(plan: ForwardPlan, q4, k4, v4, features: CallFeatures, scale, deterministic):
    bias = features.attn_bias
    if torch.is_grad_enabled() and (q4.requires_grad or k4.requires_grad or v4.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _KernelAttention.apply(q4, k4, v4, bias, features, scale, plan, deterministic)
    # Inference: skip autograd's bookkeeping, a measurable share of host time on small problems.
    return kernel_forward(q4, k4, v4, features, scale, plan)
