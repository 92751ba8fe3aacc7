"""The custom ops' Triton paths (attention kernels, expert sort and GEMMs with their residuals, routing) under
TRITON_INTERPRET=1, compiled with aot_eager, against the reference backend; and the layers' rotary kernel
(nn/triton_rotary.py). Run by test_custom_ops.py."""

import os

import pytest
import torch

import flashmoe_science as fs

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def test_attention_triton_through_ops():
    q = torch.randn(1, 2, 20, 16, requires_grad=True)
    k, v = torch.randn(1, 1, 24, 16, requires_grad=True), torch.randn(1, 1, 24, 16, requires_grad=True)
    compiled = torch.compile(lambda q, k, v: fs.flash_attention_science(q, k, v, causal=True, backend="triton"),
                             backend="aot_eager", fullgraph=True)
    got, want = compiled(q, k, v), fs.flash_attention_science(q, k, v, causal=True, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    grad_out = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), grad_out), torch.autograd.grad(want, (q, k, v), grad_out)):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("num_tokens", [0, 12])
def test_moe_triton_through_ops(num_tokens):
    x = torch.randn(num_tokens, 32, requires_grad=True)
    w1 = (0.1 * torch.randn(4, 64, 32)).requires_grad_()
    w2 = (0.1 * torch.randn(4, 32, 32)).requires_grad_()
    logits = torch.randn(num_tokens, 4, requires_grad=True)
    compiled = torch.compile(lambda *a: fs.fused_moe(*a, 2, backend="triton"), backend="aot_eager", fullgraph=True)
    got, want = compiled(x, w1, w2, logits), fs.fused_moe(x, w1, w2, logits, 2, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    if num_tokens == 0:  # the eager reference's empty output carries no graph
        return
    grad_out = torch.randn_like(want)
    inputs = (x, w1, w2, logits)
    for g, w in zip(torch.autograd.grad(got, inputs, grad_out), torch.autograd.grad(want, inputs, grad_out)):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("per_row_positions", [False, True])
def test_rotary_kernel_matches_torch(per_row_positions):
    from flashmoe_science.nn.attention import rotary_cos_sin
    from flashmoe_science.nn.triton_rotary import RotaryTriton

    x = torch.randn(2, 9, 12, 3, 20).select(-2, 1)  # (B, L, H, D) with a row stride that is not H*D
    x.requires_grad_()
    positions = torch.stack([torch.arange(9), torch.arange(4, 13)]) if per_row_positions else torch.arange(9)
    cos, sin = rotary_cos_sin(positions, 20, 10000.0, torch.float32)
    want = torch.cat((x[..., :10] * cos.unsqueeze(-2) - x[..., 10:] * sin.unsqueeze(-2),
                      x[..., 10:] * cos.unsqueeze(-2) + x[..., :10] * sin.unsqueeze(-2)), dim=-1)
    got = RotaryTriton.apply(x, cos.contiguous(), sin.contiguous())
    torch.testing.assert_close(got, want.expand_as(got), atol=1e-6, rtol=1e-6)
    grad_out = torch.randn_like(got)
    (got_dx,) = torch.autograd.grad(got, x, grad_out)
    (want_dx,) = torch.autograd.grad(want, x, grad_out)
    torch.testing.assert_close(got_dx, want_dx, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_tokens", [0, 7, 40])
def test_moe_triton_residuals_match_the_fake(num_tokens):
    from flashmoe_science.moe import ops as moe_ops

    x = torch.randn(num_tokens, 32, requires_grad=True)
    w1 = (0.1 * torch.randn(4, 64, 32)).requires_grad_()
    w2 = (0.1 * torch.randn(4, 32, 32)).requires_grad_()
    weights, ids = fs.moe_route(torch.randn(num_tokens, 4), 2)
    torch.library.opcheck(moe_ops.fused_experts_forward, (x, w1, w2, weights.requires_grad_(), ids, "triton"),
                          test_utils=("test_schema", "test_faketensor"))
