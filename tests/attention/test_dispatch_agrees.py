"""`describe_dispatch` (and the decode and FP8 plans) against the kernels that ran, on the CPU: the PyTorch
reference here, the Triton kernels (backend="triton") in a child process under TRITON_INTERPRET=1 (which must be
set before triton is first imported: see test_triton_interpreter.py). The GPU cases: test_dispatch_agrees_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

import dispatch_agreement as agreement
from interpreter_driver import interpreter_suite, run_marked_suite

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
# the interpreter's bf16 dot is broken: fp16 there; the reference runs float32
BACKEND, DTYPE = ("triton", torch.float16) if IN_INTERPRETER else ("auto", torch.float32)


@pytest.mark.slow
@interpreter_suite(__file__, timeout=600)
def test_dispatch_agrees_under_the_interpreter_in_subprocess(request):
    if IN_INTERPRETER:
        pytest.skip("already under TRITON_INTERPRET=1: the cases run in this process")
    print(f"TRITON_INTERPRET=1 child: {run_marked_suite(request)}")


@pytest.mark.parametrize("name", list(agreement.DENSE_FEATURES))
def test_dense(name):
    agreement.check_dense(name, "cpu", DTYPE, BACKEND, length=20, head_dim=16)


def test_dense_bias_gradient():
    agreement.check_dense("bias", "cpu", DTYPE, BACKEND, length=20, head_dim=16, bias_grad=True)


@pytest.mark.parametrize("name", ["plain", "causal", "window_softcap", "alibi"])
def test_packed(name):
    agreement.check_packed(name, "cpu", DTYPE, BACKEND, head_dim=16)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode(paged):
    agreement.check_decode_call("cpu", DTYPE, BACKEND, paged)


def test_fp8():
    agreement.check_fp8("cpu", "auto")
