"""FP8 (e4m3) experts: the block-scaled checkpoint format, its quantisers, the checks and plan of a call, and the
PyTorch reference that emulates the quantisation.

Format (DeepSeek-V3 / Qwen3-FP8 checkpoints; vLLM's block-FP8 ``fused_moe`` convention):

- weights ``w1 (E, 2F, d)`` and ``w2 (E, d, F)`` in ``torch.float8_e4m3fn``, each with ``weight_scale_inv`` of
  shape ``(E, ceil(rows / 128), ceil(cols / 128))`` float32: the real weight is ``w[e, n, k] * scale_inv[e, n //
  128, k // 128]``. A block's scale maps its largest magnitude onto 448, e4m3's largest finite value.
- activations are quantised per token and per group of 128 consecutive features (1x128): ``scale = max(amax,
  1e-10) / 448``, ``q = round_to_e4m3(x / scale)``, in float32 with both divisions rounded to nearest (the scale is
  a float32 and ``x / scale`` lands exactly on an e4m3 rounding tie for ~0.5% of 16-bit x: a division a few ulp
  off, or one in float64, rounds those ties elsewhere). The experts quantise x this way as they gather it, and the
  SwiGLU output ``h`` per 128 columns of F before the down projection.

Every product is an e4m3 x e4m3 dot of one 128-wide K block, accumulated in float32 after multiplying by the row's
activation scale and the column's weight scale of that block, so both GEMMs stay exact up to the roundings of the
format: the reference here computes the same with the roundings emulated (in float64 for tests: the only fair
oracle of a quantised layer), the kernels are in ``moe/triton_fp8_gemm.py``.

The FP8 experts run the forward only (inference): a call that autograd records raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashmoe_science.backends import Choice, choose
from flashmoe_science.device import FP8_CAPABILITY, arch_name, device_traits
from flashmoe_science.moe.checks import check_experts, check_tensor
from flashmoe_science.moe.fp8_format import BLOCK, FP8, FP8_MAX, SCALE_EPS
from flashmoe_science.moe.plan import check_backend, triton_refusal
from flashmoe_science.moe.triton_fp8_gemm import choose_fp8_tiles, fp8_forward


# ---------------------------------------------------------------------------------------------- quantisers
def _blocks_of(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t (..., N, K) zero-padded to whole blocks, viewed as (..., N / rows, rows, K / cols, cols)."""
    *lead, n, k = t.shape
    nb, kb = math.ceil(n / rows), math.ceil(k / cols)
    padded = F.pad(t, (0, kb * cols - k, 0, nb * rows - n))
    return padded.reshape(*lead, nb, rows, kb, cols)


def quantize_fp8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w (..., N, K)`` float -> ``(e4m3 (..., N, K), weight_scale_inv (..., ceil(N/128), ceil(K/128)) float32)``.

    Per 128x128 block (the last block of a dim may be partial): ``scale = 448 / amax`` in float32 (1 for an
    all-zero block), ``q = round(clamp(w * scale))``, stored as ``1 / scale``. This is transformers'
    ``FineGrainedFP8Config`` quantisation (``Fp8Quantize``), so a model quantised by either gives the same bytes."""
    check_tensor("w", w, w.dim(), (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    if w.dim() < 2:
        raise ValueError(f"w must be at least 2-D (..., N, K), got shape {tuple(w.shape)}")
    *_, n, k = w.shape
    blocks = _blocks_of(w.float(), BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, 1.0), 1.0)
    q = (blocks * scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.reshape(*w.shape[:-2], blocks.shape[-4] * BLOCK, blocks.shape[-2] * BLOCK)[..., :n, :k]
    return q.contiguous(), (1.0 / scale).float()


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest even, saturating (what the GPU's conversion does); stays in v's dtype."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8).to(v.dtype)


def quantize_fp8_groups(x: torch.Tensor, cast=round_to_e4m3) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantisation of ``x (..., K)``: ``(q, scale)`` with ``q`` the e4m3 values (the bytes a kernel
    stores, as numbers) and ``scale (..., ceil(K/128))`` such that ``x ≈ q * scale`` per group of 128, both in x's
    dtype. Computed as the kernels do, whatever x's dtype: x rounded to float32, ``scale = max(amax, 1e-10) / 448``
    and ``x / scale`` as IEEE float32 divisions, then ``cast`` rounds to e4m3 (default: to nearest even, as the GPU;
    a test may pass another rounding). The divisor is a tensor: PyTorch's CUDA division by a Python scalar multiplies
    by its reciprocal, which is not the rounded quotient."""
    num_groups = math.ceil(x.shape[-1] / BLOCK)
    groups = _blocks_of(x[..., None, :].float(), 1, BLOCK).reshape(*x.shape[:-1], num_groups, BLOCK)
    amax = groups.abs().amax(dim=-1).clamp(min=SCALE_EPS)
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = cast((groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX))
    q = q.reshape(*x.shape[:-1], num_groups * BLOCK)[..., :x.shape[-1]]
    return q.to(x.dtype), scale.to(x.dtype)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``q (..., N, K) * scale`` broadcast over 128x128 blocks (``weight_scale_inv``), in ``dtype``."""
    n, k = q.shape[-2:]
    full = scale.to(dtype).repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]
    return q.to(dtype) * full


def _per_group(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values (..., K) times their groups' scales (..., ceil(K/128))."""
    return values * scale.repeat_interleave(BLOCK, dim=-1)[..., :values.shape[-1]]


# ------------------------------------------------------------------------------------------------- checks
def check_fp8_experts(x, w1, w1_scale, w2, w2_scale):
    """The checks of an FP8 experts call; returns (T, d, E, F) like ``checks.check_experts``."""
    check_tensor("x", x, 2, (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    for name, w in (("w1", w1), ("w2", w2)):
        check_tensor(name, w, 3)
        if w.dtype != FP8:
            raise TypeError(f"{name} must be torch.float8_e4m3fn when scales are given, got {w.dtype}")
    for name, w in (("w1", w1), ("w2", w2)):
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}; all tensors must share a device")
    # the unquantised call's shape checks, on stand-ins of x's dtype (one element broadcast to each weight's shape)
    dims = check_experts(x, x.new_empty(()).expand(w1.shape), x.new_empty(()).expand(w2.shape))
    for name, w, scale in (("w1_scale", w1, w1_scale), ("w2_scale", w2, w2_scale)):
        check_tensor(name, scale, 3, (torch.float32,))
        want = (w.shape[0], math.ceil(w.shape[1] / BLOCK), math.ceil(w.shape[2] / BLOCK))
        if tuple(scale.shape) != want:
            raise ValueError(f"{name} must have shape (E, ceil(N/{BLOCK}), ceil(K/{BLOCK})) = {want} for "
                             f"{BLOCK}x{BLOCK} blocks of a weight of shape {tuple(w.shape)}, got {tuple(scale.shape)}")
        if scale.device != x.device:
            raise ValueError(f"{name} is on {scale.device} but x is on {x.device}; all tensors must share a device")
    for name, w in (("w1", w1), ("w2", w2)):
        if w.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit-stride last dim (K-major, as e4m3 tensor-core products "
                             f"read it), got strides {w.stride()}")
    return dims


def check_forward_only(*tensors) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("the FP8 experts run the forward only: call them under torch.no_grad() or "
                         "torch.inference_mode(), with no input that requires grad")


# ---------------------------------------------------------------------------------------------- reference
def fp8_experts_reference(x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, cast=round_to_e4m3):
    """The FP8 experts in PyTorch with every rounding of the format emulated: x quantised per 1x128 group, the
    weights dequantised, gate and up, ``h = silu(gate) * up`` quantised per 1x128 group, the down projection,
    the routing weights and the combine. Computes in float32 (float64 for float64 x: the test oracle) and returns
    x's dtype. ``cast``: the rounding to e4m3 (``quantize_fp8_groups``)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    num_experts, two_d_ff, _ = w1.shape
    d_ff = two_d_ff // 2
    xq, xs = quantize_fp8_groups(x.to(compute), cast)
    x_deq = _per_group(xq, xs)
    weights = topk_weights.to(compute)
    out = torch.zeros(x.shape, dtype=compute, device=x.device)
    for expert in range(num_experts):
        token_idx, slot_idx = torch.nonzero(topk_ids == expert, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        w1_e = dequantize_fp8(w1[expert], w1_scale[expert], compute)  # one expert at a time: bounded memory
        w2_e = dequantize_fp8(w2[expert], w2_scale[expert], compute)
        gate_up = x_deq[token_idx] @ w1_e.T
        h = F.silu(gate_up[:, :d_ff]) * gate_up[:, d_ff:]
        hq, hs = quantize_fp8_groups(h, cast)
        y = (_per_group(hq, hs) @ w2_e.T) * weights[token_idx, slot_idx].unsqueeze(-1)
        out = out.index_add(0, token_idx, y)
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Fp8ExpertsProblem:
    """A checked FP8 experts call: x (T, d), e4m3 w1 (E, 2F, d) / w2 (E, d, F) with their block scales, top_k and
    the ``backend`` asked for."""

    x: torch.Tensor
    w1: torch.Tensor
    w1_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    top_k: int
    backend: str = "auto"


class Fp8Kernels:
    """The Triton e4m3 kernels (``moe/triton_fp8_gemm.py``): CUDA GPUs of compute capability 8.9 or newer, or CPU
    tensors under TRITON_INTERPRET=1 when asked for by name."""

    name = "triton"

    def decline(self, problem: Fp8ExpertsProblem) -> str | None:
        x = problem.x
        refusal = triton_refusal(x, problem.backend)
        if refusal is not None or not x.is_cuda:
            return refusal
        traits = device_traits(x.device)
        if not traits.fp8_mma:
            return (f"e4m3 tensor-core products need compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or "
                    f"newer ({arch_name(FP8_CAPABILITY)}), this GPU is {traits.arch}")
        return None

    def plan(self, problem: Fp8ExpertsProblem):
        x, w1 = problem.x, problem.w1
        return choose_fp8_tiles(x.shape[0], problem.top_k, w1.shape[0], x.shape[1], w1.shape[1] // 2, x.device)


class Fp8Reference:
    """``fp8_experts_reference``: any device, float32 compute (float64 for float64 x)."""

    name = "reference"

    def decline(self, problem: Fp8ExpertsProblem) -> str | None:
        return None

    def plan(self, problem: Fp8ExpertsProblem) -> None:
        return None


FP8_LAYER_BACKENDS = (Fp8Kernels(), Fp8Reference())


def plan_fp8_experts(problem: Fp8ExpertsProblem) -> Choice:
    """The family that runs a checked FP8 call (``Choice.plan``: the kernels' ``Fp8Tiles``, or None for the
    reference), with the reasons of the families declined before it; a family asked for by name that cannot take
    the call raises ValueError (``backends.NoBackend``)."""
    check_backend(problem.backend)
    return choose(FP8_LAYER_BACKENDS, problem, problem.backend)


def describe_fp8(plan: Choice) -> str:
    """``plan_fp8_experts``' plan in sentences, as ``plan.describe`` renders an unquantised call's."""
    lines = [f"experts (FP8 e4m3, {BLOCK}x{BLOCK} weight blocks, 1x{BLOCK} activation groups): {plan.backend}"]
    lines += [f"  not {name}: {why}" for name, why in plan.declined]
    if plan.plan is None:
        lines.append("  fp8.fp8_experts_reference (PyTorch, the quantisation emulated, float32 accumulation)")
    else:
        lines += [f"  {line}" for line in plan.plan.describe()]
    return "\n".join(lines)


def run_fp8_experts(plan: Choice, x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids):
    """The FP8 experts on checked inputs, as ``plan`` says."""
    if plan.plan is None:
        return fp8_experts_reference(x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids)
    return fp8_forward(x, w1, w1_scale, w2, w2_scale, topk_weights.float().contiguous(), topk_ids, plan.plan)
