"""Window, softcap, ALiBi, bias and varlen on the GPU (bf16/fp16; whatever `backend="auto"` picks, and Triton),
against the float64 oracle of feature_oracle.py within 2 x PyTorch's same-dtype error (the same formula run in
eager PyTorch in that dtype) + slack: forward, lse and every gradient; deterministic backward bit-identical.
Run on the H200: `PYTHONPATH=src python -m pytest -q -m gpu tests/attention/test_features_gpu.py`."""

from __future__ import annotations

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

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MASKS = [
    dict(causal=True),
    dict(window=(100, 20)),
    dict(window=(256, -1), causal=True),
    dict(softcap=5.0),
    dict(causal=True, softcap=20.0, window=(300, 0)),
]


def _randn(*shape, dtype=torch.bfloat16):
    return torch.randn(shape, device="cuda", dtype=torch.float32).to(dtype)


# every mask at D=128; causal+window at the other head dims (each case compiles its own kernels: kept few)
CASES = [(mask, 128) for mask in MASKS] + [(MASKS[2], d) for d in (64, 256, 96, 59)] + [(MASKS[3], 59)]


@pytest.mark.parametrize("backend", ["auto"])
@pytest.mark.parametrize("mask,head_dim", CASES, ids=str)
def test_dense_masks(mask, head_dim, backend):
    q, k, v = _randn(2, 8, 300, head_dim), _randn(2, 2, 517, head_dim), _randn(2, 2, 517, head_dim)

    def run(q, k, v):
        return flash_attention_science(q, k, v, return_lse=True, backend=backend, **mask)

    def oracle(q, k, v, compute):
        return feature_attention(q, k, v, dtype=compute, **mask)

    check_forward_and_grads(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))


@pytest.mark.parametrize("bias_shape,deterministic", [((2, 8, 300, 517), False), ((8, 1, 517), False),
                                                      ((8, 1, 517), True), ((300, 1), False)], ids=str)
def test_alibi_and_bias(bias_shape, deterministic):
    q, k, v = _randn(2, 8, 300, 128), _randn(2, 2, 517, 128), _randn(2, 2, 517, 128)
    bias = _randn(*bias_shape)
    slopes = torch.rand(2, 8, device="cuda") * 0.1
    kwargs = dict(window=(200, 50), softcap=10.0)

    def run(q, k, v, bias):
        return flash_attention_science(q, k, v, return_lse=True, alibi_slopes=slopes, attn_bias=bias,
                                       deterministic=deterministic, **kwargs)

    def oracle(q, k, v, bias, compute):
        return feature_attention(q, k, v, alibi=slopes, bias=bias, dtype=compute, **kwargs)

    check_forward_and_grads(run, oracle, (q, k, v, bias), torch.bfloat16, ("dq", "dk", "dv", "dbias"))


def _ragged(head_dim, dtype=torch.bfloat16, hq=8, hkv=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths_q = [0, 1, 127, 700, 33, *torch.randint(1, 300, (5,), generator=gen).tolist()]
    lengths_k = [5, 0, 127, 650, 129, *torch.randint(1, 300, (5,), generator=gen).tolist()]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = _randn(int(cu_q[-1]), hq, head_dim, dtype=dtype)
    k, v = _randn(int(cu_k[-1]), hkv, head_dim, dtype=dtype), _randn(int(cu_k[-1]), hkv, head_dim, dtype=dtype)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


@pytest.mark.parametrize("mask,head_dim", [(dict(), 128), (dict(causal=True), 128), (dict(causal=True), 64),
                                           (dict(window=(64, 16), softcap=8.0, alibi=True), 59)], ids=str)
def test_varlen(mask, head_dim):
    q, k, v, cu_q, cu_k, max_q, max_k = _ragged(head_dim)
    mask = dict(mask)
    slopes = torch.rand(cu_q.numel() - 1, 8, device="cuda") * 0.1 if mask.pop("alibi", False) else None

    def run(q, k, v):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, alibi_slopes=slopes, **mask)

    def oracle(q, k, v, compute):
        return varlen_feature_attention(q, k, v, cu_q.tolist(), cu_k.tolist(), alibi=slopes, dtype=compute, **mask)

    check_forward_and_grads(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))


def test_varlen_equals_per_sequence_dense_calls():
    q, k, v, cu_q, cu_k, max_q, max_k = _ragged(128)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="triton")
    assert_varlen_equals_dense(out, q, k, v, cu_q, cu_k, causal=True, backend="triton")


@pytest.mark.parametrize("call", ["varlen", "window"])
def test_deterministic_backward_is_bit_identical(call):
    if call == "varlen":
        q, k, v, cu_q, cu_k, max_q, max_k = _ragged(128)

        def fn(q, k, v):
            return flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, deterministic=True)
    else:
        q, k, v = (_randn(2, 8, 2048, 128) for _ in range(3))

        def fn(q, k, v):
            return flash_attention_science(q, k, v, window=(512, 0), deterministic=True)

    assert_backward_bit_identical(fn, (q, k, v))


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window=(256, 0), softcap=20.0)], ids=str)
def test_lse_functions_run_the_autograd_kernels(kwargs):
    """attention_forward_lse / attention_backward_lse give what autograd gives (same kernels: bit-identical with
    deterministic=True)."""
    from flashmoe_science.attention.api import attention_backward_lse, attention_forward_lse

    q, k, v = _randn(2, 8, 1000, 128), _randn(2, 2, 1000, 128), _randn(2, 2, 1000, 128)
    out, lse = attention_forward_lse(q, k, v, **kwargs)
    grad = _randn(*out.shape)
    grads = attention_backward_lse(q, k, v, out, lse, grad, deterministic=True, **kwargs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attention_science(*leaves, deterministic=True, **kwargs)
    assert torch.equal(out, ref.detach())
    for ours, theirs in zip(grads, torch.autograd.grad(ref, leaves, grad)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("causal,head_dim", [(False, 128), (True, 128), (True, 64), (True, 256)], ids=str)
def test_varlen_repeated_signature_reads_each_calls_lengths(causal, head_dim):
    """Calls of one signature (same totals, sequence count and max lengths) replay a prepared launch: each must
    read its own cu_seqlens (values and work list), also after an in-place write to them, forward and backward."""
    splits = ([100, 300, 0, 200], [300, 1, 99, 200], [5, 295, 300, 0])
    q, k, v = (_randn(600, 8, head_dim) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(splits[0]).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    for lengths in (*splits, splits[0]):
        cu_new = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        for cu_call in (cu_new, cu.copy_(cu_new)):  # a new tensor, then an in-place write to a known one
            with torch.no_grad():
                out = flash_attention_varlen(q, k, v, cu_call, cu_call, 300, 300, causal=causal)
            expected = varlen_feature_attention(q, k, v, cu_new.tolist(), cu_new.tolist(), causal=causal,
                                                dtype=torch.float64)[0]
            assert (out.double() - expected).abs().max().item() < 2e-2

    def run(q, k, v):
        return flash_attention_varlen(q, k, v, cu, cu, 300, 300, causal=causal, return_lse=True)

    def oracle(q, k, v, compute):
        return varlen_feature_attention(q, k, v, cu.tolist(), cu.tolist(), causal=causal, dtype=compute)

    for lengths in splits:  # the backward's prepared launches too: the second and third calls replay
        cu.copy_(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda"))
        check_forward_and_grads(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))
