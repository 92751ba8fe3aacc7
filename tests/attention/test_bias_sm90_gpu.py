"""An additive attn_bias on the Gluon sm_90 kernels, against the float64 oracle of feature_oracle.py (within 2 x
PyTorch's same-dtype error + slack): out, lse and the gradients of q, k, v and, where it requires grad, the bias.
Broadcast shapes read by TMA ((1, H, Lq, Lk), (B, 1, Lq, Lk), (Lq, Lk) with Lk a multiple of 8) and by the
consumers' masked loads (odd Lk, a bias broadcast over the queries), causal or not, GQA, odd query counts.
Run on a Hopper GPU: `PYTHONPATH=src python -m pytest -q -m gpu tests/attention/test_bias_sm90_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from feature_oracle import check_forward_and_grads, feature_attention
from flashmoe_science import flash_attention_science
from flashmoe_science.attention.api import describe_dispatch
from flashmoe_science.attention.hopper.backend import FORWARD_KERNEL
from flashmoe_science.attention.record import recording
from sm90_helpers import hopper_attention_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

B, HQ, HKV = 2, 8, 2


def _randn(*shape, dtype=torch.bfloat16):
    return torch.randn(shape, device="cuda", dtype=torch.float32).to(dtype)


# (bias shape as a function of (Lq, Lk), Lq, Lk, head dim, causal, bias dtype, how the kernel reads it)
CASES = [
    (lambda lq, lk: (1, HQ, lq, lk), 301, 512, 128, True, torch.bfloat16, "tma"),
    (lambda lq, lk: (1, HQ, lq, lk), 301, 512, 128, False, torch.bfloat16, "tma"),
    (lambda lq, lk: (B, 1, lq, lk), 300, 264, 128, False, torch.bfloat16, "tma"),
    (lambda lq, lk: (lq, lk), 257, 512, 64, True, torch.float16, "tma"),
    (lambda lq, lk: (1, HQ, lq, lk), 300, 512, 128, True, torch.float32, "tma"),
    (lambda lq, lk: (lq, lk), 200, 256, 256, True, torch.bfloat16, "tma"),
    (lambda lq, lk: (lq, lk), 300, 517, 128, True, torch.bfloat16, "loads"),
    (lambda lq, lk: (B, HQ, 1, lk), 129, 517, 128, False, torch.bfloat16, "loads"),
    (lambda lq, lk: (1, HQ, lq, lk), 77, 1, 64, False, torch.float32, "loads"),
]


def _ids(case):
    shape, lq, lk, head_dim, causal, dtype, read = case
    return f"{shape(lq, lk)}-L{lq}x{lk}-D{head_dim}-{'causal' if causal else 'full'}-{dtype}-{read}".replace(" ", "")


@pytest.mark.parametrize("bias_grad", [True, False], ids=["bias-grad", "bias-fixed"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_bias_forward_and_gradients(case, bias_grad):
    make_shape, lq, lk, head_dim, causal, bias_dtype, read = case
    hopper_attention_module("fwd_sm90")
    q = _randn(B, HQ, lq, head_dim)
    k, v = _randn(B, HKV, lk, head_dim), _randn(B, HKV, lk, head_dim)
    bias = _randn(*make_shape(lq, lk), dtype=bias_dtype) * 2

    plan = describe_dispatch(q, k, v, causal=causal, attn_bias=bias)
    assert plan.backend == "hopper", plan.reason
    assert ("loaded by TMA" in plan.reason) == (read == "tma"), plan.reason
    # the one-pass backward reads TMA-able 16-bit biases at D=128 (at D=64 the Triton backward wins below L=2048;
    # D=256's two kernels take no bias)
    backward = "hopper" if read == "tma" and head_dim == 128 and bias_dtype != torch.float32 else "triton"
    assert plan.backward_backend == backward, plan.reason

    with recording() as log:
        if bias_grad:
            check_forward_and_grads(
                lambda q, k, v, b: flash_attention_science(q, k, v, causal=causal, attn_bias=b, return_lse=True),
                lambda q, k, v, b, compute: feature_attention(q, k, v, causal=causal, bias=b, dtype=compute),
                (q, k, v, bias), torch.bfloat16, ("dq", "dk", "dv", "dbias"))
        else:
            check_forward_and_grads(
                lambda q, k, v: flash_attention_science(q, k, v, causal=causal, attn_bias=bias, return_lse=True),
                lambda q, k, v, compute: feature_attention(q, k, v, causal=causal, bias=bias, dtype=compute),
                (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))
    assert ("forward", "hopper", FORWARD_KERNEL) in log, log
    assert [entry[1] for entry in log if entry[0] == "backward"] == [backward], log


def test_bias_with_every_score_modifier():
    """Softcap, ALiBi and a window beside a TMA-read bias (the bias added in the units ALiBi leaves the scores
    in)."""
    hopper_attention_module("fwd_sm90")
    q, k, v = _randn(B, HQ, 333, 128), _randn(B, HKV, 400, 128), _randn(B, HKV, 400, 128)
    bias = _randn(1, HQ, 333, 400)
    slopes = torch.rand(HQ, device="cuda") * 0.1
    kwargs = dict(window=(150, 30), softcap=10.0)
    check_forward_and_grads(
        lambda q, k, v: flash_attention_science(q, k, v, alibi_slopes=slopes, attn_bias=bias, return_lse=True,
                                                **kwargs),
        lambda q, k, v, compute: feature_attention(q, k, v, alibi=slopes, bias=bias, dtype=compute, **kwargs),
        (q, k, v), torch.bfloat16, ("dq", "dk", "dv"))
