"""nn.Attention on the GPU (H200: `pytest -m gpu tests/nn`): the Triton rotary kernel and the whole layer in bf16,
error vs float64 within twice that of the same layer computed with PyTorch ops (SDPA, rotary in torch)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from flashmoe_science.nn import Attention
from flashmoe_science.nn.attention import apply_rotary, apply_rotary_torch, rotary_cos_sin

pytestmark = pytest.mark.gpu


def test_rotary_kernel_in_bf16():
    x64 = torch.randn(3, 257, 8, 128, device="cuda", dtype=torch.float64, requires_grad=True)
    positions = torch.arange(257, device="cuda")
    grad_out = torch.randn_like(x64)
    cos64, sin64 = rotary_cos_sin(positions, 128, 1e6, torch.float64)
    want = apply_rotary_torch(x64, cos64, sin64)
    (want_dx,) = torch.autograd.grad(want, x64, grad_out)
    x16 = x64.detach().to(torch.bfloat16).requires_grad_()
    cos16, sin16 = rotary_cos_sin(positions, 128, 1e6, torch.bfloat16)
    outs = []
    for rotary in (apply_rotary, apply_rotary_torch):
        out = rotary(x16, cos16, sin16)
        (dx,) = torch.autograd.grad(out, x16, grad_out.to(torch.bfloat16))
        outs.append(((out.double() - want).abs().max().item(), (dx.double() - want_dx).abs().max().item()))
    (ours_out, ours_dx), (torch_out, torch_dx) = outs
    assert ours_out <= 2 * torch_out + 1e-3 and ours_dx <= 2 * torch_dx + 1e-3


class TorchAttention(Attention):
    def rotate(self, x, cos, sin):
        return apply_rotary_torch(x, cos, sin)

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_attention_layer_in_bf16():
    layer64 = Attention(512, 8, 2, qk_norm=True).cuda().double()
    x = torch.randn(2, 1000, 512, device="cuda", dtype=torch.float64)
    want = layer64(x)
    ours = copy.deepcopy(layer64).to(torch.bfloat16)
    baseline = TorchAttention(512, 8, 2, qk_norm=True).cuda().to(torch.bfloat16)
    baseline.load_state_dict(ours.state_dict())
    with torch.no_grad():
        ours_error = (ours(x.to(torch.bfloat16)).double() - want).abs().max().item()
        torch_error = (baseline(x.to(torch.bfloat16)).double() - want).abs().max().item()
    assert ours_error <= 2 * torch_error + 1e-3
