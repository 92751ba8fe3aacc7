"""FP8 attention (attention/fp8.py, attention/triton/fp8.py): checks, quantisation, the Hadamard rotation, and accuracy
against float64 — on the CPU through the dequantised path, on the GPU through the e4m3 kernel."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashmoe_science import flash_attention_science, quantize_fp8
from flashmoe_science.attention.fp8 import FP8, dequantize, hadamard_rotate
from flashmoe_science.attention.reference import attention_reference

gpu = pytest.mark.gpu


def _inputs(b=2, hq=4, hkv=2, lq=37, lk=53, d=64, device="cpu", outliers=0.0):
    q = torch.randn(b, hq, lq, d, device=device)
    k = torch.randn(b, hkv, lk, d, device=device)
    v = torch.randn(b, hkv, lk, d, device=device)
    if outliers:  # a few channels much larger, as in LLM activations
        channels = torch.randperm(d)[:4]
        q[..., channels] *= outliers
        k[..., channels] *= outliers
    return q, k, v


def _call(inputs, **kw):
    return flash_attention_science(inputs.q, inputs.k, inputs.v, q_descale=inputs.q_descale,
                                   k_descale=inputs.k_descale, v_descale=inputs.v_descale, **kw)


def _oracle(inputs, causal=False, scale=None):
    """float64 attention of the dequantised fp8 inputs (what the kernel is asked to compute)."""
    q, k, v = (dequantize(t, s, torch.float64) for t, s in
               ((inputs.q, inputs.q_descale), (inputs.k, inputs.k_descale), (inputs.v, inputs.v_descale)))
    return attention_reference(q, k, v, causal, scale or 1 / math.sqrt(q.shape[-1]))


def test_quantize_shapes_scales_and_k_major_v():
    q, k, v = _inputs()
    inputs = quantize_fp8(q, k, v, hadamard=False)
    assert inputs.q.dtype == inputs.k.dtype == inputs.v.dtype == FP8
    assert inputs.q.shape == q.shape and inputs.v.shape == v.shape
    assert inputs.v.stride(-2) == 1  # K-major V: what e4m3 wgmma wants for P·V
    for d in (inputs.q_descale, inputs.k_descale, inputs.v_descale):
        assert d.shape == (2, 2) and d.dtype == torch.float32
    for t, s, x in ((inputs.q, inputs.q_descale, q), (inputs.k, inputs.k_descale, k), (inputs.v, inputs.v_descale, v)):
        back = dequantize(t, s)
        assert ((back - x).abs() <= x.abs() / 14 + 1e-2 * s.max()).all()  # e4m3: 3 mantissa bits


def test_hadamard_is_orthogonal_and_keeps_scores():
    for d in (16, 64, 256):
        rot = hadamard_rotate(torch.eye(d, dtype=torch.float64))
        torch.testing.assert_close(rot @ rot.T, torch.eye(d, dtype=torch.float32), atol=1e-5, rtol=0)
    q, k, _ = _inputs(d=128)
    torch.testing.assert_close(hadamard_rotate(q) @ hadamard_rotate(k).transpose(-1, -2).repeat_interleave(2, 1),
                               q @ k.transpose(-1, -2).repeat_interleave(2, 1), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_path_matches_the_dequantised_oracle(causal):
    inputs = quantize_fp8(*_inputs())
    out, lse = _call(inputs, causal=causal, return_lse=True)
    want, want_lse = _oracle(inputs, causal)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-4, rtol=1e-4)


def _rmse_ratio(device, d=128, magnitude=30.0, kernel_backend="auto"):
    q, k, v = _inputs(b=2, hq=4, hkv=4, lq=256, lk=256, d=d, device=device, outliers=magnitude)
    scale = 1 / (math.sqrt(d) * magnitude)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), False, scale)
    errors = {}
    for hadamard in (False, True):
        out = _call(quantize_fp8(q, k, v, hadamard=hadamard), softmax_scale=scale, backend=kernel_backend)
        errors[hadamard] = (out.double() - ref).pow(2).mean().sqrt().item()
    return errors[False] / errors[True]


@pytest.mark.parametrize("magnitude", [10.0, 100.0])
def test_hadamard_cuts_the_error_of_outlier_channels(magnitude):
    assert _rmse_ratio("cpu", magnitude=magnitude) >= 2.0


def test_bad_input_is_named():
    q, k, v = _inputs()
    inputs = quantize_fp8(q, k, v)
    with pytest.raises(ValueError, match="q_descale is required"):
        flash_attention_science(inputs.q, inputs.k, inputs.v)
    with pytest.raises(TypeError, match="all be float8_e4m3fn or none"):
        flash_attention_science(inputs.q, k, v, q_descale=inputs.q_descale)
    with pytest.raises(TypeError, match="e5m2"):
        flash_attention_science(inputs.q.to(torch.float8_e5m2), inputs.k, inputs.v, q_descale=inputs.q_descale,
                                k_descale=inputs.k_descale, v_descale=inputs.v_descale)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(B, Hkv\)"):
        flash_attention_science(inputs.q, inputs.k, inputs.v, q_descale=inputs.q_descale,
                                k_descale=inputs.k_descale[:, :1], v_descale=inputs.v_descale)
    with pytest.raises(TypeError, match="v_descale must be a float32"):
        flash_attention_science(inputs.q, inputs.k, inputs.v, q_descale=inputs.q_descale,
                                k_descale=inputs.k_descale, v_descale=inputs.v_descale.double())
    with pytest.raises(TypeError, match="for float8_e4m3fn q, k, v only"):
        flash_attention_science(q, k, v, q_descale=inputs.q_descale)
    with pytest.raises(ValueError, match="forward-only"):
        flash_attention_science(inputs.q, inputs.k, inputs.v, q_descale=inputs.q_descale,
                                k_descale=inputs.k_descale.requires_grad_(), v_descale=inputs.v_descale)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        quantize_fp8(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(TypeError, match="quantize_fp8: q must be"):
        quantize_fp8(q.double(), k, v)


# ------------------------------------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("hadamard", [False, True])
def test_gpu_quantisation_matches_the_reference(hadamard):
    q, k, v = _inputs(device="cuda", d=128, lq=300, lk=129)
    got = quantize_fp8(q.bfloat16(), k.bfloat16(), v.bfloat16(), hadamard=hadamard)
    want = quantize_fp8(q.bfloat16().cpu(), k.bfloat16().cpu(), v.bfloat16().cpu(), hadamard=hadamard)
    for name in ("q_descale", "k_descale", "v_descale"):
        torch.testing.assert_close(getattr(got, name).cpu(), getattr(want, name), rtol=1e-5, atol=0)
    for name in ("q", "k", "v"):
        a, b = getattr(got, name).cpu().float(), getattr(want, name).float()
        assert getattr(got, name).stride(-2 if name == "v" else -1) == 1
        assert ((a - b).abs() <= b.abs() / 8 + 1e-6).all(), name  # at most one e4m3 step apart (rounding ties)


def _hopper_or_skip():
    from flashmoe_science.device import device_traits
    from flashmoe_science.gluon.target import ARCH

    if not torch.cuda.is_available() or device_traits(torch.device("cuda")).arch != ARCH:
        pytest.skip("the e4m3 kernels need a Hopper (sm_90) GPU")


def _fp8_plan(inputs, causal, kernel, schedule=None):
    """The checked problem and the plan of one e4m3 kernel: "gluon" (the sm_90 Gluon forward, with `schedule` =
    (persistent, Q buffers) instead of the planned one if given) or "triton"."""
    from dataclasses import replace

    from flashmoe_science.attention.fp8 import fp8_problem
    from flashmoe_science.attention.hopper.backend import HopperFp8Forward, fp8_forward_plan
    from flashmoe_science.attention.triton.backend import TritonFp8Forward

    problem = fp8_problem(*inputs, causal=causal, softmax_scale=None, backend="auto")
    if kernel == "triton":
        return problem, TritonFp8Forward()
    plan = fp8_forward_plan(problem)
    assert isinstance(plan, HopperFp8Forward), plan.describe()
    if schedule is not None:
        plan = replace(plan, persistent=schedule[0], q_buffers=schedule[1])
    return problem, plan


@gpu
@pytest.mark.parametrize("kernel", ["gluon", "triton"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(1, 1), (77, 77), (300, 513), (513, 300)])
def test_gpu_kernel_against_float64(kernel, d, causal, lq, lk):
    _hopper_or_skip()
    q, k, v = _inputs(b=2, hq=8, hkv=2, lq=lq, lk=lk, d=d, device="cuda")
    inputs = quantize_fp8(q, k, v)
    problem, plan = _fp8_plan(inputs, causal, kernel)
    _check_against_float64(inputs, *plan.run(problem), causal)


@gpu
@pytest.mark.parametrize("schedule", [(True, 2), (True, 1), (False, 1)], ids=["persistent-q2", "persistent-q1",
                                                                              "per-tile"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_schedules_against_float64(schedule, d, causal):
    """Several work items per CTA (2 x 8 heads x 17 query tiles on at most 132 SMs), GQA 4:1, a ragged end."""
    _hopper_or_skip()
    q, k, v = _inputs(b=2, hq=8, hkv=2, lq=2100, lk=2100, d=d, device="cuda")
    inputs = quantize_fp8(q, k, v)
    problem, plan = _fp8_plan(inputs, causal, "gluon", schedule)
    _check_against_float64(inputs, *plan.run(problem), causal)


@gpu
def test_gpu_dispatch_runs_the_gluon_kernel_on_hopper():
    """backend="auto" on Hopper runs the Gluon e4m3 forward (describe_dispatch says so) and gives its result."""
    from flashmoe_science.attention.api import describe_dispatch
    from flashmoe_science.attention.hopper.backend import FORWARD_KERNEL

    _hopper_or_skip()
    q, k, v = _inputs(b=1, hq=4, hkv=4, lq=300, lk=300, d=128, device="cuda")
    inputs = quantize_fp8(q, k, v)
    dispatch = describe_dispatch(inputs.q, inputs.k, inputs.v, q_descale=inputs.q_descale,
                                 k_descale=inputs.k_descale, v_descale=inputs.v_descale, causal=True)
    assert dispatch.kernel == FORWARD_KERNEL and "e4m3" in dispatch.reason, dispatch
    out, lse = _call(inputs, causal=True, return_lse=True)
    problem, plan = _fp8_plan(inputs, True, "gluon")
    want, want_lse = plan.run(problem)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def _check_against_float64(inputs, out, lse, causal):
    """The e4m3 kernel's (out, lse) against float64 attention of the dequantised inputs: within twice PyTorch's
    bf16 error on the same inputs plus e4m3 P's rounding, rows that see no key zero with lse -inf."""
    q, k = inputs.q, inputs.k
    lq, lk = q.shape[2], k.shape[2]
    want, want_lse = _oracle(inputs, causal)
    # PyTorch's own error on the same dequantised inputs in bf16
    qd, kd, vd = (dequantize(t, s, torch.bfloat16) for t, s in
                  ((inputs.q, inputs.q_descale), (inputs.k, inputs.k_descale), (inputs.v, inputs.v_descale)))
    rep = q.shape[1] // k.shape[1]
    mask = None
    if causal:
        from flashmoe_science.attention.reference import causal_visibility
        mask = causal_visibility(lq, lk, "cuda")
    torch_out = F.scaled_dot_product_attention(qd, kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1),
                                               attn_mask=mask)
    seen = torch.isfinite(want_lse)
    torch_err = (torch_out.double() - want)[..., :][seen].abs().max().item()
    our_err = (out.double() - want)[seen].abs().max().item()
    assert torch.isfinite(out[seen]).all()
    # P is rounded to e4m3 in the kernel (FlashAttention-3's FP8 recipe): allow that on top of 2x bf16's error
    assert our_err <= 2 * torch_err + 0.06, (our_err, torch_err)
    torch.testing.assert_close(lse[seen].double(), want_lse[seen], atol=2e-2, rtol=1e-3)
    assert (out[~seen] == 0).all()


@gpu
def test_gpu_hadamard_cuts_the_error_of_outlier_channels():
    assert _rmse_ratio("cuda", magnitude=30.0) >= 2.0


def test_e4m3_forward_builds_for_sm90_offline():
    """The e4m3 Triton forward compiles for sm_90 without a GPU (meta tensors; ptxas ships with triton): catches a
    drift of the shared building blocks it calls (triton.common.online_softmax_step, mask.visible) on the CPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    from flashmoe_science.attention.triton.fp8 import _fp8_forward_kernel, fp8_tiles
    from flashmoe_science.attention.layout import tma_descriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    d, tiles = 128, fp8_tiles(128)
    q = torch.empty(2, 4, 256, d, dtype=FP8, device="meta")
    vt = torch.empty(2, 4, d, 256, dtype=FP8, device="meta")
    out = torch.empty(2, 4, 256, d, dtype=torch.bfloat16, device="meta")
    lse, descale = torch.empty(2, 4, 256, device="meta"), torch.empty(2, 4, device="meta")
    v_desc = TensorDescriptor(vt, list(vt.shape), list(vt.stride()), [1, 1, d, tiles.block_n], padding="zero")
    values = [tma_descriptor(q, tiles.block_m, d), tma_descriptor(q, tiles.block_n, d), v_desc, out, lse,
              descale, descale, descale, *q.stride()[:3], *q.stride()[:3], *vt.stride()[:2], 1, 256,
              *out.stride()[:3], 4, 4, 1, 256, 256, 0.1]
    names = _fp8_forward_kernel.arg_names
    args = dict(zip(names, values))
    consts = dict(HEAD_DIM=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, CAUSAL=True, USE_TMA=True)
    signature = {n: ("constexpr" if n in consts else mangle_type(args[n])) for n in names}
    source = ASTSource(_fp8_forward_kernel, signature, {(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    assert compiled.metadata.shared > 0
