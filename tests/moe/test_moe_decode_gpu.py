"""The one-launch decode path (moe/triton_decode.py) on the GPU: what fused_moe and fused_experts run for an
inference call of at most MAX_DECODE_TOKENS tokens. Against float64 within 2x PyTorch's same-dtype error, as every MoE GPU test."""

import pytest
import torch

from flashmoe_science.moe import execute, fused_experts, fused_moe, moe_route, layer, triton_decode
from moe_testing import assert_within_budget, make_experts, reference64, torch_loop_same_dtype

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _exact_fp32_and_no_batched_path(monkeypatch):
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's fp32 baseline must be true fp32

    def batched(*args, **kwargs):
        raise AssertionError("a decode-sized inference call took the batched path")

    monkeypatch.setattr(layer, "moe_forward", batched)
    execute.PREPARED.clear()
    yield
    execute.PREPARED.clear()
    torch.backends.cuda.matmul.allow_tf32 = previous


def _check(out, x, w1, w2, weights, ids):
    assert out.dtype == x.dtype and out.shape == x.shape
    same, ref = torch_loop_same_dtype(x, w1, w2, weights, ids), reference64(x, w1, w2, weights, ids)
    assert_within_budget("out", out, same, ref)


@pytest.mark.parametrize("d_model, d_ff, num_experts, top_k", [
    (2048, 768, 128, 8),  # Qwen3-30B-A3B
    (4096, 1792, 8, 2),  # Mixtral's d, a slice of its F
    (200, 136, 6, 2),  # d and F not multiples of any block
    (1024, 512, 256, 8),  # E=256, k=8
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scoring, renormalize", [("softmax", True), ("sigmoid", False)])
@pytest.mark.parametrize("num_tokens", range(1, triton_decode.MAX_DECODE_TOKENS + 1))
def test_decode_matches_float64(d_model, d_ff, num_experts, top_k, dtype, scoring, renormalize, num_tokens):
    x, w1, w2 = make_experts(num_tokens, d_model, d_ff, num_experts, dtype, DEVICE)
    logits = torch.randn(num_tokens, num_experts, device=DEVICE)
    weights, ids = moe_route(logits, top_k, renormalize, scoring)
    with torch.no_grad():
        _check(fused_moe(x, w1, w2, logits, top_k, renormalize=renormalize, scoring=scoring), x, w1, w2, weights, ids)
        _check(fused_experts(x, w1, w2, weights, ids), x, w1, w2, weights, ids)


def test_dropped_slots_strided_inputs_and_bf16_logits():
    x, w1, w2 = make_experts(1, 512, 384, 16, torch.bfloat16, DEVICE)
    wide = torch.randn(1, 1024, device=DEVICE, dtype=torch.bfloat16)
    x_strided = wide[:, ::2]  # (1, 512) with column stride 2
    ids = torch.tensor([[3, -1, 16, 7]], device=DEVICE).T.contiguous().T  # column-major
    weights = torch.tensor([[0.4, 0.3, 0.2, 0.1]], device=DEVICE)
    with torch.no_grad():
        _check(fused_experts(x_strided, w1, w2, weights, ids), x_strided, w1, w2, weights, ids)
        logits = torch.randn(1, 16, device=DEVICE, dtype=torch.bfloat16)
        w, i = moe_route(logits, 4)
        _check(fused_moe(x, w1, w2, logits, 4), x, w1, w2, w, i)


def test_cuda_graph_replays_on_new_inputs():
    x, w1, w2 = make_experts(1, 2048, 768, 128, torch.bfloat16, DEVICE)
    logits = torch.randn(1, 128, device=DEVICE)
    with torch.no_grad():
        fused_moe(x, w1, w2, logits, 8)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused_moe(x, w1, w2, logits, 8)
        for _ in range(3):  # the workspace comes zeroed in every replay
            x.copy_(torch.randn_like(x))
            logits.copy_(torch.randn_like(logits))
            graph.replay()
            weights, ids = moe_route(logits, 8)
            _check(captured.clone(), x, w1, w2, weights, ids)


@pytest.mark.parametrize("entry", ["fused_moe", "fused_experts"])
def test_repeated_signature_takes_the_prepared_decode(monkeypatch, entry):
    x, w1, w2 = make_experts(1, 1024, 512, 64, torch.bfloat16, DEVICE)
    logits = torch.randn(1, 64, device=DEVICE)

    def call(x, logits):
        if entry == "fused_moe":
            return fused_moe(x, w1, w2, logits, 4)
        return fused_experts(x, w1, w2, *moe_route(logits, 4))

    with torch.no_grad():
        first = call(x, logits)
        (prepared,) = execute.PREPARED.values()
        assert isinstance(prepared, triton_decode.PreparedDecode)
        monkeypatch.setattr(triton_decode, "decode_forward", None)  # a repeat must not take the full path
        torch.testing.assert_close(call(x, logits), first, rtol=0, atol=2e-2)  # float32 atomics in any order
        x2, logits2 = torch.randn_like(x), torch.randn_like(logits)
        out2 = call(x2, logits2)
    assert len(execute.PREPARED) == 1
    weights, ids = moe_route(logits2, 4)
    _check(out2, x2, w1, w2, weights, ids)


def test_training_takes_the_batched_path_with_gradients(monkeypatch):
    monkeypatch.undo()  # the batched forward back
    x, w1, w2 = make_experts(1, 512, 256, 8, torch.bfloat16, DEVICE)
    x.requires_grad_()
    out = fused_moe(x, w1, w2, torch.randn(1, 8, device=DEVICE), 2)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
