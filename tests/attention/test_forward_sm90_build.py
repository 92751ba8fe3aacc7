"""The Gluon sm_90 forward without a GPU: its sm_90 build (ptxas and cuobjdump ship with triton) at the tiles the
library launches, the launch arguments a window, softcap, ALiBi or packed batch sets, and builds of those feature
paths (every combination: `benchmarks/tools/sass_attention_forward.py --sweep`). Numerics run on the H200 (test_forward_gpu.py,
test_forward_sm90_masks_gpu.py)."""

from __future__ import annotations

import os
import re

import pytest
import torch

fwd_sm90 = pytest.importorskip("flashmoe_science.attention.hopper.fwd_sm90")
from flashmoe_science.attention.mask import make_mask  # noqa: E402
from flashmoe_science.attention.seqlen import VarlenBatch, ranked_work_list, varlen_tile_offsets  # noqa: E402
from flashmoe_science.attention.hopper.tiles import sm90_forward_tiles  # noqa: E402
from flashmoe_science.attention.tiles import AttentionTiles  # noqa: E402
from flashmoe_science.gluon.build import sass_loops, spill_budget, spill_count  # noqa: E402
from flashmoe_science.gluon.compat import on_tuned_triton  # noqa: E402
from sm90_helpers import HOPPER_TRAITS, hopper_forward_plan, sass_or_skip  # noqa: E402

SMEM_PER_BLOCK = 232448  # sm_90's opt-in limit (ANCHORS.md)

TWO_STAGES = AttentionTiles(128, 128, 8, 2, use_tma=True)
THREE_STAGES = AttentionTiles(128, 64, 8, 3, use_tma=True)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _named(args):
    return dict(zip(fwd_sm90.attention_forward_sm90_kernel.arg_names, args))


def test_varlen_tile_offsets_count_the_real_query_tiles():
    cu = torch.tensor([0, 0, 1, 128, 257, 257, 900], dtype=torch.int32)
    offsets = varlen_tile_offsets(cu, 128)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 0, 1, 2, 4, 4, 10]  # lengths 0, 1, 127, 129, 0, 643


def test_the_causal_path_takes_the_ranked_work_list():
    """The plain causal mask numbers its items heaviest first (work_items.varlen_work): its launch takes
    seqlen.ranked_work_list, every other mask the batch-order list; a list of the other kind is refused."""
    cu = torch.tensor([0, 0, 1, 128, 257, 257, 900], dtype=torch.int32, device="meta")  # shapes: no list is read
    q, lse = _meta(1, 4, 900, 128), _meta(1, 4, 900, dtype=torch.float32)
    launch = lambda causal, tiles: fwd_sm90._launch_args(  # noqa: E731
        q, q, q, q, lse, causal, 0.1, TWO_STAGES if not causal else THREE_STAGES, 132, 1, False, None, None,
        VarlenBatch(cu, cu, tiles))
    ranked, plain = ranked_work_list(cu, 128, 900), varlen_tile_offsets(cu, 128)
    assert _named(launch(True, ranked)[1])["TILE_OFFSETS"] is ranked
    assert _named(launch(False, plain)[1])["TILE_OFFSETS"] is plain
    for causal, tiles in ((True, plain), (False, ranked)):
        with pytest.raises(ValueError, match="tile_offsets"):
            launch(causal, tiles)


def test_plain_calls_leave_every_new_argument_none():
    """A plain call passes None (a constexpr) for every mask/ALiBi/varlen argument: it compiles to the plain kernel."""
    q, lse = _meta(2, 4, 300, 64), _meta(2, 4, 300, dtype=torch.float32)
    for causal in (False, True):
        _, args, constexprs = fwd_sm90._launch_args(q, q, q, q, lse, causal, 0.125, TWO_STAGES, 132, 1, False)
        named = _named(args)
        new = ("window_left", "window_right", "softcap_scale", "ALIBI_SLOPES", "alibi_stride_b", "alibi_stride_h",
               "CU_SEQLENS_Q", "CU_SEQLENS_K", "TILE_OFFSETS", "num_seqs", "O", "stride_oh", "stride_om", "head_dim")
        assert all(named[name] is None for name in new)
        assert constexprs["CAUSAL"] == causal
        assert not any(constexprs[f] for f in ("MASK_LEFT", "MASK_RIGHT", "SOFTCAP", "ALIBI", "VARLEN"))


def test_mask_alibi_and_varlen_arguments():
    """The window as MASK_LEFT/MASK_RIGHT (causal with a left bound included), softcap's scales (mask.kernel_args),
    ALiBi slopes of (H,) read with a zero batch stride, and a packed batch: (1, H, total, D) views, the grid bounded
    by cdiv(total_q, 128) query tiles per head (no CTA without work), num_work read by the kernel."""
    total_q, total_k = 1000, 700
    q, k = _meta(1, 4, total_q, 128), _meta(1, 2, total_k, 128)
    lse = _meta(1, 4, total_q, dtype=torch.float32)
    cu = torch.empty(6, dtype=torch.int32, device="meta")
    slopes = torch.empty(4, device="meta")
    mask = make_mask(True, (256, -1), 30.0)
    grid, args, constexprs = fwd_sm90._launch_args(
        q, k, k, q, lse, True, 0.1, THREE_STAGES, 132, 2, True, mask, slopes, VarlenBatch(cu, cu, cu))
    named = _named(args)
    assert grid == (min(132, 4 * 8),)
    assert (constexprs["CAUSAL"], constexprs["MASK_LEFT"], constexprs["MASK_RIGHT"]) == (False, True, True)
    assert (named["window_left"], named["window_right"]) == (256, 0)
    assert constexprs["SOFTCAP"] and named["softcap_scale"] == pytest.approx(0.1 / 30.0)
    assert named["qk_scale"] == pytest.approx(30.0 * 1.4426950408889634)
    assert constexprs["ALIBI"] and named["alibi_stride_b"] == 0 and named["alibi_stride_h"] == 1
    assert constexprs["VARLEN"] and named["num_seqs"] == 5 and named["num_work"] is None
    assert named["O"] is q and (named["stride_oh"], named["stride_om"], named["head_dim"]) == q.stride()[1:3] + (128,)
    with pytest.raises(ValueError, match="right bound"):  # a window's right bound needs three stages, as causal
        fwd_sm90._launch_args(q, k, k, q, lse, False, 0.1, TWO_STAGES, 132, 2, True, make_mask(False, (-1, 4)))
    with pytest.raises(ValueError, match="views"):
        fwd_sm90._launch_args(_meta(2, 4, 8, 128), k, k, _meta(2, 4, 8, 128), lse, False, 0.1, TWO_STAGES, 132, 1,
                              False, None, None, VarlenBatch(cu, cu, cu))


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
def test_every_feature_at_once_builds_for_sm90():
    """Window (both sides), softcap, ALiBi and a packed batch in one D=128 build: one tanh.approx per score (no exp2
    form), the ragged rows' masked register store beside the TMA stores, the shared memory within the H200's."""
    compiled = fwd_sm90.compile_offline(128, False, TWO_STAGES, 132, mask=make_mask(False, (100, 20), 30.0),
                                        alibi=True, varlen=True)
    sass = sass_or_skip(compiled)
    assert len(re.findall(r"\bMUFU\.TANH\b", sass)) == len(re.findall(r"\bMUFU\.EX2\b", sass)) - 16
    assert re.search(r"\bUTMASTG\b", sass) and re.search(r"\bSTG\.E\b", sass)
    assert compiled.metadata.shared <= SMEM_PER_BLOCK


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
def test_varlen_causal_overlapped_items_build_for_sm90():
    """The packed batch on the short-causal plan: 64-key tiles, three stages, two Q buffers, items overlapped."""
    compiled = fwd_sm90.compile_offline(64, True, THREE_STAGES, 132, q_buffers=2, cross_item=True, varlen=True)
    assert re.search(r"\bHGMMA\.64x64x16\.F32\.BF16\b", sass_or_skip(compiled))


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("band", [4])
def test_varlen_causal_bands_build_for_sm90(band):
    """The causal packed batch's work list in bands (tiles.sm90_varlen_band: four for MHA, one with GQA) on the plan
    packed causal batches take at D=128 (128-key tiles, two stages, two Q buffers): both products on the tensor
    cores."""
    compiled = fwd_sm90.compile_offline(128, True, TWO_STAGES, 132, q_buffers=2, varlen=True, band=band)
    assert re.search(r"\bHGMMA\.64x128x16\.F32\.BF16\b", sass_or_skip(compiled))
    assert compiled.metadata.shared <= SMEM_PER_BLOCK


# (head dim, causal, seqlen, Q buffers, cross-item) -> LDL + STL of the triton 3.6 build: the persistent kernel
# spills a few values at the work-item boundary only (docs/perf-notes.md), none at short causal rows' 64-key tiles.
# D=64 with 128-key tiles runs three consumers (160 registers; causal from 16384 rows) in an issue rotation: 4 at the
# item boundary non-causal, 391 causal (the per-item mask set-up; one value per key tile), see
# test_three_consumer_builds_for_sm90.
# The causal budgets are those of the kernel whose plain causal path shares the mask blocks (key_tile_range, visible)
# with windows and varlen; the H200 measured it at 620 TFLOP/s (D=128, L=8192) and 550 (D=256, L=2048) causal.
CASES = {
    (64, False, 2048, 2, True): 4,
    (64, True, 16384, 2, True): 391,
    (128, False, 2048, 1, False): 65,
    (128, True, 512, 2, False): 0,
    (128, True, 4096, 1, False): 225,
    (256, True, 2048, 1, False): 75,
}


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "D{}-{}-L{}-q{}{}".format(
    c[0], "causal" if c[1] else "full", c[2], c[3], "-cross" if c[4] else ""))
def test_builds_for_sm90_with_tma_and_register_operand_pv(case):
    """S = Q Kᵀ from shared memory, O += P V with P from registers, K/V by TMA loads, O by TMA stores, the shared
    memory within a block's, spills no more than the tuned build's."""
    head_dim, causal, seqlen, q_buffers, cross_item = case
    tiles = sm90_forward_tiles(head_dim, causal, seqlen)
    compiled = fwd_sm90.compile_offline(head_dim, causal, tiles, num_ctas=132, q_buffers=q_buffers,
                                        cross_item=cross_item)
    sass = sass_or_skip(compiled)
    assert re.search(r"\bHGMMA\.64x%dx16\.F32\.BF16 R\d+, gdesc" % tiles.block_n, sass)  # S: both from smem
    assert re.search(r"\bHGMMA\.64x%dx16\.F32\.BF16 R\d+, R\d+, gdesc" % head_dim, sass)  # P·V: P in registers
    assert re.search(r"\bUTMALDG\b", sass) and re.search(r"\bUTMASTG\b", sass)
    assert spill_count(sass) <= spill_budget(CASES[case]), "spills grew"
    assert compiled.metadata.shared <= SMEM_PER_BLOCK


def test_bias_arguments_by_tma_and_by_loads():
    """A bias broadcast over the batch (stride 0 after expand) goes to the producer's TMA: a descriptor over its
    one batch entry, coordinate steps (0, 1), boxes of one consumer's rows x one key tile; one broadcast over the
    queries goes to the consumers' loads with its strides over the full problem (0 where it broadcasts). The bias
    joins the scores in the units they are in: log2 e / qk_scale of the raw product (ALiBi's linear form included),
    log2 e after a softcap with ALiBi."""
    q, k = _meta(2, 4, 300, 128), _meta(2, 2, 512, 128)
    lse = _meta(2, 4, 300, dtype=torch.float32)
    plane = _meta(1, 4, 300, 512)
    _, args, constexprs = fwd_sm90._launch_args(q, k, k, q, lse, True, 0.1, TWO_STAGES, 132, 1, False,
                                                attn_bias=plane.expand(2, 4, 300, 512), bias_tma=True)
    named = _named(args)
    assert constexprs["HAS_BIAS"] and constexprs["BIAS_TMA"] and named["BIAS"] is None
    assert named["bias_desc"].shape == [1, 4, 300, 512] and named["bias_desc"].block_shape == [1, 1, 64, 128]
    assert (named["bias_stride_b"], named["bias_stride_h"]) == (0, 1)
    assert named["bias_log2"] * named["qk_scale"] == pytest.approx(1.4426950408889634)

    padding = _meta(2, 1, 1, 512, dtype=torch.float32)
    slopes = torch.empty(4, device="meta")
    _, args, constexprs = fwd_sm90._launch_args(q, k, k, q, lse, False, 0.1, TWO_STAGES, 132, 1, False, None, slopes,
                                                attn_bias=padding)
    named = _named(args)
    assert constexprs["HAS_BIAS"] and not constexprs["BIAS_TMA"] and named["bias_desc"] is None
    assert named["BIAS"] is padding
    assert (named["bias_stride_b"], named["bias_stride_h"], named["bias_stride_m"], named["bias_stride_n"]) == (
        512, 0, 0, 1)
    # ALiBi without a softcap rides in the product's start (raw units); with one the scores are in log2 units
    assert named["bias_log2"] * named["qk_scale"] == pytest.approx(1.4426950408889634)
    _, args, _ = fwd_sm90._launch_args(q, k, k, q, lse, False, 0.1, TWO_STAGES, 132, 1, False,
                                       make_mask(False, None, 30.0), slopes, attn_bias=padding)
    assert _named(args)["bias_log2"] == pytest.approx(1.4426950408889634)
    with pytest.raises(ValueError, match="bias_tma"):
        fwd_sm90._launch_args(q, k, k, q, lse, False, 0.1, TWO_STAGES, 132, 1, False, attn_bias=padding,
                              bias_tma=True)


def test_three_consumer_launch_arguments():
    """192-row tiles: the work grid counts 192-row query tiles, NUM_CONSUMERS = 3 goes to the kernel with the
    three-consumer launch options; an attn_bias and e4m3 inputs are refused (two consumers only)."""
    q = _meta(2, 4, 1000, 64)
    lse = _meta(2, 4, 1000, dtype=torch.float32)
    three = AttentionTiles(192, 128, 12, 2, use_tma=True)
    grid, args, constexprs = fwd_sm90._launch_args(q, q, q, q, lse, False, 0.125, three, None, 2, True)
    assert constexprs["NUM_CONSUMERS"] == 3 and grid == (2 * 4 * 6,)  # cdiv(1000, 192) = 6 tiles per head
    assert _named(args)["num_m_tiles"] == 6
    with pytest.raises(ValueError, match="two consumer warpgroups"):
        fwd_sm90._launch_args(q, q, q, q, lse, False, 0.125, three, None, 1, False,
                              attn_bias=_meta(2, 4, 1000, 1000))


# (name, compile_offline arguments, LDL + STL of the triton 3.6 build). TMA: the D=128 causal 4k plan with a bf16
# bias (two stages; the bias in the scores' start) and with a softcap (the bias added after the tanh), a float32
# bias's 64-key tiles, D=64 with overlapped items, D=256 (added by the softmax); loads: a key-padding bias (the
# fallback: its per-element addresses spill).
BIAS_BUILDS = {
    "tma-d128-causal": (dict(head_dim=128, causal=True, tiles=TWO_STAGES, bias="tma"), 252),
    "tma-d128-causal-softcap": (dict(head_dim=128, causal=True, tiles=TWO_STAGES, bias="tma",
                                     mask=make_mask(True, None, 30.0)), 290),
    "tma-d128-fp32": (dict(head_dim=128, causal=True, tiles=AttentionTiles(128, 64, 8, 2, use_tma=True), bias="tma",
                           bias_dtype=torch.float32), 0),
    "tma-d64-cross": (dict(head_dim=64, causal=False, tiles=TWO_STAGES, bias="tma", q_buffers=2, cross_item=True), 0),
    "tma-d256-causal": (dict(head_dim=256, causal=True, tiles=AttentionTiles(128, 64, 8, 2, use_tma=True),
                             bias="tma"), 84),
    "loads-d128": (dict(head_dim=128, causal=False, tiles=TWO_STAGES, bias="loads"), 1149),
}


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("name", list(BIAS_BUILDS))
def test_bias_builds_for_sm90(name):
    """TMA: the bias comes through the TMA loads alone (no global loads in the consumers), the bias ring within the
    shared memory; loads: the consumers' global loads. Spills no more than the tuned build's."""
    kwargs, spills = BIAS_BUILDS[name]
    kwargs = dict(kwargs)
    head_dim, causal, tiles = kwargs.pop("head_dim"), kwargs.pop("causal"), kwargs.pop("tiles")
    compiled = fwd_sm90.compile_offline(head_dim, causal, tiles, 132, kwargs.pop("q_buffers", 1),
                                        kwargs.pop("cross_item", False), **kwargs)
    sass = sass_or_skip(compiled)
    assert bool(re.search(r"\bLDG\.E", sass)) == (kwargs["bias"] == "loads")
    assert spill_count(sass) <= spill_budget(spills), "spills grew"
    assert compiled.metadata.shared <= SMEM_PER_BLOCK


# Bands as `auto` plans them on a 132-SM Hopper (tiles.sm90_band_schedule, sm90_plan_length): one CTA per query tile
# (L=32k, 16 heads), persistent rounds (L=128k, 4 heads), a short band on short causal rows' overlapped 64-key tiles
BAND_CASES = {"per-tile": (1, 16, 32768, (4095, 0)), "persistent": (1, 4, 131072, (4095, 0)),
              "short-band": (1, 16, 32768, (511, 0))}


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("name", list(BAND_CASES))
def test_band_plans_build_for_sm90(name):
    """Every schedule the band rule picks builds with the window's mask: both products on the tensor cores, TMA in
    and out, the shared memory within a block's."""
    batch, heads, seqlen, window = BAND_CASES[name]
    _, plan, _ = hopper_forward_plan(batch, heads, seqlen, window)
    compiled = fwd_sm90.compile_offline(128, True, plan.tiles, HOPPER_TRAITS[0] if plan.persistent else None,
                                        plan.q_buffers, plan.cross_item, mask=make_mask(True, window))
    sass = sass_or_skip(compiled)
    assert re.search(r"\bHGMMA\.64x%dx16\.F32\.BF16 R\d+, gdesc" % plan.tiles.block_n, sass)
    assert re.search(r"\bHGMMA\.64x128x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)
    assert re.search(r"\bUTMALDG\b", sass) and re.search(r"\bUTMASTG\b", sass)
    assert compiled.metadata.shared <= SMEM_PER_BLOCK


# (name, compile_offline arguments, LDL + STL of the triton 3.6 build, LDL + STL in each key loop[, LDL + STL of
# the triton 3.9 build where it passes 3.6's with build.UNTUNED_SPILL_SLACK: ALiBi's key term spills 28-38 values
# per key tile there, a window's per-item set-up 367 values]) of the three-consumer forward (192-row items at 160 registers: D <= 64 with 128-key tiles,
# tiles.sm90_forward_consumers): the plans of B1 H16 L16k (non-causal persistent and overlapped; causal one CTA per
# tile), the causal persistent plan, a packed batch without and with a right bound (the two-stage ring), a window,
# softcap with ALiBi, fp16, D=32. The per-item spills come from the mask and work-item set-up; the causal loops keep
# one to five values in local memory per key tile, the masked loops of a packed causal batch and a window 5-12.
THREE_CONSUMERS = AttentionTiles(192, 128, 12, 2, use_tma=True)
THREE_CONSUMERS_CAUSAL = AttentionTiles(192, 128, 12, 3, use_tma=True)
THREE_CONSUMER_BUILDS = {
    "d64-full-cross": (dict(head_dim=64, causal=False, tiles=THREE_CONSUMERS, q_buffers=2, cross_item=True), 4, 0),
    "d64-causal-per-tile": (dict(head_dim=64, causal=True, tiles=THREE_CONSUMERS_CAUSAL), 287, 2),
    "d64-causal-cross": (dict(head_dim=64, causal=True, tiles=THREE_CONSUMERS_CAUSAL, q_buffers=2, cross_item=True),
                         391, 5),
    "d64-varlen-cross": (dict(head_dim=64, causal=False, tiles=THREE_CONSUMERS, q_buffers=2, cross_item=True,
                              varlen=True), 4, 0),
    "d64-varlen-causal": (dict(head_dim=64, causal=True, tiles=THREE_CONSUMERS, q_buffers=2, varlen=True), 157, 12),
    "d64-window": (dict(head_dim=64, causal=False, tiles=THREE_CONSUMERS_CAUSAL, q_buffers=2,
                        mask=make_mask(False, (100, 20))), 35, 5, 367),
    "d64-softcap-alibi": (dict(head_dim=64, causal=False, tiles=THREE_CONSUMERS, q_buffers=2, cross_item=True,
                               mask=make_mask(False, None, 30.0), alibi=True), 90, 0, 789),
    "d64-causal-alibi": (dict(head_dim=64, causal=True, tiles=THREE_CONSUMERS_CAUSAL, q_buffers=2, alibi=True),
                         96, 0, 686),
    "d64-fp16": (dict(head_dim=64, causal=False, tiles=THREE_CONSUMERS, q_buffers=2, cross_item=True,
                      dtype=torch.float16), 4, 0),
    "d32": (dict(head_dim=32, causal=False, tiles=THREE_CONSUMERS, q_buffers=2, cross_item=True), 16, 0),
}


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("name", list(THREE_CONSUMER_BUILDS))
def test_three_consumer_builds_for_sm90(name):
    """192-row items on three consumer warpgroups: 16 warps launched at 128 registers (Triton pads the producer
    warp to a warpgroup), setmaxnreg to 160 for the worker consumers, three times each product's HGMMAs of the
    two-consumer kernel's share, both products on the tensor cores, spills within the tuned build's (the whole
    kernel, and each consumer's key-tile loop)."""
    kwargs, spills, loop_spills, *untuned = THREE_CONSUMER_BUILDS[name]
    kwargs = dict(kwargs)
    head_dim, causal, tiles = kwargs.pop("head_dim"), kwargs.pop("causal"), kwargs.pop("tiles")
    compiled = fwd_sm90.compile_offline(head_dim, causal, tiles, 132, kwargs.pop("q_buffers", 1),
                                        kwargs.pop("cross_item", False), **kwargs)
    sass = sass_or_skip(compiled)
    assert compiled.metadata.num_warps == 16
    assert re.search(r"\bUSETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, 0xa0\b", sass)  # 160 registers
    operands = r"\.F32\.BF16" if kwargs.get("dtype", torch.bfloat16) == torch.bfloat16 else r"\.F32"  # fp16: no suffix
    assert re.search(r"\bHGMMA\.64x128x16%s R\d+, gdesc" % operands, sass)  # S: both from smem
    assert re.search(r"\bHGMMA\.64x%dx16%s R\d+, R\d+, gdesc" % (head_dim, operands), sass)  # P·V
    assert spill_count(sass) <= max([spill_budget(spills)] + ([] if on_tuned_triton() else untuned)), "spills grew"
    loops = [loop for loop in sass_loops(sass) if loop["HGMMA"] == head_dim // 16 + tiles.block_n // 16]
    assert len(loops) >= 6  # two per consumer (the overlapped items' loop and the last item's)
    assert max(loop["LDL"] + loop["STL"] for loop in loops) <= spill_budget(loop_spills), "the key loop spills"
    assert compiled.metadata.shared <= SMEM_PER_BLOCK
