"""The attention front door: check the inputs, normalise the layout to strided 4-D views, pick a kernel.

Kernels behind this module receive only checked 4-D tensors `(B, H, L, D)` with unit stride in the last dim;
they never validate user input or allocate behind this module's back.
"""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, replace

import torch

from flashmoe_science.attention import reference
from flashmoe_science.attention.tiles import (
    ForwardPlan,
    autotune_enabled,
    device_traits,
    forward_tiles,
    sm90_cross_item,
    sm90_forward_tiles,
    sm90_persistent,
    sm90_q_buffers,
)
from flashmoe_science.device import on_another_cuda_device, triton_interpreter_on
from flashmoe_science.hopper.availability import run_gluon, unavailable_reason
from flashmoe_science.prepared_cache import remember, tensor_signature

BACKENDS = ("auto", "hopper", "triton", "reference")
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


@dataclass(frozen=True)
class Dispatch:
    """Which implementation a call runs, and why (shown by `flashmoe-science info`)."""

    backend: str  # "hopper", "triton" or "reference"
    kernel: str
    reason: str
    tiles: dict | None = None


@dataclass(frozen=True)
class _Problem:
    """A checked call: the 4-D views the kernels see (None where leading dims cannot merge without a copy)."""

    q: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    softmax_scale: float


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32 (float64 on the reference), got {t.dtype}")
    if t.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims (L, D), got shape {tuple(t.shape)}")


def _check_inputs(q, k, v, softmax_scale, backend) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k and v must have the same number of dims, got {q.dim()}, {k.dim()}, {v.dim()}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if q.shape[:-3] != k.shape[:-3]:
        raise ValueError(f"q and k must have the same batch dims, got {tuple(q.shape[:-3])} and {tuple(k.shape[:-3])}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k's head dim must equal q's ({head_dim}), got {k.shape[-1]}")
    if head_dim % 8 or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim (last dim of q) must be a multiple of 8 in [16, 256], got {head_dim}")
    if q.dim() >= 3:
        hq, hkv = q.shape[-3], k.shape[-3]
        if hkv == 0 or hq % hkv:
            raise ValueError(f"q's head count ({hq}) must be a multiple of k's head count ({hkv}) (GQA/MQA)")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _as_4d(t: torch.Tensor) -> torch.Tensor | None:
    """A `(B, H, L, D)` view of `(..., H, L, D)` without copying, or None when the leading dims cannot merge."""
    if t.dim() == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if t.dim() == 3:
        return t.unsqueeze(0)
    if t.dim() == 4:
        return t
    try:
        return t.view(-1, *t.shape[-3:])
    except RuntimeError:
        return None


def _normalise(q, k, v, softmax_scale) -> _Problem:
    scale = float(softmax_scale) if softmax_scale is not None else reference.default_softmax_scale(q.shape[-1])
    return _Problem(_as_4d(q), _as_4d(k), _as_4d(v), scale)


def describe_dispatch(q, k, v, *, causal: bool = False, backend: str = "auto") -> Dispatch:
    """Which kernel `flash_attention_science` would run for these inputs, and why."""
    _check_inputs(q, k, v, None, backend)
    _check_flags(causal=causal)
    plan, why_not_sm90 = _dispatch(q, k, v, causal, backend)
    if plan is not None:
        _check_triton_layout(q, k, v)  # the call itself would raise here
    requested = "auto picks" if backend == "auto" else "requested:"
    if plan is None:
        where = "backend='reference' was requested" if backend == "reference" else (
            "float64 has no tensor-core kernel" if q.is_cuda else f"{q.device.type} tensors run the PyTorch reference")
        return Dispatch("reference", "reference.attention_reference", where)
    tiles = plan.tiles
    shape = f"tiles {tiles.block_m}x{tiles.block_n}, {tiles.num_warps} warps, {tiles.num_stages} stages"
    if plan.kernel == "sm90":
        ctas = (f"persistent, one CTA per SM, {plan.q_buffers} Q buffer(s) per consumer"
                + (", consecutive query tiles overlapped" if plan.cross_item else "") if plan.persistent
                else "one CTA per query tile")
        why = (f"{requested} the Gluon sm_90 kernel (TMA producer warp, two consumer warpgroups, async wgmma, "
               f"softmax overlapped with P·V; {ctas}); {shape}")
        return Dispatch("hopper", "hopper.fwd_sm90.attention_forward_sm90_kernel", why, tiles.as_dict())
    traits = device_traits(q.device)
    where = "the Triton interpreter" if not q.is_cuda else f"sm_{traits.capability[0]}{traits.capability[1]}"
    tuned = q.is_cuda and autotune_enabled()
    why = (f"{requested} the portable Triton kernel on {where}"
           + (f" (not the sm_90 kernel: {why_not_sm90})" if why_not_sm90 else "")
           + ("; FLASHMOE_AUTOTUNE=1: tiles searched per shape, " if tuned else f"; {shape}, ")
           + ("TMA descriptors" if tiles.use_tma else "pointer loads"))
    return Dispatch("triton", "triton_fwd._attention_forward_kernel", why, tiles.as_dict())


def _tma_compatible(q, k, v) -> bool:
    from flashmoe_science.attention.triton_fwd import tma_compatible

    # out = empty_like(q) shares q's strides or is contiguous; both are TMA-compatible when q is
    return tma_compatible(q, k, v)


def _hopper_unavailable(q, k, v) -> str | None:
    """Why the Gluon sm_90 kernel should not take this call, or None when it should."""
    if not q.is_cuda or not device_traits(q.device).is_hopper:
        return "it needs a Hopper (sm_90) GPU"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return "it runs bf16/fp16 only"
    gluon_off = unavailable_reason()
    if gluon_off is not None:
        return gluon_off
    if not _tma_compatible(q, k, v):
        return "TMA needs a unit last stride and 16-byte aligned base addresses and strides"
    return None


def _sm90_backward_runs(q, grad_out, softmax_scale: float, deterministic: bool) -> bool:
    """Whether the Gluon sm_90 backward takes a call whose forward ran the sm_90 kernel (so q, k, v are already
    known TMA-compatible bf16/fp16 on Hopper): its head dims, determinism where asked for, a positive scale (its
    masks are -inf scores), grad_out's strides, and where it measured faster than the Triton backward
    (tiles.sm90_backward_wins)."""
    from flashmoe_science.attention.hopper.bwd_sm90 import SUPPORTED_BLOCK_D, is_deterministic
    from flashmoe_science.attention.tiles import padded_head_dim, sm90_backward_wins
    from flashmoe_science.attention.triton_fwd import tma_compatible

    return (padded_head_dim(q.shape[-1]) in SUPPORTED_BLOCK_D and softmax_scale > 0
            and (is_deterministic(q.shape[-1]) or not deterministic)
            and sm90_backward_wins(q.shape[-1], q.shape[-2]) and tma_compatible(grad_out))


def _dispatch(q, k, v, causal: bool, backend: str) -> tuple[ForwardPlan | None, str | None]:
    """The kernel for this call (None: the PyTorch reference) and, on CUDA, why the sm_90 kernel was not taken.

    Runs on every call, so it only decides; `describe_dispatch` turns the decision into sentences.
    """
    if backend == "reference" or (backend == "auto" and (not q.is_cuda or q.dtype == torch.float64)):
        return None, None
    if backend in ("triton", "hopper") and not q.is_cuda and not triton_interpreter_on():
        raise ValueError(
            f"backend={backend!r} needs CUDA tensors, or TRITON_INTERPRET=1 to run the Triton kernels on the CPU "
            f"(slow; for tests), got tensors on {q.device}"
        )
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"backend={backend!r} supports bfloat16, float16 and float32, got {q.dtype}")

    why_not_sm90 = None
    if backend in ("auto", "hopper"):
        why_not_sm90 = _hopper_unavailable(q, k, v)
        if why_not_sm90 is None:
            seqlen_q, traits = q.shape[-2], device_traits(q.device)
            tiles = sm90_forward_tiles(q.shape[-1], causal, seqlen_q)
            num_work = math.prod(q.shape[:-2]) * -(-seqlen_q // tiles.block_m)  # query tiles of all heads
            persistent = sm90_persistent(causal, seqlen_q, num_work, traits.sm_count)
            q_buffers = sm90_q_buffers(tiles, q.shape[-1], persistent, traits)
            cross_item = sm90_cross_item(tiles, q.shape[-1], causal, persistent, q_buffers)
            return ForwardPlan("sm90", tiles, persistent=persistent, q_buffers=q_buffers,
                               cross_item=cross_item, strict=backend == "hopper"), None
        if backend == "hopper":
            raise ValueError(f"backend='hopper' cannot run this call: {why_not_sm90}")
    return _triton_plan(q, k, v, causal), why_not_sm90 if q.is_cuda else None


def _triton_plan(q, k, v, causal: bool) -> ForwardPlan:
    """The portable Triton forward's plan (also where a Gluon build failed: hopper.availability)."""
    tiles = forward_tiles(q.shape[-1], q.dtype, causal, device_traits(q.device))
    if tiles.use_tma and not _tma_compatible(q, k, v):  # decided here, once, so the launch and the report agree
        tiles = replace(tiles, use_tma=False)
    return ForwardPlan("triton", tiles)


def _check_triton_layout(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dim (stride 1) for the Triton kernels, got strides "
                f"{tuple(t.stride())}; pass {name}.contiguous() (the kernels never copy inputs behind your back)"
            )


# The sm_90 one-pass backward's launches per call signature (bwd_sm90.PreparedBackward): a call whose signature
# ran before skips Triton's binding of its three launches (host time: docs/perf-notes.md, session 15).
_PREPARED_BACKWARD: dict[tuple, object] = {}


def _backward_key(tensors, causal: bool, softmax_scale: float) -> tuple:
    """What the sm_90 backward's launches freeze from a call: each tensor's shape, strides, dtype, device and
    16-byte alignment, the mask and the scale."""
    return (*map(tensor_signature, tensors), causal, softmax_scale)


def _sm90_backward(q, k, v, out, lse, grad_out, delta, dq, dk, dv, causal: bool, softmax_scale: float) -> None:
    """attention_backward_sm90, through a PreparedBackward where the one-pass kernel runs (head dims up to 128)."""
    from flashmoe_science.attention.hopper import bwd_sm90

    tensors = (q, k, v, out, lse, grad_out, delta, dq, dk, dv)
    if bwd_sm90.is_deterministic(q.shape[-1]):  # the D=256 kernels: fewer, larger problems; not prepared
        bwd_sm90.attention_backward_sm90(*tensors, causal, softmax_scale)
        return
    key = _backward_key(tensors, causal, softmax_scale)
    prepared = _PREPARED_BACKWARD.get(key)
    if prepared is None:
        bwd_sm90.attention_backward_sm90(*tensors, causal, softmax_scale)  # compiles what has not run yet
        remember(_PREPARED_BACKWARD, key, bwd_sm90.PreparedBackward(*tensors, causal, softmax_scale))
        return
    prepared(*tensors)


class _KernelAttention(torch.autograd.Function):
    """Forward through the planned kernel (Gluon sm_90 or Triton); backward through the Gluon sm_90 kernels after an
    sm_90 forward for calls wanting every gradient (head dims up to 128: one pass, non-deterministic calls only;
    129..256: a dK/dV kernel and a dQ kernel, deterministic), else the Triton kernels. Saves only the inputs, out
    and lse (O(L) memory)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, plan, deterministic):
        out, lse = _kernel_forward(q, k, v, causal, softmax_scale, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
        ctx.hopper, ctx.strict = plan.kernel == "sm90", plan.strict
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # double backward raises "trying to differentiate twice ..."
    def backward(ctx, grad_out, grad_lse):
        # grad_lse is always None or zeros: lse is marked non-differentiable.
        from flashmoe_science.attention.tiles import backward_tiles, padded_head_dim
        from flashmoe_science.attention.triton_bwd import attention_backward

        q, k, v, out, lse = ctx.saved_tensors
        need_dq, need_dk, need_dv = ctx.needs_input_grad[:3]
        if grad_out.stride(-1) != 1:  # e.g. the stride-0 gradient of out.sum(): the kernels need unit last stride
            grad_out = grad_out.contiguous()
        dq = torch.empty_like(q) if need_dq else None  # empty_like keeps the input's strides when it is dense
        dk = torch.empty_like(k) if need_dk or need_dv else None
        dv = torch.empty_like(v) if need_dk or need_dv else None
        if need_dq or need_dk or need_dv:
            delta = torch.empty_like(lse)
            deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
            if (ctx.hopper and dq is not None and dk is not None
                    and _sm90_backward_runs(q, grad_out, ctx.softmax_scale, deterministic)
                    and run_gluon("attention backward", lambda: _sm90_backward(
                        q, k, v, out, lse, grad_out, delta, dq, dk, dv, ctx.causal, ctx.softmax_scale), ctx.strict)):
                # Hopper: one pass for all three gradients (D <= 128; dQ summed by TMA reduce-adds, last bits may
                # vary), or the dK/dV and dQ kernels (D 129..256, deterministic)
                return (dq, dk if need_dk else None, dv if need_dv else None, None, None, None, None)
            tiles = backward_tiles(q.shape[-1], q.dtype, ctx.causal, device_traits(q.device))
            # dQ and dK/dV both wanted, determinism not asked for, and the fused single pass (5 products per tile
            # pair instead of 7, dQ summed with float32 atomics into dq_accum) measured faster on this GPU: take
            # it. Otherwise the two-pass path: no atomics, bit-identical gradients run to run.
            dq_accum = None
            if dq is not None and dk is not None and not deterministic and tiles.fused is not None:
                dq_accum = torch.empty(*q.shape[:3], padded_head_dim(q.shape[-1]), dtype=torch.float32,
                                       device=q.device)
            attention_backward(q, k, v, out, lse, grad_out, delta, dq, dk, dv, ctx.causal, ctx.softmax_scale, tiles,
                               dq_accum)
        # the rest: causal, scale, plan, deterministic
        return (dq, dk if need_dk else None, dv if need_dv else None, None, None, None, None)


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


def _new_outputs(q) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernels' out (keeps q's strides when q is dense, e.g. a transposed (B, L, H, D) buffer) and lse."""
    return torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)


def _kernel_forward(q, k, v, causal, softmax_scale, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _new_outputs(q)
    if plan.kernel == "sm90":
        from flashmoe_science.attention.hopper.fwd_sm90 import attention_forward_sm90

        num_ctas = device_traits(q.device).sm_count if plan.persistent else None
        if run_gluon("attention forward", lambda: attention_forward_sm90(
                q, k, v, out, lse, causal, softmax_scale, plan.tiles, num_ctas, plan.q_buffers, plan.cross_item),
                plan.strict):
            return out, lse
        plan = _triton_plan(q, k, v, causal)  # it did not build on this triton (warned once)
    from flashmoe_science.attention.triton_fwd import attention_forward

    attention_forward(q, k, v, out, lse, causal, softmax_scale, plan.tiles)
    return out, lse


def _run_kernel(plan: ForwardPlan, q4, k4, v4, causal, scale, deterministic) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.is_grad_enabled() and (q4.requires_grad or k4.requires_grad or v4.requires_grad):
        return _KernelAttention.apply(q4, k4, v4, causal, scale, plan, deterministic)
    # Inference: skip autograd's bookkeeping, a measurable share of host time on small problems.
    return _kernel_forward(q4, k4, v4, causal, scale, plan)


def _run(plan: ForwardPlan | None, q4, k4, v4, causal, scale, deterministic):
    if plan is None:
        return reference.attention_reference(q4, k4, v4, causal, scale)
    return _run_kernel(plan, q4, k4, v4, causal, scale, deterministic)


# Calls whose signature ran before skip the checks, the plan and Triton's argument binding (host time per call:
# docs/perf-notes.md, session 4). Bounded (prepared_cache.CACHE_MAX).
_PREPARED: dict[tuple, object] = {}


def _prepared_key(q, k, v, causal, softmax_scale, return_lse, backend, deterministic) -> tuple | None:
    """Everything the checks, the plan and the kernel's specialisation read from a call, or None where the call must
    take the full path: autograd, or arguments of types whose equality would hide a failing check (True == 1)."""
    if (causal.__class__ is not bool or return_lse.__class__ is not bool or deterministic.__class__ is not bool
            or not (softmax_scale is None or softmax_scale.__class__ is float) or backend.__class__ is not str
            or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor))):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    return (*map(tensor_signature, (q, k, v)), causal, softmax_scale, return_lse, backend, deterministic)


def _remember(key, plan: ForwardPlan, q, k, v, out, lse, causal, softmax_scale) -> None:
    """Keep this call's launch for the next call of its signature (the call just ran with `plan`)."""
    if plan.kernel == "sm90" and unavailable_reason() is not None:
        return  # it fell back to the Triton kernel: the next call plans (and remembers) that one
    if plan.kernel == "sm90":
        from flashmoe_science.attention.hopper.fwd_sm90 import prepare_forward

        num_ctas = device_traits(q.device).sm_count if plan.persistent else None
        prepared = prepare_forward(q, k, v, out, lse, causal, softmax_scale, plan.tiles, num_ctas, plan.q_buffers,
                                   plan.cross_item)
    else:
        from flashmoe_science.attention.triton_fwd import prepare_forward

        prepared = prepare_forward(q, k, v, out, lse, causal, softmax_scale, plan.tiles)
    remember(_PREPARED, key, prepared)


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fp8_call(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, return_lse, backend, deterministic):
    from flashmoe_science.attention import fp8

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    fp8.check_fp8_call(q, k, v, q_descale, k_descale, v_descale)
    _check_flags(causal=causal, return_lse=return_lse, deterministic=deterministic)
    if backend not in ("auto", "hopper", "reference"):
        raise ValueError(f"FP8 attention runs backend 'auto', 'hopper' or 'reference', got {backend!r}")
    if backend == "hopper" and fp8.fp8_kernel_unavailable(q, k, v):
        raise ValueError(f"backend='hopper' cannot run this FP8 call: {fp8.fp8_kernel_unavailable(q, k, v)}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("FP8 attention is forward-only: q, k and v must not require grad")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a real number > 0 or None, got {softmax_scale!r}")
    return fp8.fp8_attention(q, k, v, q_descale, k_descale, v_descale, causal=causal, softmax_scale=softmax_scale,
                             return_lse=return_lse, reference=backend == "reference")


def flash_attention_science(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Exact scaled-dot-product attention, softmax(q kᵀ · scale) v, without materialising the score matrix.

    Args:
        q: `(..., Hq, Lq, D)` as in `torch.nn.functional.scaled_dot_product_attention`, or 2-D `(Lq, D)` for one
            head. Any strides with a unit-stride last dim: `x.view(B, L, H, D).transpose(1, 2)` runs without a copy.
        k, v: `(..., Hkv, Lk, D)` with the same leading dims; `Hq % Hkv == 0` gives GQA/MQA without copying k/v.
            D is a multiple of 8 in [16, 256].
        causal: bottom-right aligned mask (flash-attn convention): query i sees key j iff `j <= i + Lk - Lq`;
            identical to SDPA's `is_causal` when Lq == Lk. A query that sees no key gets zeros and lse -inf.
        softmax_scale: defaults to `1 / sqrt(D)`.
        return_lse: also return the natural-log log-sum-exp of the scaled scores, float32 `(..., Hq, Lq)`
            (float64 for float64 inputs), so partial results over key blocks can be merged.
        backend: "auto" (CUDA: the best kernel for the GPU; CPU: the PyTorch reference), "hopper" (the Gluon sm_90
            forward; a ValueError where it cannot run), "triton" (the portable kernels; on CPU tensors only under
            TRITON_INTERPRET=1), or "reference".
        deterministic: True, or `torch.use_deterministic_algorithms(True)`: the backward runs a dK/dV pass and a
            dQ pass, no atomics, bit-identical gradients run to run. False (default) allows, when q needs a
            gradient and k or v does too, one pass for all three that sums dQ with float32 atomics (dQ may then
            differ in its last bits run to run; dK and dV never do): on Hopper the Gluon sm_90 backward (head dims
            up to 128, after the sm_90 forward), under the Triton interpreter the fused Triton pass; other GPUs
            and head dims run the two passes either way. On Hopper, head dims 129..256 always run the Gluon
            dK/dV and dQ kernels (deterministic). The forward is always deterministic.
        q_descale, k_descale, v_descale: FP8 (forward only): with float8_e4m3fn q, k, v, float32 (B, Hkv) factors
            such that real value = fp8 value × descale (flash-attn's convention; `quantize_fp8` makes all six).
            The output is bfloat16. On Hopper, head dims 64/128/256 run an e4m3 tensor-core kernel; elsewhere the
            inputs are dequantised and the bf16 (GPU) or float32 (CPU) path runs. See attention/fp8.py.

    Kernels: on Hopper, bf16/fp16 with TMA-compatible strides run the Gluon sm_90 kernel (warp-specialised: TMA
    producer warp, two consumer warpgroups, async wgmma; persistent CTAs except causal rows longer than 8192, or
    than 4096 with fewer than 12 query tiles per SM); everything else on a GPU runs the portable Triton kernel;
    CPU tensors run the PyTorch reference. `describe_dispatch` says which and why.

    Accuracy: bf16/fp16 inputs are multiplied on tensor cores with float32 accumulation and a float32 softmax.
    float32 inputs use 3xTF32 tensor-core products on the GPU (close to float32 accuracy, about 3x the cost of
    TF32); the CPU reference computes float32 exactly.

    Returns:
        `out` with q's shape and dtype, or `(out, lse)` when `return_lse=True`.
    """
    if on_another_cuda_device(q):
        with torch.cuda.device(q.device):  # Triton launches on the current device: make it q's
            return flash_attention_science(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                           return_lse=return_lse, backend=backend, deterministic=deterministic)
    if (q_descale is not None or k_descale is not None or v_descale is not None
            or getattr(q, "dtype", None) in _FP8_DTYPES or getattr(k, "dtype", None) in _FP8_DTYPES
            or getattr(v, "dtype", None) in _FP8_DTYPES):
        return _fp8_call(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, return_lse, backend,
                         deterministic)
    key = _prepared_key(q, k, v, causal, softmax_scale, return_lse, backend, deterministic)
    prepared = _PREPARED.get(key) if key is not None else None
    if prepared is not None:  # a call with this signature ran before: checks and plan as then
        out, lse = _new_outputs(q)
        prepared(q, k, v, out, lse)
        return (out, lse) if return_lse else out

    _check_inputs(q, k, v, softmax_scale, backend)
    _check_flags(causal=causal, return_lse=return_lse, deterministic=deterministic)
    plan, _ = _dispatch(q, k, v, causal, backend)
    prob = _normalise(q, k, v, softmax_scale)
    if plan is not None:
        _check_triton_layout(q, k, v)

    if q.numel() == 0 or k.shape[-2] == 0:
        # Nothing to attend over (or nobody asking): zero output, -inf log-sum-exp; still differentiable.
        out = _NoKeys.apply(q, k, v)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # as the reference's
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype, device=q.device)
        return (out, lse) if return_lse else out

    if prob.q is not None and prob.k is not None and prob.v is not None:
        out4, lse4 = _run(plan, prob.q, prob.k, prob.v, causal, prob.softmax_scale, deterministic)
        out, lse = out4.view(q.shape), lse4.view(q.shape[:-1])
        if key is not None and plan is not None and q.is_cuda and q.dim() == 4 and not autotune_enabled():
            _remember(key, plan, q, k, v, out, lse, causal, prob.softmax_scale)
    else:
        # Leading dims whose strides cannot merge into one batch dim: run each leading index on its own
        # (no input copies; the outputs are stacked).
        outs, lses = [], []
        for index in itertools.product(*(range(n) for n in q.shape[:-4])):
            o, l = _run(plan, q[index], k[index], v[index], causal, prob.softmax_scale, deterministic)
            outs.append(o)
            lses.append(l)
        out = torch.stack(outs).view(q.shape)
        lse = torch.stack(lses).view(q.shape[:-1])
    return (out, lse) if return_lse else out
