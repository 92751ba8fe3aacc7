"""Calls whose plan (`describe_dispatch`, `describe_varlen_dispatch`, `plan_decode`, `plan_fp8`) is compared with the
kernels that actually ran (`attention.record`): forward and backward, dense, packed, decode and FP8, with features.
Shared by the CPU test (the reference; the Triton kernels under TRITON_INTERPRET=1) and the GPU test."""

from __future__ import annotations

import torch

from flashmoe_science import flash_attention_decode, flash_attention_science, flash_attention_varlen, quantize_fp8
from flashmoe_science.attention.api import attention_backward_lse, attention_forward_lse, describe_dispatch
from flashmoe_science.attention.decode.checks import check_decode
from flashmoe_science.attention.decode.plan import plan_decode
from flashmoe_science.attention.fp8 import fp8_problem
from flashmoe_science.attention.plan import plan_fp8
from flashmoe_science.attention.record import recording
from flashmoe_science.attention.varlen import describe_varlen_dispatch

# keyword arguments of a dense or packed call: plain, causal, each score modifier, and a bias (dense only)
DENSE_FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window_softcap": {"window": (7, 3), "softcap": 5.0},
    "alibi": {"alibi": True, "causal": True},
    "bias": {"bias": True},
}


def _randn(*shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


def _expected_backward(dispatch) -> list:
    """What a backward through autograd reports: the planned backward kernels, or nothing where autograd
    differentiates the forward itself (the reference)."""
    if dispatch.backend == "reference":
        return []
    return [("backward", dispatch.backward_backend, dispatch.backward_kernel)]


def check_dense(name, device, dtype, backend, length=40, head_dim=64, bias_grad=False):
    kwargs = dict(DENSE_FEATURES[name])
    q, k, v = (_randn(2, 4, length, head_dim, dtype=dtype, device=device, seed=i) for i in range(3))
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = _randn(4, dtype=torch.float32, device=device, seed=4).abs()
    if kwargs.pop("bias", False):
        kwargs["attn_bias"] = _randn(1, 4, length, length, dtype=dtype, device=device, seed=5)
        kwargs["attn_bias"].requires_grad_(bias_grad)
    dispatch = describe_dispatch(q, k, v, backend=backend, **kwargs)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with recording() as forward_log:
        out = flash_attention_science(*leaves, backend=backend, **kwargs)
    assert forward_log == [("forward", dispatch.backend, dispatch.kernel)], (dispatch, forward_log)
    with recording() as backward_log:
        out.backward(_randn(*out.shape, dtype=dtype, device=device, seed=6))
    assert backward_log == _expected_backward(dispatch), (dispatch, backward_log)
    if "attn_bias" in kwargs:
        return
    with torch.no_grad():  # the lse pair: the same plan, and the planned backward from a given out and lse
        out, lse = attention_forward_lse(q, k, v, backend=backend, **kwargs)
        with recording() as lse_log:
            attention_backward_lse(q, k, v, out, lse, torch.ones_like(out), backend=backend, **kwargs)
    assert lse_log == [("backward", dispatch.backward_backend, dispatch.backward_kernel)], (dispatch, lse_log)


def check_packed(name, device, dtype, backend, head_dim=64):
    kwargs = dict(DENSE_FEATURES[name])
    lengths = [5, 0, 33, 17]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = sum(lengths)
    q, k, v = (_randn(total, 4, head_dim, dtype=dtype, device=device, seed=i) for i in range(3))
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = _randn(4, dtype=torch.float32, device=device, seed=4).abs()
    args = (cu, cu, max(lengths), max(lengths))
    dispatch = describe_varlen_dispatch(q, k, v, *args, backend=backend, **kwargs)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with recording() as forward_log:
        out = flash_attention_varlen(*leaves, *args, backend=backend, **kwargs)
    assert forward_log == [("forward", dispatch.backend, dispatch.kernel)], (dispatch, forward_log)
    with recording() as backward_log:
        out.backward(_randn(*out.shape, dtype=dtype, device=device, seed=6))
    assert backward_log == _expected_backward(dispatch), (dispatch, backward_log)


def check_decode_call(device, dtype, backend, paged: bool):
    batch, lq, hq, hkv, d, block = 2, 2, 4, 2, 32, 16
    q = _randn(batch, lq, hq, d, dtype=dtype, device=device, seed=0)
    if paged:
        k_cache = _randn(6, block, hkv, d, dtype=dtype, device=device, seed=1)
        table = torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32, device=device)
    else:
        k_cache, table = _randn(batch, 3 * block, hkv, d, dtype=dtype, device=device, seed=1), None
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.tensor([20, 41], dtype=torch.int32, device=device)
    problem = check_decode(q, k_cache, v_cache, seqlens, table, None, None, None, None, True, None, None, None, None)
    choice = plan_decode(problem, q, "auto", backend)
    with recording() as log:
        flash_attention_decode(q, k_cache, v_cache, seqlens, block_table=table, backend=backend)
    assert log == [("forward", choice.backend, choice.plan.kernel)], (choice, log)


def check_fp8(device, backend, head_dim=64, causal=True):
    q, k, v = (_randn(1, 2, 48, head_dim, dtype=torch.float32, device=device, seed=i) for i in range(3))
    inputs = quantize_fp8(q, k, v, hadamard=head_dim & (head_dim - 1) == 0)  # the rotation needs a power of two
    problem = fp8_problem(*inputs, causal=causal, softmax_scale=None, backend=backend)
    choice = plan_fp8(problem)
    step = choice.plan
    expected = (step.plan.backend, step.plan.forward.kernel) if choice.backend == "dequantised" else (
        choice.backend, step.kernel)
    with recording() as log:
        flash_attention_science(**inputs._asdict(), causal=causal, backend=backend)
    assert log == [("forward", *expected)], (choice, log)
