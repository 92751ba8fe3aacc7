"""Attention backward on the GPU (H200): gradients vs float64, determinism, O(L) memory, and a small GPT.

Run: `PYTHONPATH=src python -m pytest tests/attention/test_backward_gpu.py -q -m gpu`.

On the H200 the default call (`deterministic=False`) runs the Gluon sm_90 backward for head dims up to 128 (one pass,
dQ by TMA reduce-adds; hopper/bwd_sm90.py) and the Triton two-pass backward above; `deterministic=True` always runs
the Triton two passes. The shape matrix runs both. `test_fused_path_on_the_gpu` launches the Triton fused kernel
directly (dQ summed with float32 atomics inside the dK/dV kernel) so that it stays GPU-tested.

Every gradient is compared with a float64 oracle, within 2 x PyTorch's own error in the same dtype (SDPA's backward:
cuDNN/flash for plain causal or full attention, the masked kernel for bottom-right causal with Lq != Lk) plus a slack
relative to the gradient's magnitude (grad_helpers.py). The shape matrix is arranged so that few distinct
(dtype, head dim, causal) kernels are compiled: lengths are runtime values of the backward kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flashmoe_science.attention.api import flash_attention_science
from grad_helpers import assert_grads_close, torch_same_dtype_grads

pytestmark = pytest.mark.gpu

CUDA = "cuda"
PATHS = pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])


def _inputs(b, hq, hkv, lq, lk, d, dtype):
    q = torch.randn(b, hq, lq, d, device=CUDA).to(dtype)
    k = torch.randn(b, hkv, lk, d, device=CUDA).to(dtype)
    v = torch.randn(b, hkv, lk, d, device=CUDA).to(dtype)
    grad_out = torch.randn(b, hq, lq, d, device=CUDA).to(dtype)
    return q, k, v, grad_out


def _our_grads(q, k, v, grad_out, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attention_science(q, k, v, **kwargs)
    return torch.autograd.grad(out, (q, k, v), grad_out)


def _check(b, hq, hkv, lq, lk, d, causal, dtype=torch.bfloat16, softmax_scale=None, deterministic=False):
    q, k, v, grad_out = _inputs(b, hq, hkv, lq, lk, d, dtype)
    grads = _our_grads(q, k, v, grad_out, causal=causal, softmax_scale=softmax_scale, deterministic=deterministic)
    return assert_grads_close(grads, q, k, v, grad_out, causal, softmax_scale)


@PATHS
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("length", [1, 17, 127, 128, 129, 1000])
def test_lengths(length, causal, d, deterministic):
    _check(2, 4, 4, length, length, d, causal, deterministic=deterministic)


@PATHS
@pytest.mark.parametrize("d", [16, 32, 40, 64, 80, 96, 128, 192, 256])
def test_head_dims_bf16_causal(d, deterministic):
    _check(1, 4, 2, 200, 331, d, True, deterministic=deterministic)


@pytest.mark.parametrize("d", [40, 128, 256])
def test_head_dims_fp16(d):
    _check(2, 2, 2, 130, 250, d, False, torch.float16)


@PATHS
@pytest.mark.parametrize("lq,lk", [(17, 129), (129, 17), (1, 1000), (1000, 1), (127, 300), (300, 127), (64, 1000)])
def test_causal_lq_ne_lk(lq, lk, deterministic):
    _check(2, 4, 2, lq, lk, 64, True, deterministic=deterministic)


@pytest.mark.parametrize("lq,lk", [(1, 1000), (1000, 17)])
def test_full_lq_ne_lk(lq, lk):
    _check(2, 4, 2, lq, lk, 64, False)


@PATHS
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1), (6, 3)], ids=["gqa4", "mqa", "gqa2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(hq, hkv, causal, deterministic):
    _check(2, hq, hkv, 300, 300, 128, causal, deterministic=deterministic)


@pytest.mark.parametrize("scale", [0.05, 1.3])
def test_custom_scale(scale):
    _check(2, 4, 2, 257, 257, 64, True, softmax_scale=scale)


def test_strided_packed_qkv():
    # (B, L, 3, H, D) packed projections seen as (B, H, L, D) views: no copies on the way in
    b, length, h, d = 2, 333, 4, 128
    qkv = torch.randn(b, length, 3, h, d, device=CUDA).to(torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    grad_out = torch.randn(b, length, h, d, device=CUDA).to(torch.bfloat16).transpose(1, 2)
    grads = _our_grads(q, k, v, grad_out, causal=True)
    assert_grads_close(grads, q, k, v, grad_out, True)


def test_fp32_within_tf32_error():
    # float32 runs on TF32 tensor cores: compare with PyTorch's own TF32 attention (math SDPA, TF32 matmuls)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, grad_out = _inputs(2, 4, 2, 300, 300, 64, torch.float32)
    grads = _our_grads(q, k, v, grad_out, causal=True)
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        with sdpa_kernel(SDPBackend.MATH):
            baseline = torch_same_dtype_grads(q, k, v, grad_out, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert_grads_close(grads, q, k, v, grad_out, True, baseline=baseline)


@pytest.mark.parametrize("hq,hkv,d,causal", [(8, 2, 64, True), (4, 4, 128, False)])
def test_deterministic_is_bit_exact(hq, hkv, d, causal):
    q, k, v, grad_out = _inputs(2, hq, hkv, 1000, 1000, d, torch.bfloat16)
    first = _our_grads(q, k, v, grad_out, causal=causal, deterministic=True)
    for _ in range(2):
        again = _our_grads(q, k, v, grad_out, causal=causal, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between runs"


@pytest.mark.parametrize("hq,hkv,d,causal", [(8, 2, 64, True), (4, 4, 128, False), (4, 2, 256, True)])
def test_fused_path_on_the_gpu(hq, hkv, d, causal):
    """The fused single pass, launched directly: gradients vs float64, dK/dV bit-identical run to run, dQ (float32
    atomics in arrival order) within rounding of the two-pass dQ."""
    from flashmoe_science.attention.tiles import AttentionTiles, BackwardTiles, backward_tiles, padded_head_dim
    from flashmoe_science.attention.triton.bwd import attention_backward
    from flashmoe_science.device import device_traits

    q, k, v, grad_out = _inputs(2, hq, hkv, 1000, 1000, d, torch.bfloat16)
    out, lse = flash_attention_science(q, k, v, causal=causal, return_lse=True)
    default = backward_tiles(d, q.dtype, causal, device_traits(q.device))
    tiles = BackwardTiles(default.dkdv, default.dq, fused=AttentionTiles(32, 64, 4, 2))  # the sweep's best fused

    def fused_grads():
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        workspace = torch.empty(*q.shape[:3], padded_head_dim(d), device=CUDA)
        attention_backward(q, k, v, out, lse, grad_out, torch.empty_like(lse), dq, dk, dv, causal, d**-0.5, tiles,
                           workspace)
        return dq, dk, dv

    first = fused_grads()
    assert_grads_close(first, q, k, v, grad_out, causal, None)
    two_pass = _our_grads(q, k, v, grad_out, causal=causal, deterministic=True)
    again = fused_grads()
    assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2]), "dK/dV differ between runs"
    scale = two_pass[0].float().abs().max().item()
    assert (first[0].float() - two_pass[0].float()).abs().max().item() <= 2e-2 * scale


@PATHS
def test_dead_rows_get_zero_gradients(deterministic):
    q, k, v, grad_out = _inputs(1, 4, 2, 300, 100, 64, torch.bfloat16)
    dq, dk, dv = _our_grads(q, k, v, grad_out, causal=True, deterministic=deterministic)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.count_nonzero(dq[:, :, :200]) == 0


def test_backward_memory_is_linear_in_length():
    # A materialised (L, L) float32 score matrix would be 2 GiB here; the backward may only add O(L) buffers.
    q, k, v, grad_out = _inputs(1, 2, 2, 16384, 16384, 64, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attention_science(q, k, v, causal=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad_out)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 64 * 2**20, f"backward allocated {extra / 2**20:.1f} MiB at L=16384"


# ---------------------------------------------------------------------------------------------------------------
# A 2-layer GPT trained for 30 steps on a copy task (attention matters: the next token is 16 positions back)


class _Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, attention):
        b, length, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, length, 3, self.heads, dim // self.heads).unbind(2)
        y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(y.transpose(1, 2).reshape(b, length, dim))
        return x + self.mlp(self.ln2(x))


class _TinyGPT(nn.Module):
    def __init__(self, vocab=64, dim=128, heads=4, layers=2, max_len=128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx, attention):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, attention)
        return self.head(self.ln(x))


def _train(attention, steps=30, batch=16):
    torch.manual_seed(0)
    model = _TinyGPT().to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    period, repeats, vocab = 16, 8, 64
    data = torch.randint(0, vocab, (4 * batch, period), generator=torch.Generator().manual_seed(0))
    data = data.repeat(1, repeats).to(CUDA)
    losses = []
    for step in range(steps):
        idx = data[(step % 4) * batch : (step % 4 + 1) * batch]
        logits = model(idx[:, :-1], attention)
        loss = F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def _in_bf16(attention):
    def run(q, k, v):
        return attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)).to(q.dtype)

    return run


def test_small_gpt_tracks_sdpa_loss_curve():
    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def ours(q, k, v):
        return flash_attention_science(q, k, v, causal=True)

    reference = _train(sdpa)  # float32 attention: the curve without bf16 rounding
    sdpa_bf16 = _train(_in_bf16(sdpa))
    ours_bf16 = _train(_in_bf16(ours))
    assert reference[-1] < 0.6 * reference[0], f"the task did not train: {reference.tolist()}"
    noise = (sdpa_bf16 - reference).abs().max().item()
    ours_dev = (ours_bf16 - reference).abs().max().item()
    assert ours_dev <= 2 * noise + 0.02, (
        f"our loss curve deviates by {ours_dev:.4f} (SDPA bf16: {noise:.4f})\nours {ours_bf16.tolist()}\n"
        f"sdpa {reference.tolist()}"
    )
