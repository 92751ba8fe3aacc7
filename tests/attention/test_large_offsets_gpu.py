"""Row offsets past 2**31 elements: a transposed (B, L, H, D) buffer has row stride H·D, so with H=32, D=128 the
rows beyond L = 524288 sit more than 2**31 elements from their head's start. Every kernel (sm_90 and Triton
forward, the backward's passes) must address them in 64 bits (tiles: needs_64bit_rows). The contiguous copy of the
same inputs stays within 32 bits and runs the same arithmetic, so results must match it bit for bit (except dQ of
the default backend's backward on Hopper: the sm_90 one-pass backward sums it with reduce-adds in arrival order, so
it matches within a rounding of bf16)."""

from __future__ import annotations

import pytest
import torch

from flashmoe_science.attention.api import flash_attention_science
from flashmoe_science.attention.layout import needs_64bit_rows

pytestmark = pytest.mark.gpu

HEADS, HEAD_DIM = 32, 128
LONG = 524288 + 130  # (LONG - 1) · HEADS · HEAD_DIM > 2**31; a ragged last tile
SHORT = 200


def _transposed(length: int, requires_grad: bool) -> torch.Tensor:
    t = torch.randn(1, length, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return t.requires_grad_(requires_grad)


def _run(q, k, v, grad, backend, causal):
    out = flash_attention_science(q, k, v, causal=causal, backend=backend)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("long_side", ["queries", "keys"])
def test_rows_past_2_31_elements_match_the_contiguous_call(long_side, backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    lq, lk = (LONG, SHORT) if long_side == "queries" else (SHORT, LONG)
    causal = long_side == "queries"  # bottom-right causal: the short key side is fully visible to the last rows
    q, k, v = _transposed(lq, True), _transposed(lk, True), _transposed(lk, True)
    grad = torch.randn(1, lq, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    assert needs_64bit_rows(q if long_side == "queries" else k)

    got = _run(q, k, v, grad, backend, causal)
    flat = [t.detach().contiguous().requires_grad_(True) for t in (q, k, v)]
    assert not needs_64bit_rows(*flat)
    want = _run(*flat, grad.contiguous(), backend, causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        if name == "dq" and backend == "auto":
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-3 * b.abs().max().item())
        else:
            assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max().item()}"
