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


# The e4m3fn grid, decoded in Python (exact): the oracle's roundings and decodings index it, so that they are the
# same bits on every device (CUDA's float64 log2/exp2 need not be exact at powers of two).
_E4M3_CODE_VALUES = [(-1.0 if code & 0x80 else 1.0) * ((code & 7) * 2.0**-9 if (code >> 3) & 0xF == 0 else
                                                        (1 + (code & 7) / 8) * 2.0 ** (((code >> 3) & 0xF) - 7))
                     for code in range(256)]
_E4M3_GRID = _E4M3_CODE_VALUES[:127]  # 0 .. 448 ascending: index = code, so an even index is an even mantissa


def rne_e4m3(v: torch.Tensor) -> torch.Tensor:
    """v rounded to e4m3 (saturating at 448, round to nearest even) by comparisons against the e4m3 grid, back in
    v's dtype: the oracle's rounding on every device, independent of the library's float -> e4m3 conversion
    kernels. A magnitude between grid points i-1 and i goes to the nearer; a tie to the even code."""
    grid = torch.tensor(_E4M3_GRID, dtype=torch.float64, device=v.device)
    a = v.double().abs().clamp(max=FP8_MAX)
    hi = torch.searchsorted(grid, a).clamp(min=1)
    up, down = grid[hi], grid[hi - 1]
    mid = (up + down) / 2  # exact: two e4m3 values
    take_up = (a > mid) | ((a == mid) & (hi % 2 == 0)) | (a == up)
    return torch.where(take_up, up, down).copysign(v.double()).to(v.dtype)


def e4m3_values(q: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes decoded to float64 from their bits (sign, 4 exponent bits of bias 7, 3 mantissa bits;
    exponent 0: subnormal), independent of the library's e4m3 -> float conversion kernels."""
    table = torch.tensor(_E4M3_CODE_VALUES, dtype=torch.float64, device=q.device)
    return table[q.view(torch.uint8).long()]


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


# The stages' slack on a GPU, for the accumulation of e4m3 products (the quantisations of x and h are emulated
# exactly: fp8.quantize_fp8_groups). Tiles of fewer than 64 rows run mma.sync on e4m3 widened to float16: exact
# products, float32 sums, so h is the emulated h but where float32 and float64 straddle a rounding boundary. Tiles
# of 64 rows and more run e4m3 wgmma, whose sums inside a 128-wide K block keep ~13-14 bits (DeepSeek-V3's
# measurement; each block's product joins the float32 accumulator scaled, as in DeepGEMM): a relative error e of
# gate and up re-rounds ~19e of h's elements and moves the largest group scale ~6.5e (e ~ 1e-3 modelled at K = 2048).
# The bounds: h's group scales within ``scale_rtol``, every element within one e4m3 step plus ``scale_rtol`` of its
# group's largest value, at most ``max_rerounded`` of the elements a step away, and the down GEMM, fed the kernel's
# own h, within the emulation's float32 margin. A real fault (a tie rounded elsewhere, a wrong group, scale, column
# order or rounding mode) re-rounds several % of h and moves group scales by several %.
MMA_SYNC_SLACK = (1e-4, 2e-3)  # (scale_rtol, max_rerounded)
WGMMA_SLACK = (1e-2, 3e-2)


def gpu_slack(tiles) -> tuple[float, float]:
    """(scale_rtol, max_rerounded) of ``assert_stages_match_emulation`` for a tile family on a GPU."""
    return WGMMA_SLACK if tiles.block_m >= 64 else MMA_SYNC_SLACK


def e4m3_step(q: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at magnitude |q| <= 448 (3 mantissa bits; subnormals below 2^-6 are 2^-9 apart):
    the gap above q's grid point on the e4m3 grid (``rne_e4m3``'s), exact on every device."""
    grid = torch.tensor(_E4M3_GRID + [480.0], dtype=torch.float64, device=q.device)
    at = torch.searchsorted(grid, rne_e4m3(q.double()).abs(), right=True).clamp(max=grid.numel() - 1)
    return (grid[at] - grid[at - 1]).to(q.dtype)


def exact_dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 ``q * weight_scale_inv`` per 128x128 block, q decoded from its bits (``e4m3_values``)."""
    return e4m3_values(q) * dequantize_fp8(torch.ones(q.shape, dtype=torch.float64, device=q.device), scale,
                                           torch.float64)


def assert_stages_match_emulation(x, q1, s1, q2, s2, weights, ids, tiles, cast=rne_e4m3, scale_rtol=None,
                                  max_rerounded=None):
    """The FP8 forward's two stages (``fp8_up``, ``fp8_down``) against float64 with the format's roundings
    emulated (``cast`` rounds to e4m3; the weights decoded from their bits): h per sorted row against the emulated
    h of its (token, slot), and the down GEMM against float64 on the kernel's own h. ``scale_rtol`` and
    ``max_rerounded`` bound h's group scales and the share of its elements a step away (``gpu_slack(tiles)`` by
    default). Returns the kernels' (T, d) float32 output."""
    from flashmoe_science.moe.triton_fp8_gemm import fp8_down, fp8_up

    default_rtol, default_rerounded = gpu_slack(tiles)
    scale_rtol = default_rtol if scale_rtol is None else scale_rtol
    max_rerounded = default_rerounded if max_rerounded is None else max_rerounded
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
    step = _per_group(e4m3_step(torch.maximum(hq.abs(), hq_emulated.abs())) + FP8_MAX * scale_rtol,
                      hs_emulated) * (1 + scale_rtol)
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
