"""FP8 (e4m3) attention forward: quantisation with an optional Hadamard rotation, and the checks of a call.

Convention (flash-attn's): q, k, v are `torch.float8_e4m3fn` and each comes with a float32 descale factor per
(batch, kv-head), shape (B, Hkv): the real value is ``fp8 value × descale``. The output is bfloat16.

Granularity: one scale per (batch, kv-head) slab, the block the kernel multiplies by for free (folded into the
softmax multiplier for q and k, into the final normalisation for v). Query heads of one GQA group share their
kv-head's scale. Finer blocks would cost a multiply per score tile; the Hadamard rotation is what removes the
outliers that make a coarse scale lossy (FlashAttention-3's incoherent processing).

Hadamard rotation: Q and K are multiplied along the head dim by the same orthonormal matrix ``R = diag(s)·H/√D``
(H the Walsh–Hadamard matrix, s a fixed random ±1 vector): ``(QR)(KR)ᵀ = QKᵀ`` exactly, so attention is unchanged,
but a channel 100x larger than the rest is spread over all D channels before rounding to e4m3. V is not rotated
(its rotation would have to be undone on the output). The rotation is a fast Walsh–Hadamard transform, O(D log D)
per row, fused into the quantisation kernel on the GPU.

V layout: e4m3 wgmma wants the P·V product's B operand K-major, i.e. V stored with the sequence dim contiguous.
`quantize_fp8` writes V that way (the transpose is fused into the quantisation, so the attention kernel pays
nothing); its result is still a (B, Hkv, L, D) tensor, with strides (.., D·L, 1, L). A row-major e4m3 V given by
the caller is transposed once by the front door (a copy: documented in the README).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from flashmoe_science.attention.checks import check_flags, check_scale
from flashmoe_science.attention.fp8_format import hadamard_signs
from flashmoe_science.fp8_format import FP8, FP8_MAX


class Fp8Inputs(NamedTuple):
    """What `flash_attention_science` takes for an FP8 call: `flash_attention_science(*inputs[:3], q_descale=...,
    k_descale=..., v_descale=...)`, or `flash_attention_science(**inputs._asdict())`."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x·diag(s)·H/√D along the last dim in float32: the PyTorch spec of the kernel's rotation (log2 D butterfly
    stages of a fast Walsh–Hadamard transform). D must be a power of two."""
    d = x.shape[-1]
    y = (x.float() * hadamard_signs(d, x.device)).reshape(-1, d)
    half = 1
    while half < d:
        pairs = y.view(-1, d // (2 * half), 2, half)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2).reshape(-1, d)
        half *= 2
    return (y / math.sqrt(d)).view(x.shape)


def _check_quantize_inputs(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"quantize_fp8: {name} must be bfloat16, float16 or float32, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"quantize_fp8: {name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"quantize_fp8: q, k and v must be on one device, got {name} on {t.device}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"quantize_fp8: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         f"form an attention call (k and v equal; batch and head dim shared with q)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"quantize_fp8: q's head count ({q.shape[1]}) must be a multiple of k's ({k.shape[1]})")


def quantize_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, hadamard: bool = True) -> Fp8Inputs:
    """Quantise (B, H, L, D) q, k, v to e4m3 with one scale per (batch, kv-head); optionally rotate Q and K by a
    random Hadamard matrix first (`hadamard=True`, needs a power-of-two head dim). Returns `Fp8Inputs`; V comes
    back K-major (see the module docstring). On CUDA one fused Triton kernel per tensor (rotation, amax, scale,
    cast; plus the transpose for V); elsewhere the same in PyTorch."""
    _check_quantize_inputs(q, k, v)
    d = q.shape[-1]
    if hadamard and (d & (d - 1) or d < 2):
        raise ValueError(f"quantize_fp8: hadamard=True needs a power-of-two head dim, got {d}")
    if q.is_cuda:
        from flashmoe_science.attention.triton.fp8 import quantize_slabs

        group = q.shape[1] // k.shape[1]
        q8, qd = quantize_slabs(q, group, hadamard, transpose=False)
        k8, kd = quantize_slabs(k, 1, hadamard, transpose=False)
        v8, vd = quantize_slabs(v, 1, False, transpose=True)
        return Fp8Inputs(q8, k8, v8, qd, kd, vd)
    return _quantize_reference(q, k, v, hadamard)


def _quantize_slab_reference(x: torch.Tensor, group: int, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = hadamard_rotate(x) if rotate else x.float()
    b, h = x.shape[:2]
    amax = x.abs().reshape(b, h // group, -1).amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    per_head = scale.repeat_interleave(group, dim=1)[:, :, None, None]
    return (x / per_head).to(FP8), scale


def _quantize_reference(q, k, v, hadamard: bool) -> Fp8Inputs:
    group = q.shape[1] // k.shape[1]
    q8, qd = _quantize_slab_reference(q, group, hadamard)
    k8, kd = _quantize_slab_reference(k, 1, hadamard)
    v8, vd = _quantize_slab_reference(v, 1, False)
    return Fp8Inputs(q8, k8, v8.transpose(-1, -2).contiguous().transpose(-1, -2), qd, kd, vd)


def dequantize(t: torch.Tensor, descale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """fp8 (B, H, L, D) × its (B, Hkv) descale -> `dtype` (query heads of a group share their kv-head's scale),
    row-major whatever `t`'s layout (V arrives K-major from `quantize_fp8`; the kernels take a unit last stride)."""
    group = t.shape[1] // descale.shape[1]
    scaled = t.to(torch.float32) * descale.repeat_interleave(group, dim=1)[:, :, None, None]
    return scaled.to(dtype, memory_format=torch.contiguous_format)


def check_fp8_call(q, k, v, q_descale, k_descale, v_descale) -> None:
    """The checks of an FP8 call (fp8 inputs or any descale given). Raises TypeError/ValueError naming the
    argument."""
    dtypes = {name: t.dtype for name, t in (("q", q), ("k", k), ("v", v))}
    fp8_names = [n for n, dt in dtypes.items() if dt in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if any(dt == torch.float8_e5m2 for dt in dtypes.values()):
        raise TypeError("float8_e5m2 is not supported: FP8 attention takes float8_e4m3fn q, k and v "
                        "(quantize_fp8 makes them)")
    if fp8_names and len(fp8_names) != 3:
        raise TypeError(f"q, k and v must all be float8_e4m3fn or none of them, got q={dtypes['q']}, "
                        f"k={dtypes['k']}, v={dtypes['v']}")
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if not fp8_names:
        given = [n for n, t in descales.items() if t is not None]
        raise TypeError(f"{', '.join(given)} given with {dtypes['q']} inputs: descale factors are for "
                        f"float8_e4m3fn q, k, v only")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"FP8 attention takes 4-D (B, H, L, D) q, k, v, got {q.dim()}, {k.dim()}, {v.dim()} dims")
    batch, kv_heads = k.shape[0], k.shape[1]
    for name, t in descales.items():
        if t is None:
            raise ValueError(f"{name} is required with float8_e4m3fn inputs (float32 (B, Hkv) = "
                             f"({batch}, {kv_heads}); quantize_fp8 returns it)")
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tuple(t.shape) != (batch, kv_heads):
            raise ValueError(f"{name} must have shape (B, Hkv) = ({batch}, {kv_heads}), got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if t.requires_grad:
            raise ValueError(f"FP8 attention is forward-only: {name} must not require grad")


@dataclass(frozen=True, eq=False)
class Fp8Problem:
    """A checked FP8 call: 4-D e4m3 q, k, v, their (B, Hkv) descales, the causal flag, the scale (default 1/sqrt(D))
    and the backend asked for (`plan.plan_fp8` walks the FP8 backends)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    causal: bool
    softmax_scale: float
    backend: str


def fp8_problem(q, k, v, q_descale, k_descale, v_descale, *, causal, softmax_scale, backend, **flags) -> Fp8Problem:
    """The checks of an FP8 call (fp8 inputs or any descale given), once: TypeError/ValueError naming the
    argument. `flags`: the call's other bools (return_lse, deterministic)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_fp8_call(q, k, v, q_descale, k_descale, v_descale)
    check_flags(causal=causal, **flags)
    check_scale(softmax_scale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("FP8 attention is forward-only: q, k and v must not require grad")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return Fp8Problem(q, k, v, (q_descale, k_descale, v_descale), causal, scale, backend)


# ---------------------------------------------------------------------------------------------- the e4m3 kernels
E4M3_HEAD_DIMS = (64, 128, 256)  # what both e4m3 kernels (the Gluon and the Triton one) take


def e4m3_kernel_refusal(problem: Fp8Problem) -> str | None:
    """Why neither e4m3 kernel takes a call its device suits (None when they do): their head dims. q and k must have
    a unit last stride for them (ValueError)."""
    q = problem.q
    if q.shape[-1] not in E4M3_HEAD_DIMS:
        return f"the e4m3 kernel takes head dims 64, 128 and 256, got {q.shape[-1]}"
    for name, t in (("q", q), ("k", problem.k)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit-stride last dim for FP8 attention, got strides {t.stride()}")
    return None


def fp8_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out bf16, lse float32) of an FP8 call, for a kernel to write."""
    return (torch.empty(q.shape, dtype=torch.bfloat16, device=q.device),
            torch.empty(q.shape[:3], dtype=torch.float32, device=q.device))


def no_keys(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 call with nothing to attend over (an empty q or no keys): zeros out, -inf lse."""
    out.zero_()
    lse.fill_(float("-inf"))
    return out, lse
