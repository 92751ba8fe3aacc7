"""The Triton forward and backward with window, softcap, ALiBi, bias and varlen, under the Triton interpreter,
against the float64 oracle of feature_oracle.py (tolerance: 2 x PyTorch's same-dtype error + slack).

Runs in the child process of test_triton_interpreter.py's driver (TRITON_INTERPRET=1 must be set before triton
is imported); skipped in a plain run. Tiny sizes (interpreter tiles are 16 x 16, so lengths up to 70 meet full,
masked, skipped and ragged tiles); fp16/fp32 only (the interpreter's bf16 dot is broken).
"""

from __future__ import annotations

import os

import pytest
import torch

from feature_oracle import (
    assert_backward_bit_identical,
    assert_varlen_equals_dense,
    check_forward_and_grads,
    feature_attention,
    varlen_feature_attention,
)
from flashmoe_science import flash_attention_science, flash_attention_varlen
from helpers import dtype_id, randn

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="runs in the TRITON_INTERPRET=1 child process of test_triton_interpreter.py")

MASKS = [
    dict(causal=True),
    dict(window=(5, 3)),
    dict(window=(20, -1)),  # left only: tiles before the window are skipped
    dict(window=(-1, 0)),  # = causal
    dict(window=(3, 9), causal=True),  # causal clips the right side
    dict(window=(0, 0)),  # the diagonal only: rows of Lq > Lk see nothing
    dict(softcap=0.8),
    dict(window=(10, 2), softcap=2.0),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("lq,lk", [(37, 53), (53, 37)], ids=str)
def test_dense_masks(mask, lq, lk, dtype):
    if dtype == torch.float32 and lq > lk:
        pytest.skip("one float32 shape per mask keeps the suite short")
    q, k, v = randn(1, 4, lq, 32, dtype=dtype), randn(1, 2, lk, 32, dtype=dtype), randn(1, 2, lk, 32, dtype=dtype)

    def run(q, k, v):
        return flash_attention_science(q, k, v, backend="triton", return_lse=True, **mask)

    def oracle(q, k, v, compute):
        return feature_attention(q, k, v, dtype=compute, **mask)

    check_forward_and_grads(run, oracle, (q, k, v), dtype, ("dq", "dk", "dv"))


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("bias_shape", [(1, 4, 19, 45), (4, 1, 45), (19, 1)], ids=str)
def test_alibi_bias_and_their_gradients(bias_shape, deterministic):
    dtype = torch.float16
    q, k, v = randn(1, 4, 19, 24, dtype=dtype), randn(1, 2, 45, 24, dtype=dtype), randn(1, 2, 45, 24, dtype=dtype)
    bias = randn(*bias_shape, dtype=dtype)
    slopes = torch.rand(4) * 0.5
    kwargs = dict(window=(30, 4), softcap=3.0)

    def run(q, k, v, bias):
        return flash_attention_science(q, k, v, backend="triton", return_lse=True, alibi_slopes=slopes,
                                       attn_bias=bias, deterministic=deterministic, **kwargs)

    def oracle(q, k, v, bias, compute):
        return feature_attention(q, k, v, alibi=slopes, bias=bias, dtype=compute, **kwargs)

    check_forward_and_grads(run, oracle, (q, k, v, bias), dtype, ("dq", "dk", "dv", "dbias"))


# lengths 0, 1, odd and > 4 tiles; a query sequence with no keys and keys with no queries
LENGTHS_Q = [5, 0, 1, 70, 17, 3]
LENGTHS_K = [5, 4, 0, 66, 31, 3]


def _ragged(dtype, head_dim, hq=4, hkv=2):
    cu_q = torch.tensor([0, *torch.tensor(LENGTHS_Q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(LENGTHS_K).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(int(cu_q[-1]), hq, head_dim, dtype=dtype)
    k, v = randn(int(cu_k[-1]), hkv, head_dim, dtype=dtype), randn(int(cu_k[-1]), hkv, head_dim, dtype=dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("head_dim", [64, 59], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(9, 4), softcap=1.5, alibi=True)], ids=str)
def test_varlen(mask, head_dim):
    dtype = torch.float16
    q, k, v, cu_q, cu_k = _ragged(dtype, head_dim)
    mask = dict(mask)
    slopes = torch.rand(len(LENGTHS_Q), 4) if mask.pop("alibi", False) else None

    def run(q, k, v):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), backend="triton",
                                      return_lse=True, alibi_slopes=slopes, **mask)

    def oracle(q, k, v, compute):
        return varlen_feature_attention(q, k, v, cu_q.tolist(), cu_k.tolist(), alibi=slopes, dtype=compute, **mask)

    check_forward_and_grads(run, oracle, (q, k, v), dtype, ("dq", "dk", "dv"))


def test_varlen_output_equals_per_sequence_dense_calls():
    q, k, v, cu_q, cu_k = _ragged(torch.float32, 32)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=True, backend="triton")
    assert_varlen_equals_dense(out, q, k, v, cu_q, cu_k, causal=True, backend="triton")


@pytest.mark.parametrize("call", ["varlen", "window"])
def test_deterministic_backward_is_bit_identical(call):
    if call == "varlen":
        q, k, v, cu_q, cu_k = _ragged(torch.float16, 32)

        def fn(q, k, v):
            return flash_attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=True,
                                          backend="triton", deterministic=True)
    else:
        q, k, v = (randn(1, 2, 61, 32, dtype=torch.float16) for _ in range(3))

        def fn(q, k, v):
            return flash_attention_science(q, k, v, window=(17, 5), backend="triton", deterministic=True)

    assert_backward_bit_identical(fn, (q, k, v))


def test_window_skips_key_tiles():
    """A query tile visits only the key tiles its rows' windows touch: a 16-wide window at L = 64 visits 2 of 4
    tiles per query tile (mask.key_tile_range), so keys outside every window cannot influence the output even if
    they are NaN."""
    q, k, v = (randn(1, 1, 64, 16) for _ in range(3))
    v_poisoned = v.clone()
    v_poisoned[:, :, :16] = float("nan")  # keys 0..15: outside the window of rows 32.. (window (10, 0))
    out = flash_attention_science(q, k, v_poisoned, window=(10, 0), backend="triton")
    ref = flash_attention_science(q, k, v, window=(10, 0), backend="triton")
    assert torch.equal(out[:, :, 32:], ref[:, :, 32:])


def test_a_repeated_packed_inference_call_writes_the_callers_buffer(monkeypatch):
    """An engine's prefill (`engine_attention.prefill_into`) hands its output buffer to the packed call: from the
    signature's second call the kernel writes it (no copy), with the first call's values; q strided as a fused QKV
    projection's split (its fresh output is already in the packed layout: no copy either)."""
    from types import SimpleNamespace

    from flashmoe_science.attention import call
    from flashmoe_science.attention.problem import new_outputs, packed_as_4d
    from flashmoe_science.integrations.engine_attention import LayerOptions, prefill_into

    monkeypatch.setattr(call, "PREPARED_PACKED", {})
    dtype = torch.float16
    _, k, v, cu_q, cu_k = _ragged(dtype, 32)
    qkv = randn(int(cu_q[-1]), 8 * 32, dtype=dtype)
    q = qkv[:, :4 * 32].view(-1, 4, 32)  # row stride 256: not dense
    args = (q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K))
    with torch.inference_mode():
        first = call.packed_forward(*args, causal=True, check_values=False, backend="triton")[0]
        fresh, _ = new_outputs(packed_as_4d(q), SimpleNamespace(varlen=True))
        assert fresh.squeeze(0).permute(1, 0, 2).is_contiguous()  # the packed layout: packed_outputs copies nothing
        buffer = torch.empty_like(first)
        for _ in range(2):
            buffer.zero_()
            out = call.packed_forward(*args, causal=True, check_values=False, backend="triton", out=buffer)[0]
            assert out.data_ptr() == buffer.data_ptr() and torch.equal(buffer, first)
        unaligned = torch.empty(buffer.numel() + 1, dtype=dtype)[1:].view(buffer.shape)
        out = call.packed_forward(*args, causal=True, check_values=False, backend="triton", out=unaligned)[0]
        assert out.data_ptr() != unaligned.data_ptr() and torch.equal(out, first)
        engine = torch.empty_like(first)  # auto on the CPU: the reference, never replayed: a copy every call
        for _ in range(2):
            prefill_into(engine, LayerOptions(32 ** -0.5), *args)
            assert torch.equal(engine, flash_attention_varlen(*args, causal=True, softmax_scale=32 ** -0.5))


def test_a_repeated_packed_training_call_replays_without_checks_or_plan(monkeypatch):
    """A model's layers call with one cu_seqlens pair per batch: from the second call on (gradients recorded) the
    call replays its Recorded (no value check, no plan, fewer torch ops) with the same results; a pair written in
    place is checked and planned again (no stale values), and refused once its values are wrong."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashmoe_science.attention import call, checks

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    def counted(fn, log):
        def wrapper(*args, **kwargs):
            log.append(1)
            return fn(*args, **kwargs)
        return wrapper

    plans, value_checks = [], []
    monkeypatch.setattr(call, "PREPARED_PACKED", {})
    monkeypatch.setattr(call, "plan_attention", counted(call.plan_attention, plans))
    monkeypatch.setattr(checks, "_check_cu_seqlens_values", counted(checks._check_cu_seqlens_values, value_checks))
    dtype = torch.float16
    q, k, v, cu_q, cu_k = _ragged(dtype, 32)

    def run(q, k, v):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q) + 1, max(LENGTHS_K) + 1, causal=True,
                                      backend="triton", return_lse=True)

    def oracle(q, k, v, compute):
        return varlen_feature_attention(q, k, v, cu_q.tolist(), cu_k.tolist(), dtype=compute, causal=True)

    grad = randn(*q.shape, dtype=dtype)
    results, ops = [], []
    for _ in range(3):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        Ops.count = 0
        with Ops():
            out, lse = run(*leaves)
            out.backward(grad)
        ops.append(Ops.count)
        results.append((out.detach(), lse, *(t.grad for t in leaves)))
    assert (len(plans), len(value_checks)) == (1, 1)
    assert ops[1] < ops[0] and ops[2] == ops[1]
    for later in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], later))
    check_forward_and_grads(run, oracle, (q, k, v), dtype, ("dq", "dk", "dv"))  # a replayed call vs float64

    with torch.no_grad():  # one query and one key moved from sequence 3 to sequence 2 (same shape, new values)
        cu_q[3] += 1
        cu_k[3] += 1
    check_forward_and_grads(run, oracle, (q, k, v), dtype, ("dq", "dk", "dv"))
    assert len(value_checks) == 2 and len(plans) == 2
    with torch.no_grad():
        cu_q[2] = cu_q[3] + 1  # decreasing
    with pytest.raises(ValueError, match="non-decreasing"):
        run(q, k, v)
