"""Shared helpers of the FP8 experts' tests: inputs, the error measures, the budget, an FP8 Hugging Face block."""

import torch

from flashmoe_science.moe.fp8 import BLOCK, quantize_fp8_weights
from moe_testing import make_experts

# RMS error of the FP8 layer vs the unquantised float64 layer, relative to the output's RMS. Measured with the
# quantisation emulated in float64 (d 512..2048, F 256..768, k 2..8, random normal inputs): 6.3-6.5%; bf16's
# error on the same layers: 0.41-0.42% (e4m3 keeps 3 mantissa bits to bf16's 7; each of x, the weights and h
# is rounded once).
FP8_RMS_BUDGET = 0.08


def quantized_experts(num_tokens, d_model, d_ff, num_experts, dtype=torch.float32, device="cpu"):
    """x, the unquantised w1/w2 and their e4m3 forms with scales."""
    x, w1, w2 = make_experts(num_tokens, d_model, d_ff, num_experts, torch.float32, device)
    (q1, s1), (q2, s2) = quantize_fp8_weights(w1), quantize_fp8_weights(w2)
    return x.to(dtype), w1, w2, q1, s1, q2, s2


def rms_error(ours, ref) -> float:
    ref = ref.double()
    return ((ours.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp(min=1e-30)).item()


def assert_matches_emulation(name, ours, emulated):
    """Ours vs the float64 layer with the format's roundings emulated: float32 accumulation apart, a rounding of
    h can land one e4m3 step away where the float32 and float64 values straddle a rounding boundary."""
    assert not torch.isnan(ours).any(), f"{name}: NaN"
    if emulated.numel() == 0:
        return
    rms, worst = rms_error(ours, emulated), (ours.double() - emulated).abs().max().item()
    scale = emulated.abs().max().item()
    assert rms <= 5e-3 and worst <= 3e-2 * scale, f"{name}: RMS {rms:.2e}, max {worst:.2e} (output max {scale:.2e})"


def qwen3_fp8_block(hidden=256, d_ff=192, experts=8, top_k=2):
    """A Qwen3-MoE block with random weights, and the same block with its experts as transformers' FP8Experts
    holding our quantisation of those weights (the bytes transformers' FineGrainedFP8Config would store)."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations.finegrained_fp8 import FP8Experts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=d_ff, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    for param in block.parameters():
        torch.nn.init.normal_(param, std=hidden**-0.5)  # HF leaves its 3-D expert tensors uninitialised
    bf16_experts = block.experts
    fp8_experts = FP8Experts(config, block_size=(BLOCK, BLOCK))
    for name in ("gate_up_proj", "down_proj"):
        q, scale = quantize_fp8_weights(getattr(bf16_experts, name).data)
        getattr(fp8_experts, name).data = q
        getattr(fp8_experts, f"{name}_scale_inv").data = scale
    return block, bf16_experts, fp8_experts
