"""FusedMoE converted from Hugging Face blocks, on the GPU in bf16: error vs float64 within 2x the HF block's."""

import copy

import pytest
import torch

from flashmoe_science.nn import FusedMoE

pytestmark = pytest.mark.gpu


def _blocks():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    mixtral = transformers.MixtralConfig(
        hidden_size=512, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2
    )
    qwen = transformers.Qwen3MoeConfig(
        hidden_size=512, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8
    )
    return {"mixtral": lambda: MixtralSparseMoeBlock(mixtral), "qwen3-moe": lambda: Qwen3MoeSparseMoeBlock(qwen)}


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_converted_block_matches_hf_in_bf16(name):
    block64 = _blocks()[name]().double().cuda().eval()
    for param in block64.parameters():
        torch.nn.init.normal_(param, std=0.05)
    block16 = copy.deepcopy(block64).to(torch.bfloat16)
    x = torch.randn(4, 300, 512, device="cuda", dtype=torch.float64)
    with torch.no_grad():
        ref = block64(x)
        hf = block16(x.to(torch.bfloat16))
        ours = FusedMoE.from_hf(block16)(x.to(torch.bfloat16))
    assert ours.dtype == torch.bfloat16 and not torch.isnan(ours).any()
    # both compute the router logits with the same bf16 linear, so they route identically; a token whose bf16
    # routing differs from float64's costs HF and us alike
    hf_err = (hf.double() - ref).abs().max().item()
    ours_err = (ours.double() - ref).abs().max().item()
    assert ours_err <= 2 * hf_err + torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
