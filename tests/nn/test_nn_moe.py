"""FusedMoE module and the Hugging Face Mixtral / Qwen3-MoE converters (tiny random configs, CPU)."""

import pytest
import torch

from flashmoe_science.moe.reference import fused_experts_reference
from flashmoe_science.nn import FusedMoE, replace_hf_moe_blocks


def test_fused_moe_module_matches_functional_reference():
    layer = FusedMoE(16, 12, 5, 2, dtype=torch.float64)
    x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape
    flat = x.reshape(-1, 16)
    weights, ids = torch.softmax(layer.router(flat), -1).topk(2, -1)
    expected = fused_experts_reference(flat, layer.w1, layer.w2, weights / weights.sum(-1, keepdim=True), ids)
    torch.testing.assert_close(out.reshape(-1, 16), expected)
    out.sum().backward()
    assert layer.w1.grad is not None and layer.router.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(d_model=0), ValueError, "d_model"),
        (dict(d_ff=2.5), TypeError, "d_ff"),
        (dict(top_k=9), ValueError, "top_k"),
        (dict(scoring="tanh"), ValueError, "scoring"),
        (dict(backend="x"), ValueError, "backend"),
    ],
)
def test_fused_moe_module_rejects_bad_config(kwargs, error, name):
    config = dict(d_model=8, d_ff=4, num_experts=4, top_k=2) | kwargs
    with pytest.raises(error, match=name):
        FusedMoE(**config)


def test_fused_moe_module_rejects_wrong_width():
    with pytest.raises(ValueError, match="hidden_states"):
        FusedMoE(8, 4, 4, 2)(torch.randn(3, 9))


def _mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2)
    return MixtralSparseMoeBlock(config)


def _qwen3_block(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=32, moe_intermediate_size=20, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
    )
    return Qwen3MoeSparseMoeBlock(config)


@pytest.mark.parametrize("make_block", [_mixtral_block, lambda: _qwen3_block(True), lambda: _qwen3_block(False)])
def test_hf_block_parity(make_block):
    pytest.importorskip("transformers")
    block = make_block().double().eval()
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)  # HF leaves its 3-D expert tensors uninitialised
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    expected = block(x)
    fused = FusedMoE.from_hf(block)
    assert fused.w1 is block.experts.gate_up_proj  # shared, not copied
    # routing probabilities are float32 by contract (as in HF), so float64 blocks agree to float32 rounding
    torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-6)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([block])

    model = Model()
    assert replace_hf_moe_blocks(model) == 1
    assert isinstance(model.layers[0], FusedMoE)
    torch.testing.assert_close(model.layers[0](x), expected, rtol=1e-5, atol=1e-6)


def test_from_hf_rejects_other_modules():
    with pytest.raises(TypeError, match="block"):
        FusedMoE.from_hf(torch.nn.Linear(3, 3))
