"""The Gluon sm_90 backward (hopper/bwd_sm90.py; bwd_sm90_hdim256.py at head dims 129..256) on a Hopper GPU,
launched directly.

Run: `PYTHONPATH=src python -m pytest tests/attention/test_backward_sm90_gpu.py -q -m gpu`.

The forward runs through the library (its out and lse are what the backward reads); the backward is
`bwd_sm90.attention_backward_sm90`, compared with the float64 oracle within 2 x PyTorch's same-dtype error plus
slack (grad_helpers.py). Gradients are NaN-poisoned before the launch so that any element the kernels fail to write
shows up; dq_accum is poisoned too (the preprocess must zero it).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.hopper.tiles import SM90_BACKWARD_MIN_LEN_D64
from flashmoe_science.attention.layout import tma_compatible
from flashmoe_science.attention.tiles import padded_head_dim
from grad_helpers import assert_grads_close
from sm90_helpers import hopper_attention_module

pytestmark = pytest.mark.gpu

CUDA = "cuda"


def _inputs(b, hq, hkv, lq, lk, d, dtype, transposed=False):
    if transposed:  # (B, L, H, D) storage seen as (B, H, L, D)
        make = lambda h, length: torch.randn(b, length, h, d, device=CUDA).to(dtype).transpose(1, 2)  # noqa: E731
    else:
        make = lambda h, length: torch.randn(b, h, length, d, device=CUDA).to(dtype)  # noqa: E731
    return make(hq, lq), make(hkv, lk), make(hkv, lk), make(hq, lq)


def sm90_grads(q, k, v, grad_out, causal, softmax_scale=None, num_stages=None, deterministic=False):
    """(dq, dk, dv) from the library's forward and the sm_90 backward, every output NaN-poisoned first."""
    bwd_sm90 = hopper_attention_module("bwd_sm90")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    with torch.no_grad():
        out, lse = flash_attention_science(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    assert tma_compatible(q, k, v, grad_out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    delta = torch.full_like(lse, float("nan"))
    dq_accum = torch.full((*q.shape[:3], padded_head_dim(q.shape[-1])), float("nan"), device=CUDA)
    kwargs = {"deterministic": deterministic}
    if num_stages is not None:
        kwargs["num_stages"] = num_stages
    bwd_sm90.attention_backward_sm90(q, k, v, out, lse.contiguous(), grad_out, delta, dq, dk, dv, causal, scale,
                                     dq_accum, **kwargs)
    torch.cuda.synchronize()
    return dq, dk, dv


def _check(b, hq, hkv, lq, lk, d, causal, dtype=torch.bfloat16, **kwargs):
    q, k, v, grad_out = _inputs(b, hq, hkv, lq, lk, d, dtype, kwargs.pop("transposed", False))
    grads = sm90_grads(q, k, v, grad_out, causal, **kwargs)
    return assert_grads_close(grads, q, k, v, grad_out, causal, kwargs.get("softmax_scale"))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("length", [1, 17, 127, 128, 129, 1000])
def test_lengths(length, causal, d):
    _check(2, 4, 4, length, length, d, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 1)])
def test_gqa(hq, hkv, causal, d):
    _check(2, hq, hkv, 300, 300, d, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lq,lk", [(100, 333), (333, 100), (1, 700), (700, 1), (64, 257), (257, 64)])
def test_unequal_lengths(lq, lk, causal, d):
    # causal with Lq > Lk: the first Lq - Lk query rows see no key (lse = -inf): zero dQ, no NaN anywhere
    _check(1, 4, 2, lq, lk, d, causal)


def test_dead_rows_have_zero_grads():
    q, k, v, grad_out = _inputs(1, 2, 2, 300, 40, 128, torch.bfloat16)
    dq, dk, dv = sm90_grads(q, k, v, grad_out, causal=True)
    assert dq[:, :, :260].abs().max().item() == 0.0  # rows 0..259 see no key (j <= i + 40 - 300)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [80, 96, 48, 160, 192])
def test_dtypes_and_padded_head_dims(d, dtype):
    _check(2, 4, 2, 200, 200, d, True, dtype=dtype)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_transposed_layout_and_scale(causal, d):
    _check(2, 8, 2, 513, 513, d, causal, transposed=True, softmax_scale=0.3)


@pytest.mark.parametrize("d,num_stages", [(128, 1), (64, 1), (64, 3), (256, 1)])
def test_ring_depths(d, num_stages):
    _check(1, 4, 2, 700, 700, d, True, num_stages=num_stages)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_repeated_runs_agree(causal, d):
    # dK and dV are summed in registers in a fixed order: bit-identical; dQ's additions may arrive in any order
    q, k, v, grad_out = _inputs(2, 4, 2, 777, 777, d, torch.bfloat16)
    first = sm90_grads(q, k, v, grad_out, causal)
    second = sm90_grads(q, k, v, grad_out, causal)
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    torch.testing.assert_close(first[0], second[0], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 4, 1000, 1000), (1, 8, 2, 333, 700), (1, 4, 1, 700, 129),
                                   (1, 2, 2, 4096, 4096)], ids=["odd", "gqa-cross", "mqa-cross", "long"])
def test_deterministic_one_pass(shape, causal, d):
    """deterministic=True: the one pass with its dQ reduce-adds in key-block order (each CTA waits for the key
    blocks before it that see the query tile), right against float64, every gradient bit-identical run to run."""
    b, hq, hkv, lq, lk = shape
    q, k, v, grad_out = _inputs(b, hq, hkv, lq, lk, d, torch.bfloat16)
    first = sm90_grads(q, k, v, grad_out, causal, deterministic=True)
    assert_grads_close(first, q, k, v, grad_out, causal)
    for _ in range(2):
        again = sm90_grads(q, k, v, grad_out, causal, deterministic=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("d", [128, 256])
def test_long_rows(d):
    _check(1, 2, 1, 4096, 4096, d, True)


def test_unsupported_head_dims_raise():
    bwd_sm90 = hopper_attention_module("bwd_sm90")
    for d in (16, 32, 257):
        with pytest.raises(ValueError, match="head dims"):
            bwd_sm90.check_supported(torch.empty(1, 1, 8, d, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16/fp16"):
        bwd_sm90.check_supported(torch.empty(1, 1, 8, 64))


def _prepared_launches(plan) -> list:
    """The prepared launch sequences a BackwardPlan holds (autograd.BackwardPlan.launches without its marks)."""
    from flashmoe_science.prepared_cache import SEEN_ONCE

    return [launch for launch in plan.launches.values() if launch is not None and launch is not SEEN_ONCE]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("transposed", [False, True], ids=["bhld", "blhd"])
def test_prepared_backward_through_autograd(causal, d, transposed):
    """A training loop's calls: one BackwardPlan per forward signature (autograd.BACKWARD_PLANS) and, from the
    second call on, the call replayed from call.PREPARED (call.Recorded: the prepared forward launch and that
    BackwardPlan). The plan's grad_out layout is marked on the first backward and prepared on the second
    (bwd_sm90.PreparedBackward: frozen launches, new tensors), which the third reuses: on fresh inputs every call's
    output is the inference call's, bit for bit, its gradients are right, and its dK/dV are bit-identical to the
    direct launch's."""
    from flashmoe_science.attention import autograd, call

    hopper_attention_module("bwd_sm90")
    autograd.BACKWARD_PLANS.clear()
    call.PREPARED.clear()
    length = SM90_BACKWARD_MIN_LEN_D64 + 77  # the sm_90 backward runs short rows at D=128 only (tiles)
    for _ in range(3):
        q, k, v, grad_out = _inputs(1, 4, 2, length, length, d, torch.bfloat16, transposed)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flash_attention_science(*leaves, causal=causal)
        grads = torch.autograd.grad(out, leaves, grad_out)
        assert len(autograd.BACKWARD_PLANS) == 1  # one entry per signature
        recorded = [entry for entry in call.PREPARED.values() if isinstance(entry, call.Recorded)]
        assert len(recorded) == 1 and recorded[0].backward is next(iter(autograd.BACKWARD_PLANS.values()))
        with torch.no_grad():
            assert torch.equal(out, flash_attention_science(q, k, v, causal=causal))
        assert_grads_close(grads, q, k, v, grad_out, causal, None)
        direct = sm90_grads(q, k, v, grad_out, causal)
        assert torch.equal(grads[1], direct[1]) and torch.equal(grads[2], direct[2])
    (plan,) = autograd.BACKWARD_PLANS.values()
    assert len(_prepared_launches(plan)) == 1


def _repeated_backward(d, runs, expected_kernel, **flags):
    """Inputs past the sm_90 backward's length floor, one forward, then its backward ``runs`` times on the same
    graph, each checked to run ``expected_kernel`` (the recorded (pass, backend, kernel)). Returns the inputs and
    every run's (dq, dk, dv)."""
    from flashmoe_science.attention.record import recording

    q, k, v, grad_out = _inputs(2, 4, 4, SM90_BACKWARD_MIN_LEN_D64 + 131, SM90_BACKWARD_MIN_LEN_D64 + 131, d,
                                torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention_science(*leaves, **flags)
    grads = []
    for _ in range(runs):
        with recording() as log:
            grads.append(torch.autograd.grad(out, leaves, grad_out, retain_graph=True))
        assert log == [("backward", *expected_kernel)]
    return (q, k, v, grad_out), grads


@pytest.mark.parametrize("d", [64, 128])
# deterministic with a plain causal mask runs the Triton two passes (test_deterministic_plain_causal_stays_on_triton)
@pytest.mark.parametrize("deterministic,causal", [(False, False), (False, True), (True, False)],
                         ids=["default-full", "default-causal", "deterministic-full"])
def test_repeated_backward_through_the_prepared_plan_is_bit_identical(deterministic, causal, d):
    """The same graph's backward, run again and again (as a benchmark times it): the first runs the launches as
    Triton binds them, the second prepares them, the rest repeat the prepared sequence. dK and dV are bit-identical
    every time, dQ within its reduce-add order (deterministic=True: bit-identical too, its counters allocated and
    zeroed per call by the prepared sequence), and the gradients match float64."""
    from flashmoe_science.attention import autograd

    hopper_attention_module("bwd_sm90")
    autograd.BACKWARD_PLANS.clear()
    (q, k, v, grad_out), runs = _repeated_backward(d, 4, ("hopper", "hopper.bwd_sm90.attention_backward_sm90"),
                                                   causal=causal, deterministic=deterministic)
    (plan,) = autograd.BACKWARD_PLANS.values()
    assert len(_prepared_launches(plan)) == 1 and plan.step.deterministic == deterministic
    assert_grads_close(runs[-1], q, k, v, grad_out, causal, None)
    for grads in runs[1:]:
        assert torch.equal(grads[1], runs[0][1]) and torch.equal(grads[2], runs[0][2])
        if deterministic:
            assert torch.equal(grads[0], runs[0][0])
        else:
            torch.testing.assert_close(grads[0], runs[0][0], rtol=1e-2, atol=1e-3)


def test_prepared_backward_keys_on_strides():
    """A call whose strides differ does not reuse another signature's plan or launches."""
    from flashmoe_science.attention import autograd

    hopper_attention_module("bwd_sm90")
    autograd.BACKWARD_PLANS.clear()
    for transposed in (False, True):
        q, k, v, grad_out = _inputs(1, 2, 2, 300, 300, 128, torch.bfloat16, transposed)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        grads = torch.autograd.grad(flash_attention_science(*leaves), leaves, grad_out)
        assert_grads_close(grads, q, k, v, grad_out, False, None)
    assert len(autograd.BACKWARD_PLANS) == 2


@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_plain_causal_stays_on_triton(d):
    """deterministic=True under a plain causal mask: the sm_90 backend refuses (its ordered dQ adds trail block 0's
    walk over every query tile) and the Triton two passes run, bit-identical in every gradient and right against
    float64."""
    (q, k, v, grad_out), runs = _repeated_backward(d, 2, ("triton", "triton.bwd.attention_backward"), causal=True,
                                                   deterministic=True)
    assert_grads_close(runs[0], q, k, v, grad_out, True, None)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
