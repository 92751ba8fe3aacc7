"""FP8 experts (moe/fp8.py, moe/triton_fp8_gemm.py): the quantisers, the checks, the plan, the reference against
float64, FusedMoE's FP8 forms; and the Triton kernels on the CPU under TRITON_INTERPRET=1.

Two references: the float64 layer with every rounding of the format emulated (the only fair oracle of a quantised
layer: our kernels must match it to float32 accumulation), and the unquantised float64 layer (the error of the
format itself: RMS error <= 8% of the output's RMS (measured 6.3-6.5%, ~15x bf16's 0.4%; fp8_testing.py).

The interpreter's float32 -> e4m3 conversion differs from the GPU's round-to-nearest-even (a mantissa carry into
an odd exponent is lost, subnormals are rounded differently: ~2% of values): in the interpreter the oracle rounds
with the interpreter's own conversion (``_interpreter_e4m3``), on the GPU with round-to-nearest-even.
The interpreter cases run in a child pytest (``test_fp8_kernels_under_interpreter``); by hand:
``TRITON_INTERPRET=1 PYTHONPATH=src python -m pytest tests/moe/test_moe_fp8.py -q``.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashmoe_science.moe import describe_moe, fused_experts, fused_moe, moe_route
from flashmoe_science.moe.fp8 import (BLOCK, FP8, dequantize_fp8, fp8_experts_reference, quantize_fp8_groups,
                                      quantize_fp8_weights)
from flashmoe_science.nn.moe import FusedMoE
from interpreter_driver import interpreter_suite, run_marked_suite
from fp8_testing import (FP8_RMS_BUDGET, assert_matches_emulation, assert_stages_match_emulation, quantized_experts,
                         qwen3_fp8_block, rms_error, rne_e4m3)

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
# ------------------------------------------------------------------------------------------- quantisers (CPU)
@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 200, 136), (1, 1, 1), (130, 129)])
def test_weight_quantiser_blocks_and_round_trip(shape):
    w = torch.randn(shape) * torch.exp(torch.randn(shape))
    q, scale = quantize_fp8_weights(w)
    assert q.dtype == FP8 and q.shape == w.shape and q.is_contiguous()
    assert scale.shape == (*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK)) and scale.dtype == torch.float32
    back = dequantize_fp8(q, scale, torch.float64)
    # round to nearest with 3 mantissa bits: half a step is <= 1/16 of the value, or half a subnormal step
    bound = w.double().abs() / 16 + scale.double().max() * 2.0**-10
    assert ((back - w.double()).abs() <= bound * (1 + 1e-6)).all()
    # each block's largest magnitude lands on 448
    blocks = q.float().abs().reshape(-1)
    assert blocks.max().item() == 448.0


def test_weight_quantiser_matches_transformers_fp8_quantize():
    transformers_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers import FineGrainedFP8Config

    class Quantizer:
        quantization_config = FineGrainedFP8Config(weight_block_size=[BLOCK, BLOCK])

    w = torch.randn(4, 256, 384, dtype=torch.bfloat16)
    w[1] = 0  # an all-zero expert: scale 1, zeros
    theirs = transformers_fp8.Fp8Quantize(Quantizer()).convert({"experts.gate_up_proj": w})
    q, scale = quantize_fp8_weights(w)
    assert torch.equal(q.view(torch.uint8), theirs["experts.gate_up_proj"].view(torch.uint8))
    assert torch.equal(scale, theirs["experts.gate_up_proj_scale_inv"])


def test_group_quantiser_is_per_token_per_128():
    x = torch.randn(5, 300, dtype=torch.float64)
    x[2, :128] = 0  # an all-zero group stays zero
    q, scale = quantize_fp8_groups(x)
    assert scale.shape == (5, 3) and q.dtype == scale.dtype == torch.float64
    assert (q[2, :128] == 0).all()
    for group in range(3):  # float32 arithmetic, as the kernels: the scale is the format's float32
        cols = slice(group * BLOCK, (group + 1) * BLOCK)
        x32 = x[:, cols].float()
        want_scale = x32.abs().amax(dim=1).clamp(min=1e-10) / 448
        assert torch.equal(scale[:, group], want_scale.double())
        assert torch.equal(q[:, cols], (x32 / want_scale[:, None]).to(FP8).double())


def test_group_quantiser_rounds_exact_ties_to_even():
    """448 x / amax of 16-bit x is exactly an e4m3 rounding tie for ~0.5% of elements: the quantiser must compute
    the float32 quotient exactly (IEEE division), so that every tie rounds to the even code, on every device."""
    powers = torch.tensor([1.0, 2.0, 4.0, 8.0] * 32)[:127]
    x = torch.cat([torch.tensor([3.5]), powers * 1.0625 / 128])[None]  # scale 3.5 / 448 = 1/128
    q, scale = quantize_fp8_groups(x.bfloat16().float())
    assert scale.item() == 3.5 / 448 and q[0, 0] == 448
    assert torch.equal(q[0, 1:], powers)  # 1.0625 * 2^k lies halfway between 2^k and 1.125 * 2^k: the even one
    bf16 = torch.randn(64, 1024).bfloat16()
    q, scale = quantize_fp8_groups(bf16.double())
    ties = (bf16.float().reshape(64, 8, 128) / scale.float()[..., None]).reshape(64, 1024)
    exact = bf16.double() / scale.repeat_interleave(BLOCK, dim=1)
    assert torch.equal(q, rne_e4m3(ties).double()) and (rne_e4m3(exact * (1 + 1e-9)) != q).any()


# -------------------------------------------------------------------------------- checks and plan (CPU)
def test_checks_name_the_argument():
    x, _, _, q1, s1, q2, s2 = quantized_experts(4, 256, 128, 4)
    logits = torch.randn(4, 4)
    with pytest.raises(ValueError, match="w1_scale"):
        fused_moe(x, q1, q2, logits, 2, w1_scale=s1[:, :1], w2_scale=s2)
    with pytest.raises(TypeError, match="w2_scale"):
        fused_moe(x, q1, q2, logits, 2, w1_scale=s1, w2_scale=s2.double())
    with pytest.raises(ValueError, match="both w1_scale and w2_scale"):
        fused_moe(x, q1, q2, logits, 2, w1_scale=s1)
    with pytest.raises(TypeError, match="w2 must be torch.float8_e4m3fn"):
        fused_moe(x, q1, q2.float(), logits, 2, w1_scale=s1, w2_scale=s2)
    with pytest.raises(ValueError, match="w1 must have shape"):
        fused_moe(x[:, :128], q1, q2, logits, 2, w1_scale=s1, w2_scale=s2)
    with pytest.raises(ValueError, match="forward only"):
        fused_moe(x.requires_grad_(), q1, q2, logits, 2, w1_scale=s1, w2_scale=s2)


def test_describe_names_the_family_and_why():
    x, _, _, q1, s1, q2, s2 = quantized_experts(4, 256, 128, 4)
    text = describe_moe(x, q1, q2, 2, w1_scale=s1, w2_scale=s2)
    assert "FP8 e4m3" in text and "reference" in text
    assert "not triton: x is on cpu" in text


# ----------------------------------------------------------------------------------- reference (CPU)
@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k", [(33, 256, 384, 8, 2), (7, 200, 136, 5, 3)])
def test_reference_matches_the_float64_emulation_and_the_budget(num_tokens, d_model, d_ff, num_experts, top_k):
    x, w1, w2, q1, s1, q2, s2 = quantized_experts(num_tokens, d_model, d_ff, num_experts)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts), top_k)
    ids[0, 0] = -1  # a dropped slot
    ours = fused_experts(x, q1, q2, weights, ids, w1_scale=s1, w2_scale=s2)
    assert ours.dtype == torch.float32
    assert_matches_emulation("out", ours, fp8_experts_reference(x.double(), q1, s1, q2, s2, weights, ids))
    exact = fused_experts(x.double(), w1.double(), w2.double(), weights.double(), ids)
    bf16 = fused_experts(x.bfloat16(), w1.bfloat16(), w2.bfloat16(), weights, ids)
    assert rms_error(ours, exact) <= FP8_RMS_BUDGET
    assert rms_error(ours, exact) > rms_error(bf16, exact)  # the budget is the format's, not slack


def test_empty_and_one_token():
    x, _, _, q1, s1, q2, s2 = quantized_experts(1, 256, 128, 4)
    logits = torch.randn(1, 4)
    out = fused_moe(x, q1, q2, logits, 2, w1_scale=s1, w2_scale=s2)
    weights, ids = moe_route(logits, 2)
    assert_matches_emulation("one token", out, fp8_experts_reference(x.double(), q1, s1, q2, s2, weights, ids))
    empty = fused_moe(x[:0], q1, q2, logits[:0], 2, w1_scale=s1, w2_scale=s2)
    assert empty.shape == (0, 256)


# ------------------------------------------------------------------------------------------ FusedMoE (CPU)
def test_fused_moe_module_quantize_fp8():
    layer = FusedMoE(256, 128, 4, 2)
    x = torch.randn(2, 3, 256)
    with torch.no_grad():
        exact = layer.double()(x.double())
        layer.float().quantize_fp8()
        assert layer.w1.dtype == FP8 and layer.w1_scale.shape == (4, 2, 2) and layer.is_fp8
        out = layer(x)
    assert out.shape == x.shape and rms_error(out, exact) <= FP8_RMS_BUDGET
    with pytest.raises(ValueError, match="already FP8"):
        layer.quantize_fp8()


def test_from_hf_loads_an_fp8_qwen3_block():
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    block, bf16_experts, fp8_experts = qwen3_fp8_block()
    x = torch.randn(3, 7, 256)
    with torch.no_grad():
        exact = block.double()(x.double())
        block.float()
        block.experts = fp8_experts
        layer = FusedMoE.from_hf(block)
        assert layer.w1 is fp8_experts.gate_up_proj and layer.w2_scale is fp8_experts.down_proj_scale_inv
        assert layer.is_fp8 and layer.w1.dtype == FP8
        out = layer(x)
        weights, ids = moe_route(layer.router(x.reshape(-1, 256)), 2)
        emulated = fp8_experts_reference(x.reshape(-1, 256).double(), layer.w1, layer.w1_scale, layer.w2,
                                         layer.w2_scale, weights, ids)
    assert_matches_emulation("from_hf", out.reshape(-1, 256), emulated)
    assert rms_error(out, exact) <= FP8_RMS_BUDGET
    fp8_experts.block_size = (64, 64)
    with pytest.raises(ValueError, match="128x128"):
        FusedMoE.from_hf(block)


# --------------------------------------------------------------------------------- interpreter (child)
@pytest.mark.slow
@interpreter_suite(__file__, timeout=600)
def test_fp8_kernels_under_interpreter(request):
    pytest.importorskip("triton")
    if IN_INTERPRETER:
        pytest.skip("already under TRITON_INTERPRET=1: the cases run in this process")
    run_marked_suite(request)


def _interpreter_e4m3(values: torch.Tensor) -> torch.Tensor:
    """values rounded to e4m3 by the interpreter's own float32 -> e4m3 conversion (what the kernels' casts do
    there), back in values' dtype."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(src, dst, n, BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n).to(tl.float8e4nv), mask=offsets < n)

    flat = values.reshape(-1).float().clamp(-448, 448).contiguous()
    out = torch.empty(flat.shape, dtype=FP8)
    cast[(triton.cdiv(flat.numel(), 1024),)](flat, out, flat.numel(), BLOCK_SIZE=1024)
    return out.to(values.dtype).reshape(values.shape)


@pytest.mark.parametrize("quantize_in_gather", [True, False], ids=["x-in-gather", "x-first"])
@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k", [
    (1, 256, 128, 4, 2),  # one token
    (21, 200, 136, 5, 3),  # d and F not multiples of 128: partial blocks and groups
    (40, 256, 256, 3, 2),  # several row tiles per expert, two h groups per row
])
def test_kernels_match_the_emulation(quantize_in_gather, num_tokens, d_model, d_ff, num_experts, top_k, monkeypatch):
    monkeypatch.setenv("FLASHMOE_SCIENCE_POISON", "1")  # buffers NaN-filled: a skipped element shows
    from dataclasses import replace

    from flashmoe_science.moe.triton_fp8_gemm import choose_fp8_tiles, fp8_forward

    x, _, _, q1, s1, q2, s2 = quantized_experts(num_tokens, d_model, d_ff, num_experts)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts), top_k)
    if num_tokens > 2:
        ids[1, 0] = -1  # dropped slots
    tiles = replace(choose_fp8_tiles(num_tokens, top_k, num_experts, d_model, d_ff, x.device),
                    quantize_in_gather=quantize_in_gather)
    out = fp8_forward(x, q1, s1, q2, s2, weights.float().contiguous(), ids, tiles)
    emulated = fp8_experts_reference(x.double(), q1, s1, q2, s2, weights, ids, cast=_interpreter_e4m3)
    assert_matches_emulation("out", out, emulated)


def _gpu_tiles():
    """The tile families the GPU runs (the interpreter plans 16-row tiles only): 64-row tiles with x quantised
    first and 256-wide down tiles, the 128-row candidates, 16-row tiles with split-K (even and ragged splits of F)."""
    from flashmoe_science.moe.tiles import GemmTiles
    from flashmoe_science.moe.triton_fp8_gemm import Fp8Tiles

    up = GemmTiles(block_n=BLOCK, block_k=BLOCK, num_warps=8, num_stages=3)
    return {
        "rows-64-x-first": Fp8Tiles(64, 8, up, GemmTiles(block_n=256, block_k=BLOCK, num_warps=8, num_stages=3), False),
        "rows-128": Fp8Tiles(128, 8, up, GemmTiles(block_n=128, block_k=BLOCK, num_warps=8, num_stages=4), False),
        "rows-16-split-3": Fp8Tiles(16, 8, up, GemmTiles(block_n=64, block_k=BLOCK, num_warps=4, num_stages=5,
                                                         split_k=3), True),
        "rows-16-split-2": Fp8Tiles(16, 8, up, GemmTiles(block_n=64, block_k=BLOCK, num_warps=4, num_stages=5,
                                                         split_k=2), True),
    }


@pytest.mark.parametrize("name", ["rows-64-x-first", "rows-128", "rows-16-split-3", "rows-16-split-2"])
def test_gpu_tiles_match_the_emulation_stage_by_stage(name, monkeypatch):
    """Each stage (h and its scales, then the down GEMM on that h) and the layer against the emulation, on the
    tiles the GPU runs: F = 384 splits K evenly in 3 and raggedly in 2."""
    monkeypatch.setenv("FLASHMOE_SCIENCE_POISON", "1")
    num_tokens, d_model, d_ff, num_experts, top_k = 70, 256, 384, 3, 2
    x, _, _, q1, s1, q2, s2 = quantized_experts(num_tokens, d_model, d_ff, num_experts)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts), top_k)
    ids[1, 0] = -1
    out = assert_stages_match_emulation(x, q1, s1, q2, s2, weights, ids, _gpu_tiles()[name], cast=_interpreter_e4m3)
    emulated = fp8_experts_reference(x.double(), q1, s1, q2, s2, weights, ids, cast=_interpreter_e4m3)
    assert_matches_emulation("out", out, emulated)


def _planned_for_the_gpu(monkeypatch, num_tokens, top_k, num_experts, d_model, d_ff):
    """fp8_tile_candidates as an H100/H200 plans them (the planner's interpreter branch switched off; CPU tensors
    size shared memory and SMs as those GPUs)."""
    from flashmoe_science.moe import tiles as moe_tiles
    from flashmoe_science.moe import triton_fp8_gemm

    with monkeypatch.context() as patch:
        for module in (triton_fp8_gemm, moe_tiles):
            patch.setattr(module, "triton_interpreter_on", lambda: False)
        return triton_fp8_gemm.fp8_tile_candidates(num_tokens, top_k, num_experts, d_model, d_ff, torch.device("cpu"))


def _losslessly_quantised(num_tokens, d_model, dtype):
    """x whose 1x128 groups are e4m3 values times a power of two, each group holding +-448 times it: the
    quantisation of x is exact (scale = amax / 448 is that power of two) under any rounding of the cast. Small
    (|x| <= 448 * 2^-10) so that gate stays far from where silu's exp underflows on 100-fold weight blocks: the
    interpreter casts float32 subnormals to e4m3 subnormals instead of zero."""
    groups = -(-d_model // BLOCK)
    q = rne_e4m3(torch.randn(num_tokens, groups * BLOCK) * 100).clamp(-448, 448)
    q[:, ::BLOCK] = 448.0 * torch.randint(0, 2, (num_tokens, groups)).mul(2).sub(1)
    scale = torch.exp2(torch.randint(-16, -9, (num_tokens, groups)).float()).repeat_interleave(BLOCK, dim=1)
    return (q * scale)[:, :d_model].to(dtype)


@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k", [
    (16, 512, 256, 8, 2),  # decode branch: 16-row tiles, x quantised in the gather, split-K down
    (77, 200, 136, 6, 2),  # d and F not multiples of 128: partial weight blocks, a partial h group
    (150, 256, 384, 4, 2),  # 64-row branch and its sweep: 256-wide down tiles, 128-row tiles, x quantised first
])
def test_gpu_planned_tiles_apply_each_block_its_scale(num_tokens, d_model, d_ff, num_experts, top_k, monkeypatch):
    """Every tile config an H100/H200 plans for these dims (fp8_tile_candidates), on weights whose 128x128 block
    scales differ 100-fold and on losslessly quantised x, stage by stage against the emulation to float32's margin:
    a block's partial product scaled by another block's scale would move h's group scales by up to 100x."""
    monkeypatch.setenv("FLASHMOE_SCIENCE_POISON", "1")
    torch.manual_seed(0)
    _, _, _, q1, s1, q2, s2 = quantized_experts(num_tokens, d_model, d_ff, num_experts, block_spread=100.0)
    assert s1.amax() / s1.amin() > 50 and s2.amax() / s2.amin() > 50
    x = _losslessly_quantised(num_tokens, d_model, torch.bfloat16)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts), top_k)
    ids[1, 0] = -1
    for name, tiles in _planned_for_the_gpu(monkeypatch, num_tokens, top_k, num_experts, d_model, d_ff).items():
        try:
            out = assert_stages_match_emulation(x, q1, s1, q2, s2, weights, ids, tiles, cast=_interpreter_e4m3,
                                                scale_rtol=1e-5, max_rerounded=1e-3)
        except AssertionError as error:
            raise AssertionError(f"tiles {name} ({tiles}): {error}") from error
        emulated = fp8_experts_reference(x.double(), q1, s1, q2, s2, weights, ids, cast=_interpreter_e4m3)
        assert_matches_emulation(f"out, tiles {name}", out, emulated)


def test_front_door_runs_the_kernels_fp16(monkeypatch):
    monkeypatch.setenv("FLASHMOE_SCIENCE_POISON", "1")
    x, _, _, q1, s1, q2, s2 = quantized_experts(9, 256, 128, 4, torch.float16)
    logits = torch.randn(9, 4)
    assert "up: triton_fp8_gemm" in describe_moe(x, q1, q2, 2, w1_scale=s1, w2_scale=s2, backend="triton")
    out = fused_moe(x, q1, q2, logits, 2, w1_scale=s1, w2_scale=s2, backend="triton")
    assert out.dtype == torch.float16
    weights, ids = moe_route(logits, 2)
    emulated = fp8_experts_reference(x.double(), q1, s1, q2, s2, weights, ids, cast=_interpreter_e4m3)
    assert_matches_emulation("out", out, emulated)
    empty = fused_moe(x[:0], q1, q2, logits[:0], 2, w1_scale=s1, w2_scale=s2, backend="triton")
    assert empty.shape == (0, 256)


INTERPRETER_CASES = ("test_kernels_match_the_emulation", "test_gpu_tiles_match_the_emulation_stage_by_stage",
                     "test_gpu_planned_tiles_apply_each_block_its_scale", "test_front_door_runs_the_kernels_fp16")
if IN_INTERPRETER:  # the child runs the kernel cases only
    for _name in [n for n in list(globals()) if n.startswith("test_") and n not in INTERPRETER_CASES]:
        del globals()[_name]
else:
    for _name in INTERPRETER_CASES:
        del globals()[_name]
