"""Attention backward on the CPU: the reference under float64 gradcheck, the Triton backward under the interpreter.

The Triton part needs `TRITON_INTERPRET=1` set before the process starts: a plain `pytest` run gets it through
the child process of test_triton_interpreter.py's driver; sizes stay tiny (L <= 64, D <= 64) and the
interpreter tiles are 16 x 16, so every case still meets diagonal, full and ragged tiles. Both backward paths run:
"fused" (deterministic=False: dQ summed with atomics in the dK/dV kernel) and "two-pass" (deterministic=True).
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.tiles import (
    INTERPRETER_TRAITS,
    AttentionTiles,
    BackwardTiles,
    backward_tiles,
    padded_head_dim,
)
from grad_helpers import assert_grads_close, oracle_grads

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1",
    reason="runs in the TRITON_INTERPRET=1 child process of test_triton_interpreter.py",
)
PATHS = pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "two-pass"])


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


# ---------------------------------------------------------------------------------------------------------------
# The reference path: float64 gradcheck (the CPU path of the public API is differentiable with the same semantics)


@pytest.mark.parametrize(
    "hq,hkv,lq,lk,causal",
    [(1, 1, 5, 5, False), (2, 2, 4, 7, True), (2, 1, 7, 4, True), (4, 2, 6, 6, True), (2, 1, 1, 5, True)],
)
def test_reference_gradcheck_float64(hq, hkv, lq, lk, causal):
    q = torch.randn(1, hq, lq, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, hkv, lk, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, hkv, lk, 16, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v):
        return flash_attention_science(q, k, v, causal=causal, softmax_scale=0.3, backend="reference")

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_reference_lse_gradcheck_float64():
    q, k, v = (torch.randn(1, 2, 5, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return flash_attention_science(q, k, v, causal=True, return_lse=True, backend="reference")

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_reference_dead_rows_have_zero_gradients():
    # causal with Lq > Lk: the first Lq - Lk queries see no key
    q, k, v = _leaves(*(torch.randn(1, 2, n, 16, dtype=torch.float64) for n in (9, 4, 4)))
    out = flash_attention_science(q, k, v, causal=True, backend="reference")
    out.backward(torch.randn_like(out))
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    assert torch.equal(q.grad[:, :, :5], torch.zeros_like(q.grad[:, :, :5]))


# ---------------------------------------------------------------------------------------------------------------
# The Triton backward under the interpreter vs float64


def _triton_grads(q, k, v, grad_out, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attention_science(q, k, v, backend="triton", **kwargs)
    return torch.autograd.grad(out, (q, k, v), grad_out)


CASES = [  # batch, q heads, kv heads, Lq, Lk, head dim, causal
    (1, 1, 1, 1, 1, 16, False),
    (1, 1, 1, 1, 1, 16, True),
    (2, 2, 2, 17, 17, 16, True),
    (1, 2, 2, 33, 33, 32, False),
    (1, 2, 2, 64, 64, 64, True),
    (1, 4, 1, 31, 48, 40, True),  # MQA, Lq < Lk, padded head dim
    (1, 4, 2, 48, 31, 24, True),  # GQA, Lq > Lk: 17 query rows see no key
    (1, 2, 1, 1, 40, 16, True),  # one query sees every key
    (1, 2, 1, 40, 1, 16, True),  # one key, seen only by the last query
    (2, 3, 3, 20, 45, 48, False),
]


@needs_interpreter
@PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("b,hq,hkv,lq,lk,d,causal", CASES)
def test_triton_backward_matches_float64(b, hq, hkv, lq, lk, d, causal, dtype, deterministic):
    q = torch.randn(b, hq, lq, d).to(dtype)
    k = torch.randn(b, hkv, lk, d).to(dtype)
    v = torch.randn(b, hkv, lk, d).to(dtype)
    grad_out = torch.randn(b, hq, lq, d).to(dtype)
    grads = _triton_grads(q, k, v, grad_out, causal=causal, deterministic=deterministic)
    assert_grads_close(grads, q, k, v, grad_out, causal)


@needs_interpreter
def test_triton_backward_custom_scale_and_strided_inputs():
    # (B, L, H, D) buffers seen as (B, H, L, D): no copies; gradients come back with the inputs' strides
    b, lq, lk, hq, hkv, d = 2, 23, 37, 4, 2, 32
    q = torch.randn(b, lq, hq, d).transpose(1, 2)
    k = torch.randn(b, lk, hkv, d).transpose(1, 2)
    v = torch.randn(b, lk, hkv, 2 * d)[..., d:].transpose(1, 2)  # a slice: not dense, gradient comes back dense
    grad_out = torch.randn(b, lq, hq, d).transpose(1, 2)
    grads = _triton_grads(q, k, v, grad_out, causal=True, softmax_scale=0.37)
    assert grads[0].stride() == q.stride() and grads[1].stride() == k.stride()
    assert_grads_close(grads, q, k, v, grad_out, True, 0.37)


@needs_interpreter
@PATHS
def test_triton_backward_dead_rows_are_exact_zeros(deterministic):
    # causal with Lq - Lk = 31: rows 0..30 see no key (lse = -inf); on the fused path no key tile visits them
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 1, 9, 16), torch.randn(1, 1, 9, 16)
    grad_out = torch.randn(1, 2, 40, 16)
    dq, dk, dv = _triton_grads(q, k, v, grad_out, causal=True, deterministic=deterministic)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.equal(dq[:, :, :31], torch.zeros_like(dq[:, :, :31]))


@needs_interpreter
@pytest.mark.parametrize("wanted", ["q", "k", "v", "kv", "qv"])
def test_triton_backward_any_subset(wanted):
    q, k, v = torch.randn(1, 2, 19, 16), torch.randn(1, 1, 26, 16), torch.randn(1, 1, 26, 16)
    leaves = {name: t.clone().requires_grad_(name in wanted) for name, t in zip("qkv", (q, k, v))}
    out = flash_attention_science(leaves["q"], leaves["k"], leaves["v"], causal=True, backend="triton")
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref = oracle_grads(q, k, v, grad_out, True)
    for i, name in enumerate("qkv"):
        if name in wanted:
            torch.testing.assert_close(leaves[name].grad.double(), ref[i], atol=1e-5, rtol=1e-4)
        else:
            assert leaves[name].grad is None


@needs_interpreter
def test_triton_backward_through_user_shapes_and_sum():
    # 3-D (H, L, D) inputs, and out.sum(): a stride-0 incoming gradient
    q, k, v = _leaves(torch.randn(2, 18, 16), torch.randn(2, 21, 16), torch.randn(2, 21, 16))
    flash_attention_science(q, k, v, causal=True, backend="triton").sum().backward()
    ref = oracle_grads(q[None], k[None], v[None], torch.ones(1, 2, 18, 16), True)
    for t, r in zip((q, k, v), ref):
        torch.testing.assert_close(t.grad.double(), r[0], atol=1e-5, rtol=1e-4)


@needs_interpreter
def test_triton_backward_is_deterministic():
    q, k, v = torch.randn(1, 4, 33, 32), torch.randn(1, 2, 33, 32), torch.randn(1, 2, 33, 32)
    grad_out = torch.randn(1, 4, 33, 32)
    first = _triton_grads(q, k, v, grad_out, causal=True, deterministic=True)
    second = _triton_grads(q, k, v, grad_out, causal=True, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---------------------------------------------------------------------------------------------------------------
# Which path runs, and the kernel entry point directly


def _recorded_backward_calls(monkeypatch):
    """Record each attention_backward call's dq_accum (None: the two-pass path) and gradient arguments."""
    from flashmoe_science.attention.triton import bwd as triton_bwd

    calls = []
    launch = triton_bwd.attention_backward

    def recording(*args, **kwargs):
        given = inspect.signature(launch).bind(*args, **kwargs).arguments
        calls.append({"fused": given.get("dq_accum") is not None,
                      **{name: given[name] is not None for name in ("dq", "dk", "dv")}})
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_bwd, "attention_backward", recording)
    return calls


@needs_interpreter
@pytest.mark.parametrize("wanted,deterministic,fused", [
    ("qkv", False, True), ("qkv", True, False), ("kv", False, False), ("q", False, False), ("qk", False, True),
])
def test_triton_backward_path_choice(monkeypatch, wanted, deterministic, fused):
    # fused only when dQ and dK/dV are both wanted and determinism is not asked for
    calls = _recorded_backward_calls(monkeypatch)
    leaves = [torch.randn(1, 2, 17, 16).requires_grad_(name in wanted) for name in "qkv"]
    flash_attention_science(*leaves, causal=True, backend="triton", deterministic=deterministic).sum().backward()
    assert calls == [{"fused": fused, "dq": "q" in wanted, "dk": "k" in wanted or "v" in wanted,
                      "dv": "k" in wanted or "v" in wanted}]


@needs_interpreter
def test_triton_backward_torch_deterministic_mode_picks_two_passes(monkeypatch):
    calls = _recorded_backward_calls(monkeypatch)
    leaves = [torch.randn(1, 2, 17, 16).requires_grad_() for _ in range(3)]
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        flash_attention_science(*leaves, backend="triton").sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert [call["fused"] for call in calls] == [False]


def _poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hq,hkv,lq,lk,d", [(4, 2, 37, 37, 32), (2, 1, 45, 20, 40), (3, 3, 20, 51, 16)],
                         ids=lambda x: str(x))
def test_triton_backward_paths_write_every_element(hq, hkv, lq, lk, d, causal):
    # The launcher directly, both paths, NaN-poisoned gradients and workspace: every element must be written (the
    # fused path zeroes its workspace itself), and both paths must match float64. A 64-row fused tile puts the
    # query rows on the dQ product's M side (the interpreter's 16-row tiles put the head dim there).
    from flashmoe_science.attention.triton.bwd import attention_backward

    b, scale = 2, 0.3
    q, grad_out = torch.randn(b, hq, lq, d), torch.randn(b, hq, lq, d)
    k, v = torch.randn(b, hkv, lk, d), torch.randn(b, hkv, lk, d)
    out, lse = flash_attention_science(q, k, v, causal=causal, softmax_scale=scale, backend="triton", return_lse=True)
    default = backward_tiles(d, q.dtype, causal, INTERPRETER_TRAITS)
    wide_rows = BackwardTiles(default.dkdv, default.dq, AttentionTiles(64, 16, 1, 1))
    results = {}
    for name, tiles, fused in (("two-pass", default, False), ("fused", default, True), ("fused-64", wide_rows, True)):
        dq, dk, dv = _poisoned_like(q), _poisoned_like(k), _poisoned_like(v)
        dq_accum = torch.full((b, hq, lq, padded_head_dim(d)), float("nan")) if fused else None
        attention_backward(q, k, v, out, lse, grad_out, _poisoned_like(lse), dq, dk, dv, causal, scale, tiles,
                           dq_accum)
        assert_grads_close((dq, dk, dv), q, k, v, grad_out, causal, scale)
        results[name] = (dq, dk, dv)
    # dK and dV come from the same kernel and loop order on both paths with the same tiles: bit-identical
    assert torch.equal(results["fused"][1], results["two-pass"][1])
    assert torch.equal(results["fused"][2], results["two-pass"][2])
    torch.testing.assert_close(results["fused"][0], results["two-pass"][0], atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_triton_double_backward_raises():
    q, k, v = _leaves(torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16))
    out = flash_attention_science(q, k, v, backend="triton")
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()
