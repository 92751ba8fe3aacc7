"""`describe_dispatch` (and the decode and FP8 plans) against the kernels that ran, on the GPU: every backend that
the GPU's plan walks (auto: the Gluon sm_90 kernels on Hopper where they take the call; triton: the portable
ones), forward and backward, dense, packed, decode and FP8, with features and head dims the Gluon kernels decline."""

from __future__ import annotations

import pytest
import torch

import dispatch_agreement as agreement

pytestmark = pytest.mark.gpu

BACKENDS = ["auto", "triton"]


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run with `pytest -m gpu` on the H200)")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(agreement.DENSE_FEATURES))
@pytest.mark.parametrize("head_dim,length", [(64, 700), (64, 2100), (128, 300), (256, 200), (80, 300)])
def test_dense(backend, name, head_dim, length):
    agreement.check_dense(name, "cuda", torch.bfloat16, backend, length=length, head_dim=head_dim)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_bias_gradient(backend):
    agreement.check_dense("bias", "cuda", torch.bfloat16, backend, length=300, head_dim=128, bias_grad=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_dense_other_dtypes(backend, dtype):
    agreement.check_dense("causal", "cuda", dtype, backend, length=300, head_dim=128)


def test_deterministic_backward():
    torch.use_deterministic_algorithms(True)
    try:
        agreement.check_dense("plain", "cuda", torch.bfloat16, "auto", length=2100, head_dim=128)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["plain", "causal", "window_softcap", "alibi"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed(backend, name, head_dim):
    agreement.check_packed(name, "cuda", torch.bfloat16, backend, head_dim=head_dim)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode(backend, paged):
    agreement.check_decode_call("cuda", torch.bfloat16, backend, paged)


@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8(head_dim, causal):
    agreement.check_fp8("cuda", "auto", head_dim, causal)
