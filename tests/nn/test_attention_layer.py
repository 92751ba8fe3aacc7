"""nn.Attention, SwiGLU and TransformerBlock on the CPU: the layer equals the same computation written with
torch ops (rotary embedding as transformers' Llama applies it, SDPA), GQA, qk-norm, windows and soft-capping
against the reference with an explicit mask, positions per batch row, and bad arguments."""

import math

import pytest
import torch
import torch.nn.functional as F

from flashmoe_science.nn import Attention, SwiGLU, TransformerBlock
from flashmoe_science.nn.attention import apply_rotary, rotary_cos_sin


def _projections(layer, x):
    b, length, _ = x.shape
    qkv = layer.qkv(x).view(b, length, layer.n_heads + 2 * layer.n_kv_heads, layer.head_dim)
    return qkv.split((layer.n_heads, layer.n_kv_heads, layer.n_kv_heads), dim=2)


def _rotate_half(t):  # transformers' Llama convention, written independently
    first, second = t.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def test_rotary_matches_llama_convention():
    x = torch.randn(2, 7, 3, 16, dtype=torch.float64)
    positions = torch.arange(7)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    angles = torch.cat((positions[:, None] * inv_freq, positions[:, None] * inv_freq), dim=-1)
    want = x * angles.cos()[None, :, None] + _rotate_half(x) * angles.sin()[None, :, None]
    cos, sin = rotary_cos_sin(positions, 16, 10000.0, torch.float64)
    torch.testing.assert_close(apply_rotary(x, cos, sin), want, atol=1e-6, rtol=1e-6)  # float32 angles


@pytest.mark.parametrize("n_kv_heads, qk_norm", [(4, False), (2, True), (1, False)])
def test_attention_matches_torch(n_kv_heads, qk_norm):
    layer = Attention(64, 4, n_kv_heads, qk_norm=qk_norm, bias=True).double()
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    positions = torch.stack([torch.arange(9), torch.arange(3, 12)])  # per batch row
    q, k, v = _projections(layer, x)
    if qk_norm:
        q, k = layer.q_norm(q), layer.k_norm(k)
    cos, sin = rotary_cos_sin(positions, 16, 10000.0, torch.float64)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)
    want = layer.out(out.transpose(1, 2).reshape(2, 9, 64))
    torch.testing.assert_close(layer(x, positions), want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("window, softcap", [(3, None), (None, 2.0), (2, 1.5)])
def test_window_and_softcap(window, softcap):
    layer = Attention(32, 2, head_dim=16, rope_theta=None, window=window, softcap=softcap).double()
    x = torch.randn(1, 8, 32, dtype=torch.float64)
    q, k, v = (t.transpose(1, 2) for t in _projections(layer, x))
    scores = q @ k.transpose(-1, -2) / math.sqrt(16)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    visible = (j <= i) & ((i - j <= window) if window is not None else True)
    out = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
    torch.testing.assert_close(layer(x), layer.out(out.transpose(1, 2).reshape(1, 8, 32)), atol=1e-10, rtol=1e-10)


def test_swiglu_and_block():
    mlp = SwiGLU(16, 24).double()
    x = torch.randn(3, 16, dtype=torch.float64)
    gate, up = mlp.gate_up(x).chunk(2, dim=-1)
    torch.testing.assert_close(mlp(x), mlp.down(F.silu(gate) * up))
    block = TransformerBlock(32, 4, 48, num_experts=4, top_k=2, n_kv_heads=2).double()
    h = torch.randn(2, 5, 32, dtype=torch.float64)
    mid = h + block.attention(block.attention_norm(h))
    torch.testing.assert_close(block(h), mid + block.ffn(block.ffn_norm(mid)))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(d_model=64, n_heads=5), ValueError, "multiple of n_heads"),
    (dict(d_model=64, n_heads=4, n_kv_heads=3), ValueError, "multiple of n_kv_heads"),
    (dict(d_model=64, n_heads=4, head_dim=15), ValueError, "even head_dim"),
    (dict(d_model=64, n_heads=4, softcap=-1.0), ValueError, "softcap"),
    (dict(d_model=64, n_heads=4, window=0), ValueError, "window"),
    (dict(d_model=64, n_heads=4, backend="cuda"), ValueError, "backend"),
    (dict(d_model=64.0, n_heads=4), TypeError, "d_model"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Attention(**kwargs)
    with pytest.raises(ValueError, match="x must be"):
        Attention(64, 4)(torch.randn(2, 64))
