"""The Gluon sm_90 backward without a GPU: its sm_90 build (ptxas and cuobjdump ship with triton) and the checks
that decide whether it takes a call. Its numerics are tested on the H200 (test_backward_sm90_gpu.py)."""

from __future__ import annotations

import os
import re

import pytest
import torch

bwd_sm90 = pytest.importorskip("flashmoe_science.attention.hopper.bwd_sm90")
from flashmoe_science.gluon.build import spill_budget, spill_count  # noqa: E402
from sm90_helpers import sass_or_skip  # noqa: E402


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
def test_builds_for_sm90_with_register_operands_and_tma_reduce_adds():
    """D=128, causal: Sᵀ/dPᵀ/dQ from shared memory, dV/dK with P and dS from registers, dQ by TMA reduce-adds, and
    (after folding lse, Δ and the mask into the accumulators) at most a few spilled scalars."""
    compiled = bwd_sm90.compile_offline(128, True)
    sass = sass_or_skip(compiled)
    assert re.search(r"\bHGMMA\.64x64x16\.F32\.BF16 R\d+, gdesc", sass)  # Sᵀ, dPᵀ, dQ: both operands in smem
    assert re.search(r"\bHGMMA\.64x128x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)  # dV, dK: A from registers
    assert len(re.findall(r"\bUTMAREDG\.3D\.ADD\b", sass)) == 4  # two 32-column boxes per consumer
    assert not re.search(r"\b(RED|ATOM)G?\.E\.ADD", sass), "dQ must not use per-thread atomics"
    # 3.6: 147 LDL + 127 STL, most in the masked loop's and the prologue's copies of the staged-statistics tile
    # (tiles.sm90_backward_staged_stats; measured 6% faster than the accumulator starts' 20)
    assert spill_count(sass) <= spill_budget(274), "spills grew back"
    assert compiled.metadata.shared <= 227 * 1024


def _loop_barriers(ptx: str) -> int:
    """Warpgroup barriers (bar.sync with 128 threads) in a build's PTX: the consumers' only CTA-barrier kind."""
    return len(re.findall(r"\bbar\.sync\s+\d+, 128;", ptx))


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dq_writer_takes_the_reduce_adds_out_of_the_consumers(causal, d):
    """The dQ writer warp issues every reduce-add and waits for their reads; the consumers neither issue nor wait
    for TMA stores (no cp.async.bulk wait in a 4-warp partition), and each consumer runs at most five warpgroup
    barriers per query tile (two per Gluon arrive, one for its dQ staging), none behind a TMA wait."""
    compiled = bwd_sm90.compile_offline(d, causal)
    ptx, sass = compiled.asm["ptx"], sass_or_skip(compiled)
    assert len(re.findall(r"\bUTMAREDG\.3D\.ADD\b", sass)) == d // 32  # one per 32 columns, in the writer only
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx)) == d // 32
    assert ptx.count("cp.async.bulk.wait_group.read") == 2  # the writer's per tile and at its end
    # 15 in the whole kernel on triton 3.6 (5 per consumer per tile), 16 with the reduce-adds in the consumers (6
    # per tile, one of them behind the previous tile's TMA read); 23 where D=128 causal runs its masked and
    # unmasked tiles in two loops (staged statistics), each body with its 5
    assert _loop_barriers(ptx) <= (23 if (d, causal) == (128, True) else 15), _loop_barriers(ptx)
    assert compiled.metadata.shared <= 227 * 1024


# (head dim, causal, LDL + STL of the triton 3.6 build): the default mode's plus a few in the consumer prologue
# (D=64 runs 128-row query tiles, whose Sᵀ/dPᵀ take twice the registers)
DETERMINISTIC_BUILDS = {(64, False): 14, (64, True): 24, (128, False): 27, (128, True): 274}


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("d,causal", list(DETERMINISTIC_BUILDS), ids=lambda v: str(v))
def test_deterministic_builds_order_the_reduce_adds(d, causal):
    """deterministic=True: the writer spins on its counter with acquire loads, waits for the reduce-adds'
    completion (not only their reads), and releases the counter with one GPU-scope reduction."""
    compiled = bwd_sm90.compile_offline(d, causal, deterministic=True)
    ptx, sass = compiled.asm["ptx"], sass_or_skip(compiled)
    assert ptx.count("ld.acquire.gpu.global.b32") == 1
    assert ptx.count("cp.async.bulk.wait_group 0;") == 1 and ptx.count("red.release.gpu.global.add.s32") == 1
    assert re.search(r"\bLDG\.E\.STRONG\.GPU\b", sass) and re.search(r"\bMEMBAR\.ALL\.GPU\b", sass)
    assert re.search(r"\bREDG\.E\.ADD\.S32\.STRONG\.GPU\b", sass)
    assert len(re.findall(r"\bUTMAREDG\.3D\.ADD\b", sass)) == d // 32
    assert spill_count(sass) <= spill_budget(DETERMINISTIC_BUILDS[(d, causal)]), "spills grew"
    assert compiled.metadata.shared <= 227 * 1024


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("feature", ["window", "varlen", "softcap"])
def test_deterministic_builds_with_features(feature):
    """The ordered reduce-adds with a window (its left bound starts later query tiles at later key blocks:
    `_contributors_before` reads mask.key_tile_range), packed sequences and a softcap, at D=128."""
    from flashmoe_science.attention.hopper.bwd_common import offline_features

    features = {"window": offline_features(causal=True, window=(300, 40)), "varlen": offline_features(varlen=True),
                "softcap": offline_features(causal=True, softcap=20.0)}[feature]
    compiled = bwd_sm90.compile_offline(128, features, deterministic=True)
    assert compiled.asm["ptx"].count("red.release.gpu.global.add.s32") == 1
    assert compiled.metadata.shared <= 227 * 1024


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_256_builds_as_two_kernels_without_atomics_or_spills(causal):
    """D=256: the dK/dV kernel (head dim split: transposed N=32 products, both operands in shared memory) and the
    dQ kernel (dS from registers into a 64 x 256 accumulator); neither adds into memory, neither spills (the K/V
    descriptors hoisted out of the dK/dV loop once spilled 300 bytes)."""
    from flashmoe_science.attention.hopper import bwd_dq_sm90, bwd_sm90_hdim256

    dkdv = bwd_sm90_hdim256.compile_offline(256, causal)
    dq = bwd_dq_sm90.compile_offline(256, causal)
    assert bwd_sm90.compile_offline(192, causal).asm["cubin"] == bwd_sm90_hdim256.compile_offline(192, causal).asm["cubin"]
    dkdv_sass, dq_sass = sass_or_skip(dkdv), sass_or_skip(dq)
    assert re.search(r"\bHGMMA\.64x32x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB", dkdv_sass)  # dVᵀ, dKᵀ
    assert re.search(r"\bHGMMA\.64x256x16\.F32\.BF16 R\d+, R\d+, gdesc", dq_sass)  # dQ += dS K, A from registers
    for sass in (dkdv_sass, dq_sass):
        assert not re.search(r"\b(RED|ATOM)G?\.E\.ADD|UTMAREDG", sass)
        assert spill_count(sass) <= spill_budget(), "spills"
    assert max(dkdv.metadata.shared, dq.metadata.shared) <= 227 * 1024


def test_check_supported_names_what_it_does_not_run():
    with pytest.raises(ValueError, match="bf16/fp16"):
        bwd_sm90.check_supported(torch.empty(1, 1, 8, 64))
    for d in (16, 32, 257):
        with pytest.raises(ValueError, match="head dims"):
            bwd_sm90.check_supported(torch.empty(1, 1, 8, d, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="positive softmax_scale"):
        bwd_sm90.check_supported(torch.empty(1, 1, 8, 64, dtype=torch.bfloat16), softmax_scale=-0.5)
    bwd_sm90.check_supported(torch.empty(1, 1, 8, 96, dtype=torch.float16), softmax_scale=0.1)  # pads to 128
    bwd_sm90.check_supported(torch.empty(1, 1, 8, 192, dtype=torch.bfloat16))  # pads to 256: the two kernels
    assert bwd_sm90.is_deterministic(256) and bwd_sm90.is_deterministic(160) and not bwd_sm90.is_deterministic(128)


def test_api_takes_it_only_where_it_runs():
    from flashmoe_science.attention.hopper.backend import backward_refusal
    from flashmoe_science.attention.layout import tma_compatible

    def _sm90_backward_runs(q, grad_out, softmax_scale):
        # the plan's rule (backward_refusal) and the run's (a TMA-compatible grad_out); determinism is no reason
        # to decline (the one pass orders its dQ reduce-adds when asked)
        return backward_refusal(q.shape[-1], q.shape[-2], softmax_scale) is None and tma_compatible(grad_out)

    q = torch.empty(1, 2, 8, 128, dtype=torch.bfloat16)
    assert _sm90_backward_runs(q, torch.empty_like(q), 0.1)
    short64, long64 = torch.empty(1, 2, 1024, 64, dtype=torch.bfloat16), torch.empty(1, 2, 2048, 64, dtype=torch.bfloat16)
    assert not _sm90_backward_runs(short64, torch.empty_like(short64), 0.1)  # the two passes measured faster
    assert _sm90_backward_runs(long64, torch.empty_like(long64), 0.1)
    assert not _sm90_backward_runs(q, torch.empty_like(q), 0.0)
    q256 = torch.empty(1, 2, 8, 256, dtype=torch.bfloat16)
    assert _sm90_backward_runs(q256, torch.empty_like(q256), 0.1)
    assert not _sm90_backward_runs(torch.empty(1, 2, 8, 512, dtype=torch.bfloat16), torch.empty(1, 2, 8, 512), 0.1)
    assert not _sm90_backward_runs(q, torch.empty(1, 2, 8, 130)[..., :128], 0.1)  # rows not 16-byte aligned


def test_one_pass_launches_bind_every_parameter():
    """The one-pass path's launches (attention_backward_sm90 and PreparedBackward build them once): every kernel
    parameter bound, the per-call ones first (what PreparedLaunch rebuilds from new tensors), in launch order."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashmoe_science.attention.hopper import bwd_sm90

    q = torch.empty(2, 4, 300, 64, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, 2, 300, 64, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(2, 4, 300, device="meta")
    dq_accum = torch.empty(2, 4, 300, 64, device="meta")
    semaphores = torch.empty(2, 4, 300, dtype=torch.int32, device="meta")
    for counters in (None, semaphores):  # the default and the deterministic mode
        launches = bwd_sm90._one_pass_launches(q, kv, kv, q, lse, q, lse, q, kv, kv, dq_accum, True, 0.125, None,
                                               semaphores=counters)
        assert list(launches) == ["preprocess", "dkdv_dq", "dq_convert"]
        for kernel, grid, bound, options, heads in launches.values():
            assert list(bound) == list(kernel.arg_names)
            per_call = [bound[name] for name in kernel.arg_names[:len(heads)]]
            assert all(isinstance(t, (torch.Tensor, TensorDescriptor)) for t in per_call)
            assert not any(isinstance(bound[name], (torch.Tensor, TensorDescriptor))
                           for name in kernel.arg_names[len(heads):])
        assert launches["dkdv_dq"][1] == (3 * 2 * 2,)  # key blocks x batch x kv heads
        assert launches["preprocess"][2]["ZERO_DQ_ACCUM"]
        ordered = counters is not None
        assert launches["preprocess"][2]["ZERO_SEMAPHORES"] == ordered == launches["dkdv_dq"][2]["DETERMINISTIC"]
        assert ("semaphores" in launches["dkdv_dq"][4]) == ordered


FEATURE_CASES = {  # bwd_common.offline_features arguments: each feature alone and all at once
    "window": dict(window=(100, 20)),
    "window_causal": dict(causal=True, window=(300, -1)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi=True),
    "varlen": dict(varlen=True, causal=True),
    "all": dict(causal=True, window=(100, -1), softcap=5.0, alibi=True, varlen=True),
}


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("case", list(FEATURE_CASES))
def test_features_build_for_sm90(case):
    """Window, softcap, ALiBi and varlen build into all three kernels (one pass at D=128; dK/dV and dQ at D=256)
    within the shared memory; the one-pass kernel keeps its TMA reduce-adds. Spills are what the features cost
    (none alone at D=256; a few dozen loads at D=128 with softcap and a window or ALiBi together)."""
    from flashmoe_science.attention.hopper import bwd_dq_sm90, bwd_sm90_hdim256
    from flashmoe_science.attention.hopper.bwd_common import offline_features

    features = offline_features(**FEATURE_CASES[case])
    one_pass = bwd_sm90.compile_offline(128, features)
    assert len(re.findall(r"\bUTMAREDG\.3D\.ADD\b", sass_or_skip(one_pass))) == 4
    for compiled in (one_pass, bwd_sm90_hdim256.compile_offline(256, features),
                     bwd_dq_sm90.compile_offline(256, features)):
        assert compiled.metadata.shared <= 227 * 1024
    if case in FEATURE_LDL:
        assert len(re.findall(r"\bLDL\b", sass_or_skip(one_pass))) <= spill_budget(FEATURE_LDL[case]), "spills grew"


# LDL of the one-pass D=128 feature builds on triton 3.6 (the tuned release; other releases' allocators may spill
# more: spill_budget): 24, the softcap's tanh.approx (inline PTX) 27
FEATURE_LDL = {"window": 24, "alibi": 24, "softcap": 28, "varlen": 24}


# (causal, deterministic): LDL + STL of the packed D=128 builds with staged statistics on triton 3.6 (full masks
# only: tiles.sm90_backward_staged_stats)
PACKED_STAGED_BUILDS = {(False, False): 27, (False, True): 27}


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("causal,deterministic", list(PACKED_STAGED_BUILDS), ids=lambda v: str(v))
def test_packed_batches_stage_lse_and_delta_at_head_dim_128(causal, deterministic):
    """A packed D=128 batch with a full mask: the producer loads each stage's lse and Δ with two rank-1
    TMA boxes (from the padded copies, bwd_sm90.padded_stats), at the dense build's shared memory and about its
    spills; the deterministic build keeps its ordered reduce-adds."""
    from flashmoe_science.attention.hopper.bwd_common import offline_features

    compiled = bwd_sm90.compile_offline(128, offline_features(causal=causal, varlen=True),
                                        deterministic=deterministic)
    sass = sass_or_skip(compiled)
    assert len(re.findall(r"\bUTMALDG\.1D\b", sass)) == 2
    assert spill_count(sass) <= spill_budget(PACKED_STAGED_BUILDS[(causal, deterministic)]), "spills grew"
    assert compiled.metadata.shared <= 227 * 1024
    if deterministic:
        assert compiled.asm["ptx"].count("red.release.gpu.global.add.s32") == 1


def test_feature_args_run_plain_calls_as_causal_without_window_flags():
    """Dense and causal-only masks (including the window (-1, 0)) run as CAUSAL with no MASK_* flag (the constant
    window's bounds, mask.key_tile_bounds); other windows set MASK_LEFT/MASK_RIGHT; varlen passes the packed totals
    (not the batch's longest lengths, which change per batch) and one entry per sequence."""
    from flashmoe_science.attention.hopper.bwd_common import feature_args, offline_features

    q = torch.empty(2, 4, 300, 64, device="meta")
    k = torch.empty(2, 2, 200, 64, device="meta")
    for features, causal, left, right in ((False, False, False, False), (True, True, False, False),
                                          (offline_features(window=(-1, 0)), True, False, False),
                                          (offline_features(causal=True, window=(8, -1)), False, True, True),
                                          (offline_features(window=(-1, 5)), False, False, True)):
        args, flags, (programs, lq, lk, _) = feature_args(features, 0.125, q, k, 128)
        assert (flags["CAUSAL"], flags["MASK_LEFT"], flags["MASK_RIGHT"]) == (causal, left, right)
        assert (programs, lq, lk) == (2 * 2, 300, 200) and args[:5] == (None,) * 5  # 2 batches x 2 key blocks
    args, flags, (programs, lq, lk, qk_scale) = feature_args(offline_features(varlen=True, alibi=True, softcap=2.0),
                                                             0.125, q, k, 128)
    assert flags["VARLEN"] and flags["ALIBI"] and flags["SOFTCAP"] and (lq, lk) == (300, 200)
    # 2 packed sequences, 200 key rows, the longest 256: at most min(2 x 2, cdiv(200, 128) + 2) key blocks
    assert programs == 4 and args[4] == 2 and args[3] is not None  # num_seqs, the work list
    assert args[6] == 300 and qk_scale == pytest.approx(2.0 * 1.4426950408889634)  # lse rows; c·log2(e)


def test_mod_refusal_names_what_the_one_pass_kernel_does_not_take():
    """A mask_mod and a score_mod run on the one-pass kernel beside causal, a window and varlen; refused at head dims
    padding to 256, and a mask_mod deterministic (softcap, ALiBi or a bias beside a mod never get here:
    mods.check_mods); attention_backward_sm90 raises it."""
    from dataclasses import replace

    from flashmoe_science.attention.hopper.bwd_common import offline_features
    from flashmoe_science.attention.mods import MaskMod, Mods, ScoreMod

    def mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    mods = Mods(MaskMod(mod))
    window = replace(offline_features(causal=True, window=(64, -1), varlen=True), mods=mods)
    assert bwd_sm90.mod_refusal(window, 128) is None and bwd_sm90.mod_refusal(offline_features(), 128) is None
    scored = replace(window, mods=Mods(score=ScoreMod(mod, grad=mod)))
    assert bwd_sm90.mod_refusal(scored, 128) is None
    assert bwd_sm90.mod_refusal(scored, 128, deterministic=True) is None  # the plain tile walk: ordered adds hold
    assert "head dims up to 128" in bwd_sm90.mod_refusal(scored, 256)
    assert "head dims up to 128" in bwd_sm90.mod_refusal(window, 256)
    assert "deterministic" in bwd_sm90.mod_refusal(window, 128, deterministic=True)
    q = torch.empty(1, 2, 8, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the sm_90 backward: it takes mask_mod and score_mod at head dims up to 128"):
        bwd_sm90.attention_backward_sm90(q, q, q, q, None, q, None, q, q, q, window, 0.1)


def _bias_features(causal, shape, dtype=torch.bfloat16, softcap=None):
    from flashmoe_science.attention.hopper.bwd_common import offline_features

    return offline_features(causal, softcap=softcap, bias=shape, bias_dtype=dtype)


def test_bias_refusal_names_what_the_one_pass_kernel_does_not_read():
    q, k = torch.empty(2, 4, 256, 128, device="meta"), torch.empty(2, 2, 256, 128, device="meta")
    assert bwd_sm90.bias_refusal(_bias_features(True, (1, 4, 256, 256)), q, k) is None
    wide_q, wide_k = torch.empty(2, 4, 256, 256, device="meta"), torch.empty(2, 2, 256, 256, device="meta")
    assert "head dims" in bwd_sm90.bias_refusal(_bias_features(True, (1, 4, 256, 256)), wide_q, wide_k)
    assert "float32" in bwd_sm90.bias_refusal(_bias_features(False, (256, 256), torch.float32), q, k)
    assert bwd_sm90.bias_refusal(_bias_features(False, (256, 256), torch.float32), q[..., :64], k[..., :64]) is None
    assert "softcap" in bwd_sm90.bias_refusal(_bias_features(False, (1, 4, 256, 256), softcap=5.0), q, k)
    assert "TMA" in bwd_sm90.bias_refusal(_bias_features(False, (2, 4, 1, 256)), q, k)  # broadcast over queries
    odd_k = torch.empty(2, 2, 255, 128, device="meta")
    odd = _bias_features(False, (2, 4, 256, 256))
    odd = type(odd)(mask=odd.mask, attn_bias=torch.empty(2, 4, 256, 255, dtype=torch.bfloat16, device="meta"))
    assert "TMA" in bwd_sm90.bias_refusal(odd, q, odd_k)  # rows of 510 bytes


# (causal, bias shape, bias_grad, LDL + STL of the triton 3.6 build): a bias without a gradient (the plain
# kernel's spills plus a few), and its gradient stored (no broadcast dims) or added with atomics (broadcast)
BIAS_BUILDS = {
    "causal-fixed": (True, (1, 4, 256, 256), None, 22),
    "full-store": (False, (2, 4, 256, 256), "store", 213),
    "causal-atomic": (True, (1, 4, 256, 256), "atomic", 482),
}


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("name", list(BIAS_BUILDS))
def test_bias_builds_for_sm90(name):
    """D=128 with a bias read by TMA beside Q, dQ still by TMA reduce-adds; its gradient by
    stores or float32 atomics; the bias ring within the shared memory."""
    causal, shape, bias_grad, spills = BIAS_BUILDS[name]
    compiled = bwd_sm90.compile_offline(128, _bias_features(causal, shape), bias_grad=bias_grad)
    sass = sass_or_skip(compiled)
    assert len(re.findall(r"\bUTMAREDG\.3D\.ADD\b", sass)) == 4
    assert bool(re.search(r"\bREDG?\.E\.ADD\.F32", sass)) == (bias_grad == "atomic")
    assert spill_count(sass) <= spill_budget(spills), "spills grew"
    assert compiled.metadata.shared <= 227 * 1024
