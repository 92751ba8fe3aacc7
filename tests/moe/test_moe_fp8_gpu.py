"""The FP8 experts' Triton kernels on the GPU (compute capability >= 8.9): each stage against float64 with the
format's roundings emulated (round-to-nearest-even, as the GPU converts; ``fp8_testing.assert_stages_match_emulation``
says why stage by stage on Hopper's e4m3 wgmma), and the layer against the unquantised float64 layer within the
format's budget (fp8_testing.FP8_RMS_BUDGET). Buffers the kernels should write are NaN-poisoned.

Run: ``PYTHONPATH=src python -m pytest -m gpu tests/moe/test_moe_fp8_gpu.py -q``.
"""

import pytest
import torch

from flashmoe_science.moe import describe_moe, fused_experts, fused_moe, moe_route
from flashmoe_science.moe.triton_fp8_gemm import choose_fp8_tiles, fp8_tile_candidates
from flashmoe_science.nn.moe import FusedMoE
from fp8_testing import FP8_RMS_BUDGET, assert_stages_match_emulation, quantized_experts, qwen3_fp8_block, rms_error

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _poison_and_fp8_gpu(monkeypatch):
    monkeypatch.setenv("FLASHMOE_SCIENCE_POISON", "1")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 tensor-core products need compute capability 8.9 or newer")


SHAPES = [
    # T, d, F, E, k
    (1, 2048, 768, 128, 8),  # Qwen3-30B-A3B decode: 16-row tiles, x quantised in the gather, split-K down
    (16, 4096, 1024, 8, 2),  # Mixtral-like decode batch
    (77, 200, 136, 6, 2),  # d and F not multiples of 128
    (300, 512, 384, 16, 4),  # 64-row tiles, x quantised first
    (4096, 2048, 768, 128, 8),  # Qwen3-30B-A3B layer dims
    (2048, 1024, 768, 8, 2),
]


@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k", SHAPES)
def test_matches_the_emulation_and_the_budget(num_tokens, d_model, d_ff, num_experts, top_k):
    x, w1, w2, q1, s1, q2, s2 = quantized_experts(num_tokens, d_model, d_ff, num_experts, torch.bfloat16, DEVICE)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts, device=DEVICE), top_k)
    if num_tokens > 2:
        ids[1, 0] = -1  # a dropped slot
    assert "triton_fp8_gemm" in describe_moe(x, q1, q2, top_k, w1_scale=s1, w2_scale=s2)
    out = fused_experts(x, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    assert_stages_match_emulation(x, q1, s1, q2, s2, weights, ids,
                                  choose_fp8_tiles(num_tokens, top_k, num_experts, d_model, d_ff, x.device))
    exact = fused_experts(x.double(), w1.double(), w2.double(), weights.double(), ids)
    assert rms_error(out, exact) <= FP8_RMS_BUDGET


@pytest.mark.parametrize("num_tokens", [16, 2048])
def test_every_swept_tile_config_is_correct(num_tokens):
    d_model, d_ff, num_experts, top_k = 2048, 768, 64, 8
    x, _, _, q1, s1, q2, s2 = quantized_experts(num_tokens, d_model, d_ff, num_experts, torch.bfloat16, DEVICE)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts, device=DEVICE), top_k)
    for name, tiles in fp8_tile_candidates(num_tokens, top_k, num_experts, d_model, d_ff, x.device).items():
        try:
            assert_stages_match_emulation(x, q1, s1, q2, s2, weights, ids, tiles)
        except AssertionError as error:
            raise AssertionError(f"tiles {name}: {error}") from error


def test_cuda_graph_replay_matches_eager():
    x, _, _, q1, s1, q2, s2 = quantized_experts(16, 2048, 768, 128, torch.bfloat16, DEVICE)
    logits = torch.randn(16, 128, device=DEVICE)
    with torch.no_grad():
        eager = fused_moe(x, q1, q2, logits, 8, w1_scale=s1, w2_scale=s2)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fused_moe(x, q1, q2, logits, 8, w1_scale=s1, w2_scale=s2)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused_moe(x, q1, q2, logits, 8, w1_scale=s1, w2_scale=s2)
        graph.replay()
    torch.cuda.synchronize()
    # float32 atomics combine the k slots in any order
    torch.testing.assert_close(captured, eager, rtol=1e-2, atol=1e-2)


def test_from_hf_fp8_qwen3_block_on_gpu():
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    block, _, fp8_experts = qwen3_fp8_block(hidden=512, d_ff=384, experts=16, top_k=4)
    x = torch.randn(2, 37, 512, device=DEVICE)
    with torch.no_grad():
        exact = block.double().to(DEVICE)(x.double())
        block.float()  # the router's dtype is the layer's: float32 routing picks the float64 block's experts
        block.experts = fp8_experts.to(DEVICE)
        layer = FusedMoE.from_hf(block)
        assert "triton_fp8_gemm" in describe_moe(x.reshape(-1, 512), layer.w1, layer.w2, 4, w1_scale=layer.w1_scale,
                                                 w2_scale=layer.w2_scale)
        out = layer(x)
    assert out.dtype == torch.float32 and rms_error(out, exact) <= FP8_RMS_BUDGET
