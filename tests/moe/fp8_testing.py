"""What the FP8 experts' tests share: inputs, the error measures, the budget, an FP8 Hugging Face block."""

import torch
import torch.nn.functional as F

from flashmoe_science.moe.fp8 import (BLOCK, FP8_MAX, _per_group, dequantize_fp8, quantize_fp8_groups,
                                      quantize_fp8_weights)
from moe_testing import make_experts

# RMS error of the FP8 layer vs the unquantised float64 layer, relative to the output's RMS. Measured with the
# quantisation emulated in float64 (d 512..2048, F 256..768, k 2..8, random normal inputs): 6.3-6.5%; bf16's
# error on the same layers: 0.41-0.42% (e4m3 keeps 3 mantissa bits to bf16's 7; each of x, the weights and h
# is rounded once).
FP8_RMS_BUDGET = 0.08


def quantized_experts(num_tokens, d_model, d_ff, num_experts, dtype=torch.float32, device="cpu", block_spread=1.0):
    """x, the unquantised w1/w2 and their e4m3 forms with scales. ``block_spread > 1`` multiplies a random third
    of each weight's 128x128 blocks by it before quantising: block scales that differ ``block_spread``-fold, so a
    kernel that applies a neighbouring block's scale is off by that factor instead of by the few % that random
    normal blocks differ."""
    x, w1, w2 = make_experts(num_tokens, d_model, d_ff, num_experts, torch.float32, device)
    if block_spread != 1.0:
        w1, w2 = (_spread_blocks(w, block_spread) for w in (w1, w2))
    (q1, s1), (q2, s2) = quantize_fp8_weights(w1), quantize_fp8_weights(w2)
    return x.to(dtype), w1, w2, q1, s1, q2, s2


def _spread_blocks(w: torch.Tensor, factor: float) -> torch.Tensor:
    *lead, n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    big = torch.rand(*lead, nb, kb, device=w.device) < 1 / 3
    per_block = torch.where(big, factor, 1.0)
    return w * per_block.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]


def rne_e4m3(v: torch.Tensor) -> torch.Tensor:
    """v rounded to e4m3 (saturating at 448, round to nearest even) by float64 arithmetic, back in v's dtype: the
    oracle's rounding on every device, independent of the library's float -> e4m3 conversion kernels. A value's
    e4m3 spacing is 2^(floor(log2|v|) - 3) (2^-9 below 2^-6, the subnormals); |v| over that spacing is exact in
    float64, and torch.round rounds its halves to even."""
    a = v.double().abs().clamp(max=FP8_MAX)
    _, exponent = torch.frexp(a)  # a = m * 2^exponent, m in [0.5, 1): floor(log2 a) = exponent - 1
    step = torch.exp2((exponent - 1).clamp(min=-6).double() - 3)
    return (torch.round(a / step) * step).copysign(v.double()).to(v.dtype)


def e4m3_values(q: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes decoded to float64 from their bits (sign, 4 exponent bits of bias 7, 3 mantissa bits;
    exponent 0: subnormal), independent of the library's e4m3 -> float conversion kernels."""
    bits = q.view(torch.uint8).to(torch.int32)
    exponent, mantissa = (bits >> 3) & 0xF, (bits & 0x7).double()
    magnitude = torch.where(exponent == 0, mantissa * 2.0**-9, (1 + mantissa / 8) * torch.exp2(exponent.double() - 7))
    return torch.where(bits >= 0x80, -magnitude, magnitude)


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


# The stages' slack for the accumulation of e4m3 products. Hopper's e4m3 wgmma (tiles of >= 64 rows) sums each
# 128-wide K block with ~13-14 bits kept after aligning the terms to the largest, as DeepSeek-V3 reports (the
# kernels add every block's product into float32 after scaling it, as DeepGEMM does): a model of it (13 bits,
# two's-complement truncation, 32-wide k-steps) gives a relative RMS error of 1.2e-3 in gate and up at K = 2048.
# h's rounding turns that into whole e4m3 steps: a relative error e of gate/up re-rounds ~19e of h's elements
# (measured, e = 1e-4 .. 1e-2) and moves the layer ~sqrt(e / 10) from the float64 emulation (e = 1e-3: RMS 1.0e-2),
# so the layer as a whole cannot be held to the emulation's float32 margin on such a GPU. The stages can: h within
# one e4m3 step of the emulated h (MAX_REROUNDED of its elements allowed a step, e <= 5e-3) and its scales within
# SCALE_RTOL (the largest group scale moves ~6.5e), and the down GEMM, fed the kernel's own h, within the
# emulation's margin. A real fault (a wrong group, scale, column order or rounding mode) moves most elements.
MAX_REROUNDED = 0.10
SCALE_RTOL = 3e-2


def e4m3_step(q: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at magnitude |q| (3 mantissa bits; subnormals below 2^-6 are 2^-9 apart)."""
    return torch.exp2(torch.floor(torch.log2(q.abs().clamp(min=2.0**-6))) - 3)


def exact_dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 ``q * weight_scale_inv`` per 128x128 block, q decoded from its bits (``e4m3_values``)."""
    return e4m3_values(q) * dequantize_fp8(torch.ones(q.shape, dtype=torch.float64, device=q.device), scale,
                                           torch.float64)


def assert_stages_match_emulation(x, q1, s1, q2, s2, weights, ids, tiles, cast=rne_e4m3, scale_rtol=SCALE_RTOL,
                                  max_rerounded=MAX_REROUNDED):
    """The FP8 forward's two stages (``fp8_up``, ``fp8_down``) against float64 with the format's roundings
    emulated (``cast`` rounds to e4m3; the weights decoded from their bits): h per sorted row against the emulated
    h of its (token, slot), and the down GEMM against float64 on the kernel's own h. ``scale_rtol`` and
    ``max_rerounded`` bound h's group scales and the share of its elements a step away (this module's GPU slack by
    default). Returns the kernels' (T, d) float32 output."""
    from flashmoe_science.moe.triton_fp8_gemm import fp8_down, fp8_up

    num_tokens, top_k = ids.shape
    d_ff = q2.shape[2]
    sort, h, h_scale = fp8_up(x, q1, s1, ids, tiles)
    pairs = torch.nonzero(sort.pair_row >= 0).squeeze(1)
    rows, tokens, experts = sort.pair_row[pairs].long(), pairs // top_k, ids.reshape(-1)[pairs].long()
    xq, xs = quantize_fp8_groups(x.double(), cast)
    x_deq = _per_group(xq, xs)
    h_exact = torch.empty((pairs.numel(), d_ff), dtype=torch.float64, device=x.device)
    w2_deq = {}
    for expert in experts.unique().tolist():
        sel = experts == expert
        gate_up = x_deq[tokens[sel]] @ exact_dequantized(q1[expert], s1[expert]).T
        h_exact[sel] = F.silu(gate_up[:, :d_ff]) * gate_up[:, d_ff:]
        w2_deq[expert] = exact_dequantized(q2[expert], s2[expert])
    hq_emulated, hs_emulated = quantize_fp8_groups(h_exact, cast)
    hq, hs = h[rows].double(), h_scale[rows].double()
    assert not torch.isnan(hq).any() and not torch.isnan(hs).any(), "h: NaN (a row or group left unwritten)"
    torch.testing.assert_close(hs, hs_emulated, rtol=scale_rtol, atol=0, msg=lambda m: f"h scales: {m}")
    ours, emulated = _per_group(hq, hs), _per_group(hq_emulated, hs_emulated)
    step = _per_group(e4m3_step(torch.maximum(hq.abs(), hq_emulated.abs())), hs_emulated) * (1 + scale_rtol)
    worst = ((ours - emulated).abs() / step).max().item() if step.numel() else 0.0
    assert worst <= 1, f"h: an element {worst:.2f} e4m3 steps from the emulation"
    rerounded = (hq != hq_emulated).double().mean().item() if hq.numel() else 0.0
    assert rerounded <= max_rerounded, f"h: {rerounded:.1%} of elements a step from the emulation"

    out32 = fp8_down(h, h_scale, q2, s2, weights.float().contiguous(), sort, tiles, num_tokens)
    down = torch.zeros(out32.shape, dtype=torch.float64, device=x.device)
    for expert, w2_e in w2_deq.items():
        sel = experts == expert
        y = (ours[sel] @ w2_e.T) * weights.reshape(-1)[pairs[sel]].double()[:, None]
        down.index_add_(0, tokens[sel], y)
    assert_matches_emulation("down GEMM on the kernel's h", out32, down)
    return out32


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
