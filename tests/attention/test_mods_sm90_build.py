"""The sm_90 Gluon kernels with a user mask_mod, without a GPU: a `@triton.jit` mod that loads from its captured
tensors called from a Gluon kernel on tensors in wgmma layouts (the smallest such kernel, built for sm_90), the mod
forward's and the one-pass backward's offline builds (dense and packed, each mask of bench/mask_mods.py) and their
spills, their launch arguments, the block mask's walk order, and the planner picking the Gluon kernels for a mod on
Hopper when asked for. Numerics run on the GPU (test_mods_sm90_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch
import triton

pytest.importorskip("triton.experimental.gluon")

from flashmoe_science.attention.hopper import backend, bwd_sm90, fwd_sm90  # noqa: E402
from flashmoe_science.attention.hopper.bwd_common import offline_features  # noqa: E402
from flashmoe_science.backends import NoBackend  # noqa: E402
from flashmoe_science.attention.hopper.tiles import sm90_forward_tiles  # noqa: E402
from flashmoe_science.attention.mask import make_mask  # noqa: E402
from flashmoe_science.attention.mods import (FULL, PARTIAL, BlockMask, MaskMod, ScoreMod, TileLists,  # noqa: E402
                                             clamp_index)
from flashmoe_science.attention.plan import plan_attention  # noqa: E402
from flashmoe_science.attention.problem import dense_problem  # noqa: E402
from flashmoe_science.attention.tiles import AttentionTiles  # noqa: E402
from flashmoe_science.bench import mask_mods  # noqa: E402
from flashmoe_science.device import DeviceTraits  # noqa: E402
from flashmoe_science.gluon import availability  # noqa: E402
from flashmoe_science.gluon.build import sass_loops, spill_budget, spill_count  # noqa: E402
from flashmoe_science.gluon.compat import gl, gluon, on_tuned_triton  # noqa: E402
from flashmoe_science.gluon.sm90 import compile_offline  # noqa: E402
import mod_cases  # noqa: E402
from sm90_helpers import sass_or_skip  # noqa: E402

OFFLINE = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build")


def _meta(*shape, dtype=torch.int32):
    return torch.empty(*shape, dtype=dtype, device="meta")


@gluon.jit
def _mod_in_wgmma_layout(OUT, mask_mod, mask_args, seqlen):
    """The consumers' situation: positions in the wgmma accumulator's row and column slices, clamped into the
    sequence, through the user's mod (which may `tl.load` its captured tensors at them)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
    seen = mask_mod(1, 2, gl.expand_dims(clamp_index(rows, seqlen), 1), gl.expand_dims(clamp_index(cols, seqlen), 0),
                    *mask_args)
    gl.store(OUT + rows, gl.sum(gl.where(seen, 1.0, 0.0), 1))


@pytest.mark.sm90_build
@OFFLINE
@pytest.mark.parametrize("mod", [mask_mods.document_window, mask_mods.neighbour_list], ids=lambda f: f.fn.__name__)
def test_a_triton_mod_with_loads_builds_inside_a_gluon_kernel(mod):
    """tl.load at broadcast indices of a captured tensor's pointer compiles in Gluon: the loads take the layouts of
    the index tensors (global loads in the SASS), nothing to preload on the mod's behalf."""
    compiled = compile_offline(_mod_in_wgmma_layout, [_meta(64, dtype=torch.float32), mod, (_meta(4, 4096, 16),), 100],
                               {"mask_mod": mod}, 2)
    assert "LDG" in sass_or_skip(compiled)


# (head dim, packed, causal, mask) -> LDL + STL of the whole build and the most in one key loop, on the tuned triton
# (compat.TUNED_TRITON, 3.6); the plain build of the same plan first, for comparison. The mod is evaluated on column
# slices of the tile (fwd_sm90._mod_width: 16 keys, 64 packed): at D=128 on two consumers (240 registers) the dense
# loop keeps 17-18 values per key tile in local memory beside S, O and the pending P·V operand (the plain loop 4;
# the whole tile at once: 36-49; the neighbour list's 16 slots 98), the packed one 14; D=64 and three consumers (160
# registers) none. docs/perf-notes.md has the widths tried, on triton 3.9 too.
MOD_BUILDS = {
    (128, False, True, "plain"): (225, 4),
    (128, False, True, "document_window"): (182, 18),
    (128, False, True, "prefix_lm"): (142, 17),
    (128, False, True, "head_windows"): (142, 18),
    (128, False, True, "neighbour_list"): (487, 98),
    (128, True, True, "document_window"): (131, 14),
    (64, False, True, "document_window"): (0, 0),
    (64, False, True, "head_windows"): (0, 0),
    (64, True, True, "document_window"): (0, 0),
    (64, False, False, "plain"): (12, 2),
    (64, False, False, "prefix_lm"): (31, 0),
    (64, False, False, "bare"): (5, 0),
}


@triton.jit
def _bare_causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _mod(name):
    tables = {"document_window": _meta(4, 4096), "prefix_lm": _meta(4), "head_windows": _meta(16),
              "neighbour_list": _meta(4, 4096, 16)}
    if name == "plain":
        return None
    if name == "bare":
        return MaskMod(_bare_causal)
    return MaskMod(getattr(mask_mods, name), tables[name])


@pytest.mark.sm90_build
@OFFLINE
@pytest.mark.parametrize("case", list(MOD_BUILDS), ids=lambda c: "D{}-{}-{}-{}".format(
    c[0], "varlen" if c[1] else "dense", "causal" if c[2] else "full", c[3]))
def test_mod_forward_builds_for_sm90(case):
    """The mod forward at the plan's tiles: both products on the tensor cores, K/V by TMA, spills within the
    recorded budget (whole kernel and key loops)."""
    head_dim, varlen, causal, name = case
    tiles = sm90_forward_tiles(head_dim, causal, 4096)
    compiled = fwd_sm90.compile_offline(head_dim, causal, tiles, 132, 2 if tiles.block_m == 192 else 1, False,
                                        varlen=varlen, mask_mod=_mod(name))
    sass = sass_or_skip(compiled)
    assert "UTMALDG" in sass and "HGMMA" in sass
    if name != "plain":
        assert "LDG" in sass  # the block mask's lists (and the mod's tables)
    spills, loop_spills = MOD_BUILDS[case]
    if on_tuned_triton():  # elsewhere the spills outside the key loop vary by hundreds (3.9, packed: 529 vs 257)
        assert spill_count(sass) <= spills, "spills grew"
    loops = [loop for loop in sass_loops(sass) if loop["HGMMA"] == head_dim // 16 + tiles.block_n // 16]
    assert max(loop["LDL"] + loop["STL"] for loop in loops) <= spill_budget(loop_spills), "the key loop spills"


def _launch(mask_mod=None, blocks=None, tiles=AttentionTiles(128, 128, 8, 2, use_tma=True), **kwargs):
    q = _meta(2, 4, 300, 128, dtype=torch.bfloat16)
    lse = _meta(2, 4, 300, dtype=torch.float32)
    return fwd_sm90._launch_args(q, q, q, q, lse, False, 0.1, tiles, 132, 1, False, mask_mod=mask_mod,
                                 blocks=blocks, **kwargs)


def _blocks(block_m=128, block_n=128):
    lists = TileLists(*(_meta(*shape) for shape in ((2, 4, 3), (2, 4, 3, 3)) * 2))
    return BlockMask(block_m, block_n, _meta(2, 4, 3, 3, dtype=torch.int8), lists, None)


def test_mod_launch_arguments():
    """Without a mod every new argument is None (a constexpr: the plain build); with one, the function, its tensors,
    the counts and the walk order of a block mask at the launch's tiles; refused at other tiles and beside softcap,
    ALiBi or a bias."""
    names = fwd_sm90.attention_forward_sm90_kernel.arg_names
    plain = dict(zip(names, _launch()[1]))
    assert all(plain[n] is None for n in ("mask_mod", "mask_mod_args", "FULL_COUNTS", "WALK_TILES", "list_len"))
    assert _launch()[2]["MASK_MOD"] is False
    mod, blocks = _mod("document_window"), _blocks()
    _, args, constexprs = _launch(mod, blocks)
    named = dict(zip(names, args))
    assert constexprs["MASK_MOD"] and named["mask_mod"] is mod.fn and named["mask_mod_args"] == mod.tensors
    assert named["WALK_TILES"].shape == (2, 4, 3, 3) and (named["mod_q_tiles"], named["list_len"]) == (3, 3)
    with pytest.raises(ValueError, match="block mask at the launch's 128x128 tiles"):
        _launch(mod, _blocks(128, 64))
    with pytest.raises(ValueError, match="mask_mod and score_mod beside causal"):
        _launch(mod, blocks, mask=make_mask(False, None, 30.0))
    assert plain["score_mod"] is None and plain["score_mod_args"] is None and not _launch()[2]["SCORE_MOD"]
    score = ScoreMod(mod_cases.head_slope, _meta(4, dtype=torch.float32), grad=mod_cases.unit_grad)
    _, args, constexprs = _launch(score_mod=score)  # alone: no block mask
    named = dict(zip(names, args))
    assert constexprs["SCORE_MOD"] and not constexprs["MASK_MOD"] and named["mask_mod"] is None
    assert named["score_mod"] is score.fn and named["score_mod_args"] == score.tensors
    _, args, constexprs = _launch(mod, blocks, score_mod=score)
    assert constexprs["SCORE_MOD"] and constexprs["MASK_MOD"]
    with pytest.raises(ValueError, match="score_mod beside causal"):
        _launch(score_mod=score, alibi_slopes=_meta(4, dtype=torch.float32))


def test_the_walk_lists_full_tiles_then_partial_ones():
    states = torch.tensor([[[[PARTIAL, 0, FULL, PARTIAL, FULL], [0, 0, 0, 0, 0]]]], dtype=torch.int8)
    walk = BlockMask(64, 64, states, TileLists.of(states), None).walk
    assert walk[0, 0, 0].tolist() == [2, 4, 0, 3, 1] and walk.dtype == torch.int32
    assert walk[0, 0, 1, 0] == 0  # a query tile that sees nothing streams one empty tile, masked whole


@pytest.fixture
def on_hopper(monkeypatch):
    """CPU tensors planned as on a 132-SM Hopper with the Gluon kernels on."""
    monkeypatch.setattr(backend, "_on_hopper", lambda q: True)
    monkeypatch.setattr(backend, "device_traits", lambda device: DeviceTraits((9, 0), 132, 232448))
    monkeypatch.setattr(availability, "_failure", None)


def test_a_mod_plans_the_gluon_kernels_when_asked_for(on_hopper, monkeypatch):
    """Hopper's forward and backward declare mask_mod (beside causal, a window and varlen), taken when
    backend='hopper' asks for them: auto keeps the Triton forward for a mask of mostly partial tiles (windows of 32
    keys: every visited tile) and takes the Gluon backward at D=128 (the Triton one at D=64, not measured), and says
    why. The backward's plan names the block-mask walk; deterministic and D=256 backwards are refused by name."""
    q = torch.randn(1, 4, 256, 128, dtype=torch.bfloat16)
    mod = MaskMod(mask_mods.head_windows, torch.full((16,), 32, dtype=torch.int32))
    auto = plan_attention(dense_problem(q, q, q, causal=True, mask_mod=mod)[0])
    assert auto.backend != "hopper" and "100% of the mask_mod's visited tiles are partial" in \
        auto.forward_choice.why_not("hopper")
    assert auto.backward_choice.plan.backend == "hopper" and auto.backward_choice.plan.mask_mod
    narrow = torch.randn(1, 4, 4096, 64, dtype=torch.bfloat16)
    auto = plan_attention(dense_problem(narrow, narrow, narrow, causal=True, mask_mod=mod)[0])
    assert auto.backward_choice.plan.backend != "hopper"
    assert "mask_mod and score_mod backward runs only when asked for" in auto.backward_choice.why_not("hopper")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a backend asked for by name plans CPU tensors only under it
    plan = plan_attention(dense_problem(q, q, q, causal=True, mask_mod=mod, backend="hopper")[0])
    assert plan.backend == "hopper"
    backward = plan.backward_choice.plan
    assert backward.backend == "hopper" and backward.mask_mod and "block mask" in backward.title
    with pytest.raises(NoBackend, match="deterministic dQ adds"):
        plan_attention(dense_problem(q, q, q, causal=True, mask_mod=mod, backend="hopper",
                                     deterministic=True)[0]).backward_choice
    wide = torch.randn(1, 4, 256, 256, dtype=torch.bfloat16)
    with pytest.raises(NoBackend, match="head dims up to 128"):
        plan_attention(dense_problem(wide, wide, wide, mask_mod=mod, backend="hopper")[0]).backward_choice
    with pytest.raises(ValueError, match="mask_mod does not combine with softcap"):
        dense_problem(q, q, q, softcap=30.0, mask_mod=mod, backend="hopper")

def test_auto_takes_the_gluon_mod_forward_where_few_visited_tiles_are_partial(on_hopper, monkeypatch):
    """backend.mod_forward_refusal: a causal mod over 2048 rows (16 diagonal tiles of 136 visited: 12%) runs the
    Gluon forward under auto, over 256 rows (2 of 3) the Triton one; D=64 is not measured; the share is read once
    per mod, mask and shape, and not while a CUDA graph is captured."""
    monkeypatch.setattr(backend, "_MOD_SHARES", {})
    mod = MaskMod(mask_mods.causal)
    long, short = (torch.randn(1, 4, n, 128, dtype=torch.bfloat16) for n in (2048, 256))
    monkeypatch.setattr(backend, "capturing", lambda device: True)
    captured = plan_attention(dense_problem(long, long, long, mask_mod=mod)[0])
    assert captured.backend != "hopper" and "not while a CUDA graph" in captured.forward_choice.why_not("hopper")
    monkeypatch.setattr(backend, "capturing", lambda device: False)
    auto = plan_attention(dense_problem(long, long, long, mask_mod=mod)[0])
    assert auto.backend == "hopper" and auto.backward_choice.plan.backend == "hopper"
    assert list(backend._MOD_SHARES.values()) == [16 / 136]
    monkeypatch.setattr(backend, "call_block_mask", None)  # remembered: not built again
    assert plan_attention(dense_problem(long, long, long, mask_mod=mod)[0]).backend == "hopper"
    monkeypatch.undo()
    monkeypatch.setattr(backend, "_MOD_SHARES", {})
    monkeypatch.setattr(backend, "_on_hopper", lambda q: True)
    monkeypatch.setattr(backend, "device_traits", lambda device: DeviceTraits((9, 0), 132, 232448))
    monkeypatch.setattr(availability, "_failure", None)
    auto = plan_attention(dense_problem(short, short, short, mask_mod=mod)[0])
    assert auto.backend != "hopper" and "67% of the mask_mod's visited tiles" in auto.forward_choice.why_not("hopper")
    narrow = torch.randn(1, 4, 2048, 64, dtype=torch.bfloat16)
    assert "measured at D=128" in plan_attention(dense_problem(narrow, narrow, narrow, mask_mod=mod)[0]
                                                 ).forward_choice.why_not("hopper")


def test_a_score_mod_plans_the_gluon_forward_when_asked_for(on_hopper, monkeypatch):
    """The Gluon forward and backward take a score_mod (alone or beside a mask_mod; the plans say so) when
    backend='hopper' asks for them; auto keeps the Triton forward, and the Gluon backward at D=128 only, and says
    why."""
    q = torch.randn(1, 4, 2048, 128, dtype=torch.bfloat16)
    score = ScoreMod(mod_cases.tanh_softcap, grad=mod_cases.tanh_softcap_grad)
    auto = plan_attention(dense_problem(q, q, q, causal=True, score_mod=score)[0])
    assert auto.backend != "hopper" and "0.68-0.96x the Triton score_mod forward" in \
        auto.forward_choice.why_not("hopper")
    assert auto.backward_choice.plan.backend == "hopper"  # at D=128 it measured faster than the Triton backward
    narrow = torch.randn(1, 4, 2048, 64, dtype=torch.bfloat16)
    auto = plan_attention(dense_problem(narrow, narrow, narrow, causal=True, score_mod=score)[0])
    assert "measured at D=128" in auto.backward_choice.why_not("hopper")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a backend asked for by name plans CPU tensors only under it
    for mask_mod in (None, MaskMod(mask_mods.causal)):
        plan = plan_attention(dense_problem(q, q, q, mask_mod=mask_mod, score_mod=score, backend="hopper")[0])
        assert plan.backend == "hopper" and plan.backward_choice.plan.backend == "hopper"
        assert "score_mod on every visited score" in plan.forward_choice.plan.describe(plan.problem, "runs", "", "")
        assert "score_mod and its derivative on every visited score" in plan.backward_choice.plan.title


@pytest.mark.sm90_build
@OFFLINE
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("name", ["softcap", "slope_and_prefix"])
def test_score_mod_forward_builds_for_sm90(name, varlen):
    """The score_mod forward (D=128, causal, the plan's tiles): a softcap mod alone, and a per-head slope table's
    ALiBi beside the prefix-LM mask_mod, its key loop's spills within the recorded budget."""
    tiles = sm90_forward_tiles(128, True, 4096)
    if name == "softcap":
        score, mask = ScoreMod(mod_cases.tanh_softcap), None
    else:
        score, mask = ScoreMod(mod_cases.head_slope, _meta(16, dtype=torch.float32)), _mod("prefix_lm")
    compiled = fwd_sm90.compile_offline(128, True, tiles, 132, 1, False, varlen=varlen, mask_mod=mask,
                                        score_mod=score)
    sass = sass_or_skip(compiled)
    assert "UTMALDG" in sass and "HGMMA" in sass
    loops = [loop for loop in sass_loops(sass) if loop["HGMMA"] == 8 + tiles.block_n // 16]
    assert max(loop["LDL"] + loop["STL"] for loop in loops) <= spill_budget(SCORE_LOOP_SPILLS[name, varlen])


# (mod, packed) -> LDL + STL in the score_mod forward's busiest key loop on the tuned triton (3.6; the plain loop 4):
# the softcap mod keeps it; the slope table's load beside the prefix mask's holds 56-80 values per tile in local
# memory
SCORE_LOOP_SPILLS = {("softcap", False): 4, ("softcap", True): 8, ("slope_and_prefix", False): 56,
                     ("slope_and_prefix", True): 80}


@pytest.mark.parametrize("head_dim", [128, 256])
def test_the_mask_mods_suite_times_the_gluon_backward_where_it_plans(on_hopper, monkeypatch, head_dim):
    """bench --suite mask-mods's `flashmoe-arch`: forward and backward where Hopper plans the mod's backward (D=128),
    forward only where it refuses it (D=256)."""
    from flashmoe_science.bench.features import Case, _architecture_forward

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = MaskMod(mask_mods.head_windows, torch.full((16,), 32, dtype=torch.int32))
    case = Case("mask-mods", "head windows")
    _architecture_forward(case, lambda: (torch.randn(1, 4, 256, head_dim, dtype=torch.bfloat16),) * 3, mod, 1.0)
    arch = case.contenders["flashmoe-arch"]
    assert arch.forward_only == (head_dim == 256)
    assert arch.note == "backend='hopper'" + (", forward only" if head_dim == 256 else "")


def test_a_mod_whose_gluon_build_failed_is_refused_by_name(on_hopper, monkeypatch):
    """After its Gluon build failed (availability.run_gluon with the mods' functions as user_fn), the Hopper
    forward declines that mod with the build's reason, backend='hopper' included, and takes any other mod as
    before."""
    monkeypatch.setattr(availability, "_function_failures", {})
    q = torch.randn(1, 4, 256, 128, dtype=torch.bfloat16)
    refused = MaskMod(mask_mods.head_windows, torch.full((16,), 32, dtype=torch.int32))
    availability._function_failures[(refused.fn,)] = "head_windows does not build in the Gluon sm_90 attention forward"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(NoBackend, match="head_windows does not build in the Gluon"):
        plan_attention(dense_problem(q, q, q, causal=True, mask_mod=refused, backend="hopper")[0])
    other = MaskMod(_bare_causal)
    assert plan_attention(dense_problem(q, q, q, causal=True, mask_mod=other, backend="hopper")[0]).backend == "hopper"


# (head dim, packed, mask, mod) -> LDL + STL of the one-pass backward's build on the tuned triton (compat.TUNED_TRITON,
# 3.6). A mod streams 64-row query tiles (bwd_sm90.one_pass_tiles) and is evaluated on each consumer's whole 64 x 64
# tile of Sᵀ, before lse and Δ are loaded; the consumers take each tile from the producer's stage record instead of
# walking the lists. D=64: nothing spills (on 128-row tiles 240-370); D=128: 45-77 beside the plain unstaged builds'
# 11-29 (dK and dV hold 128 registers there), 0-24 of them in a consumer's tile loop. 3.9: 40-70.
MOD_BACKWARD_BUILDS = {
    (128, False, "causal", "document_window"): 77,
    (128, False, "full", "prefix_lm"): 45,
    (128, False, "causal", "head_windows"): 47,
    (128, False, "causal", "neighbour_list"): 50,
    (128, False, "window", "head_windows"): 59,
    (128, True, "causal", "document_window"): 61,
    (64, False, "causal", "document_window"): 0,
    (64, False, "full", "prefix_lm"): 0,
    (64, True, "causal", "document_window"): 0,
    (64, False, "full", "bare"): 0,
}


@pytest.mark.sm90_build
@OFFLINE
@pytest.mark.parametrize("case", list(MOD_BACKWARD_BUILDS), ids=lambda c: "D{}-{}-{}-{}".format(
    c[0], "varlen" if c[1] else "dense", c[2], c[3]))
def test_mod_backward_builds_for_sm90(case):
    """The one-pass backward with a mod: the producer and the dQ writer walk the block mask's lists (LDG of the lists),
    the five products on the tensor cores, dQ still by the writer's TMA reduce-adds, spills within the recorded
    budget, within the shared memory."""
    head_dim, varlen, mask, name = case
    features = offline_features(causal=mask == "causal", window=(100, 20) if mask == "window" else None,
                                varlen=varlen)
    compiled = bwd_sm90.compile_offline(head_dim, features, mask_mod=_mod(name))
    sass = sass_or_skip(compiled)
    assert "UTMALDG" in sass and "HGMMA" in sass and "LDG" in sass
    assert sass.count("UTMAREDG.3D.ADD") == head_dim // 32
    assert spill_count(sass) <= spill_budget(MOD_BACKWARD_BUILDS[case]), "spills grew"
    assert compiled.metadata.shared <= 227 * 1024


# (head dim, packed, mod) -> LDL + STL of the one-pass backward's build with a score_mod, causal, on the tuned triton
# (3.6): D=64 spills nothing; at D=128 the mod's P and derivative, both held across the dPᵀ product beside dK and dV,
# spill 61-73 values with the softcap mod, 228-245 with the slope table beside the prefix-LM mask_mod
SCORE_BACKWARD_BUILDS = {(128, False, "softcap"): 66, (128, True, "softcap"): 73, (128, False, "slope_and_prefix"): 245,
                         (64, False, "softcap"): 0, (64, True, "slope_and_prefix"): 0}


@pytest.mark.sm90_build
@OFFLINE
@pytest.mark.parametrize("case", list(SCORE_BACKWARD_BUILDS), ids=lambda c: "D{}-{}-{}".format(
    c[0], "varlen" if c[1] else "dense", c[2]))
def test_score_mod_backward_builds_for_sm90(case):
    """The one-pass backward with a score_mod and its derivative (alone, or beside a mask_mod): the five products
    on the tensor cores, dQ by the writer's TMA reduce-adds, spills within the recorded budget and the shared
    memory."""
    head_dim, varlen, name = case
    if name == "softcap":
        score, mask = ScoreMod(mod_cases.tanh_softcap, grad=mod_cases.tanh_softcap_grad), None
    else:
        score = ScoreMod(mod_cases.head_slope, _meta(16, dtype=torch.float32), grad=mod_cases.unit_grad)
        mask = _mod("prefix_lm")
    compiled = bwd_sm90.compile_offline(head_dim, offline_features(causal=True, varlen=varlen), mask_mod=mask,
                                        score_mod=score)
    sass = sass_or_skip(compiled)
    assert "UTMALDG" in sass and "HGMMA" in sass
    assert sass.count("UTMAREDG.3D.ADD") == head_dim // 32
    assert spill_count(sass) <= spill_budget(SCORE_BACKWARD_BUILDS[case]), "spills grew"
    assert compiled.metadata.shared <= 227 * 1024


def _backward_launch(features, blocks=None):
    q = _meta(2, 4, 300, 128, dtype=torch.bfloat16)
    kv = _meta(2, 2, 300, 128, dtype=torch.bfloat16)
    lse = _meta(2, 4, 300, dtype=torch.float32)
    launches = bwd_sm90._one_pass_launches(q, kv, kv, q, lse, q, lse, q, kv, kv, lse, features, 0.1, None,
                                           blocks=blocks)
    return launches["dkdv_dq"][2]


def test_mod_backward_launch_arguments():
    """Without a mod every new argument is None (a constexpr: the plain build); with one, the function, its tensors,
    the block mask's lists by key tile and their sizes, at 64-row query tiles; refused at other tiles."""
    from flashmoe_science.attention.features import CallFeatures
    from flashmoe_science.attention.mods import Mods

    names = ("mask_mod", "mask_args", "PARTIAL_COUNTS", "PARTIAL_TILES", "FULL_COUNTS", "FULL_TILES", "list_len",
             "mod_k_tiles")
    plain = _backward_launch(CallFeatures())
    assert all(plain[n] is None for n in names) and plain["MASK_MOD"] is False
    mod = _mod("document_window")
    features = CallFeatures(mods=Mods(mod))
    assert bwd_sm90.one_pass_tiles(128, features) == bwd_sm90.one_pass_tiles(64, features) == (64, 128)
    lists = TileLists(*(_meta(*shape) for shape in ((2, 4, 3), (2, 4, 3, 5)) * 2))
    blocks = BlockMask(64, 128, _meta(2, 4, 5, 3, dtype=torch.int8), None, lists)
    bound = _backward_launch(features, blocks)
    assert bound["MASK_MOD"] and bound["mask_mod"] is mod.fn and bound["mask_args"] == mod.tensors
    assert bound["FULL_TILES"] is lists.full and bound["PARTIAL_COUNTS"] is lists.partial_counts
    assert (bound["list_len"], bound["mod_k_tiles"]) == (5, 3)
    assert bound["q_desc"].block_shape[-2] == 64
    with pytest.raises(ValueError, match="block mask at the launch's 64x128 tiles"):
        _backward_launch(features, BlockMask(128, 128, blocks.states, None, lists))
    assert plain["score_mod"] is None and plain["score_args"] is None and plain["SCORE_MOD"] is False
    score = ScoreMod(mod_cases.head_slope, _meta(4, dtype=torch.float32), grad=mod_cases.unit_grad)
    bound = _backward_launch(CallFeatures(mods=Mods(None, score)))  # alone: no block mask, the plain tile walk
    assert bound["SCORE_MOD"] and not bound["MASK_MOD"] and bound["mask_mod"] is None
    assert (bound["score_mod"], bound["score_grad"], bound["score_args"]) == (score.fn, score.grad, score.tensors)
    assert bound["q_desc"].block_shape[-2] == 64
    with pytest.raises(ValueError, match="the backward needs its derivative"):
        _backward_launch(CallFeatures(mods=Mods(None, ScoreMod(mod_cases.head_slope, _meta(4, dtype=torch.float32)))))
