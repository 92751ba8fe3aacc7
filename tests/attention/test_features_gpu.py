"""Window, softcap, ALiBi, bias and varlen on the GPU (bf16/fp16; whatever `backend="auto"` picks, and Triton),
against the float64 oracle of feature_oracle.py within 2 x PyTorch's same-dtype error (the same formula run in
eager PyTorch in that dtype) + slack: forward, lse and every gradient; deterministic backward bit-identical.
Run on the H200: `PYTHONPATH=src python -m pytest -q -m gpu tests/attention/test_features_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from feature_oracle import GRAD_SLACK, assert_within_rule, feature_attention, varlen_feature_attention
from flashmoe_science import flash_attention_science, flash_attention_varlen
from helpers import LSE_SLACK

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


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _check(run, oracle, inputs, dtype, names):
    ours_leaves = _leaves(*inputs)
    out, lse = run(*ours_leaves)
    grad = _randn(*out.shape, dtype=dtype)
    ours_grads = torch.autograd.grad(out, ours_leaves, grad)
    ref_leaves = _leaves(*(t.double() for t in inputs))
    ref, ref_lse = oracle(*ref_leaves, torch.float64)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad.double())
    same_leaves = _leaves(*inputs)
    same, same_lse = oracle(*same_leaves, dtype)
    same_grads = torch.autograd.grad(same, same_leaves, grad)
    assert_within_rule("out", out.cpu(), ref.cpu(), same.cpu(), dtype)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf rows differ"
    finite = torch.isfinite(ref_lse)
    assert_within_rule("lse", lse[finite].cpu(), ref_lse[finite].cpu(), same_lse.float()[finite].cpu(), dtype,
                       LSE_SLACK, relative=True)
    for name, g, r, s in zip(names, ours_grads, ref_grads, same_grads):
        assert_within_rule(name, g.cpu(), r.cpu(), s.cpu(), dtype, GRAD_SLACK, relative=True)


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

    _check(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))


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

    _check(run, oracle, (q, k, v, bias), torch.bfloat16, ("dq", "dk", "dv", "dbias"))


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

    _check(run, oracle, (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))


def test_varlen_equals_per_sequence_dense_calls():
    q, k, v, cu_q, cu_k, max_q, max_k = _ragged(128)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="triton")
    for b in range(cu_q.numel() - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if qs.stop > qs.start and ks.stop > ks.start:
            dense = flash_attention_science(q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
                                            causal=True, backend="triton")
            assert torch.equal(out[qs], dense.transpose(0, 1)), b


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

    grad, runs = None, []
    for _ in range(2):
        leaves = _leaves(q, k, v)
        out = fn(*leaves)
        grad = _randn(*out.shape) if grad is None else grad
        runs.append(torch.autograd.grad(out, leaves, grad))
    for first, second in zip(*runs):
        assert torch.equal(first, second)
