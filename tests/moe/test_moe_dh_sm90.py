"""The Gluon sm_90 dh GEMM (moe/hopper/dx_sm90.py): its row-store epilogue (``dh_sm90``) and its SwiGLU backward
epilogue (``dh_swiglu_sm90``, what moe_backward runs on Hopper). Argument checks, launch plumbing and offline sm_90
builds on the CPU; on the GPU (``-m gpu``) dh against a float64 reference and the Triton kernel
(``triton_gemm.dh_launch``), the fused kernel against dh_launch + swiglu_backward_launch, and the backward with it
against the backward with the Triton kernels. The barrier protocol is dx's (test_moe_dx_sm90.py's model covers it:
the epilogue is not part of it)."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from flashmoe_science.moe.dispatch import sort_buffers  # noqa: E402
from flashmoe_science.moe.hopper import dx_sm90 as gdx  # noqa: E402
from flashmoe_science.gluon.build import spill_budget, spill_count  # noqa: E402
from flashmoe_science.moe.hopper.dx_sm90 import DxConfig, SwigluOperands  # noqa: E402
from sm90_helpers import sass_or_skip  # noqa: E402

# the dh configs the A/B script measured (scripts/ab_moe_dx_sm90.py, git history): ping-pong 128x128 with 4 / 5 stages, cooperative
# 128x256 with 3
AB_CONFIGS = [DxConfig(128, 64, 4, pingpong=True), DxConfig(128, 64, 5, pingpong=True), DxConfig(256, 64, 3)]
# and its dh_swiglu configs with 32-column epilogue chunks: ping-pong 128x128 (one set of epilogue buffers beside a
# ring of 4 or 3 stages); the first is the library's (16-column chunks spill a few registers since the fast sigmoid)
SWIGLU_CONFIGS = [DxConfig(128, 64, 4, pingpong=True, swiglu_cols=32),
                  DxConfig(128, 64, 3, pingpong=True, swiglu_cols=32)]


def _cpu_case(num_tokens=16, top_k=2, num_experts=4, d_model=128, d_ff=64, block_m=128, device="cpu",
              dtype=torch.bfloat16):
    """Tensors of the right shapes (values unused: nothing runs)."""
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, block_m, device)  # shapes only
    rows = sort.tile_expert.numel() * block_m
    dout_sorted = torch.zeros(rows, d_model, dtype=dtype, device=device)
    w2 = torch.zeros(num_experts, d_model, d_ff, dtype=dtype, device=device)
    dh = torch.zeros(rows, d_ff, dtype=torch.float32, device=device)
    return dout_sorted, w2, dh, sort


def test_launch_args_for_a_valid_call():
    a, w2, dh, sort = _cpu_case()
    grid, args, constexprs = gdx.launch_args(a, w2, dh, sort, 128, gdx.DH_CONFIG, num_ctas=132, gemm="dh")
    # 32 pairs over 4 experts: at most 0 + 4 row tiles; F = 64: one 128-wide column block
    assert grid == (4,)
    assert constexprs == dict(GROUP_M=8, NUM_STAGES=4, PINGPONG=True, ROWS=128, EPILOGUE=gdx.ROW_STORE.value,
                              SPLIT_TAIL=False)
    a_desc, b_desc = args[:2]
    assert a_desc.block_shape == [128, 64] and a_desc.shape == [4 * 128, 128]
    assert b_desc.block_shape == [64, 128] and b_desc.shape == [4 * 128, 64]  # w2 viewed as (E*d, F)
    assert args[5] is dh
    assert args[-3:] == (128, 64, 64)  # K = d, N = F, dh's row stride
    _, _, constexprs = gdx.launch_args(a, w2, dh, sort, 128, DxConfig(256, 64, 3), num_ctas=2, gemm="dh")
    assert constexprs["ROWS"] == 64 and not constexprs["PINGPONG"]
    assert constexprs["EPILOGUE"] == gdx.ROW_STORE.value


@pytest.mark.parametrize("change, match", [
    (dict(block_m=64), "dh_sm90: the kernel runs 128-row tiles"),
    (dict(sort_block_m=64), "128-row tiles"),
    (dict(d_model=96), r"d = 96 must be a multiple of block_k = 64 .*dh_launch"),
    (dict(dtype=torch.float32), "16-bit float"),
    (dict(w2_dtype=torch.float16), "16-bit float"),
    (dict(dh_dtype=torch.bfloat16), "dh must be float32"),
    (dict(a_rows=-128), r"dout_sorted must be \(sort rows, d\)"),
    (dict(dh_rows=-128), r"dh must be \(sort rows, F\)"),
    (dict(dh_cols=-8), r"dh must be \(sort rows, F\)"),
    (dict(num_experts_w2=3), "the sort has 4 experts, w2 3"),
    (dict(d_ff=60), "16-byte aligned rows"),
    (dict(w2_strided=True), "contiguous"),
    (dict(a_strided=True), "contiguous"),
    (dict(dh_strided=True), "unit last stride"),
    (dict(a_offset=True), "aligned base"),
    (dict(config=DxConfig(block_n=256, pingpong=True)), "dh_sm90: pingpong needs block_n 128"),
    (dict(config=DxConfig(block_n=64)), "block_n must be 128 or 256"),
    (dict(config=DxConfig(num_stages=1)), "at least 2"),
    (dict(config=DxConfig(block_n=256, num_stages=5)), "dh_sm90: .* shared memory"),
])
def test_argument_checks_raise_value_errors(change, match):
    a, w2, dh, sort = _cpu_case(d_model=change.get("d_model", 128), d_ff=change.get("d_ff", 64),
                                dtype=change.get("dtype", torch.bfloat16))
    if "sort_block_m" in change:
        sort = sort._replace(block_m=change["sort_block_m"])
    if "w2_dtype" in change:
        w2 = w2.to(change["w2_dtype"])
    if "dh_dtype" in change:
        dh = dh.to(change["dh_dtype"])
    if "a_rows" in change:
        a = a[:change["a_rows"]]
    if "dh_rows" in change:
        dh = dh[:change["dh_rows"]]
    if "dh_cols" in change:
        dh = dh[:, :change["dh_cols"]].contiguous()
    if "num_experts_w2" in change:
        w2 = w2[:change["num_experts_w2"]]
    if change.get("w2_strided"):
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    if change.get("a_strided"):
        a = a.t().contiguous().t()
    if change.get("dh_strided"):
        dh = dh.t().contiguous().t()
    if change.get("a_offset"):  # a contiguous view 2 bytes into its storage
        a = torch.zeros(a.numel() + 1, dtype=a.dtype)[1:].view(a.shape)
    with pytest.raises(ValueError, match=match):
        gdx.launch_args(a, w2, dh, sort, change.get("block_m", 128), change.get("config", gdx.DH_CONFIG), 132,
                        gemm="dh")


def test_cpu_tensors_are_refused_with_a_value_error():
    a, w2, dh, sort = _cpu_case()
    with pytest.raises(ValueError, match="dh_sm90: needs CUDA"):
        gdx.dh_sm90(a, w2, dh, sort, 128)


def _swiglu_case(num_tokens=16, top_k=2, num_experts=4, d_model=128, d_ff=128, device="cpu",
                 dtype=torch.bfloat16):
    """dh_swiglu_sm90's tensors of the right shapes (values unused: nothing runs): (dout_sorted, w2, dgu,
    SwigluOperands, sort)."""
    a, w2, _, sort = _cpu_case(num_tokens, top_k, num_experts, d_model, d_ff, 128, device, dtype)
    rows = a.shape[0]
    dgu = torch.zeros(rows, 2 * d_ff, dtype=dtype, device=device)
    swiglu = SwigluOperands(torch.zeros(rows, 2 * d_ff, dtype=dtype, device=device),
                            torch.zeros(rows, d_ff, dtype=dtype, device=device),
                            torch.zeros(num_tokens, top_k, device=device),
                            torch.zeros(num_tokens, top_k, device=device))
    return a, w2, dgu, swiglu, sort


def test_swiglu_launch_args_for_a_valid_call():
    a, w2, dgu, swiglu, sort = _swiglu_case()
    grid, args, constexprs = gdx.launch_args(a, w2, dgu, sort, 128, gdx.DH_SWIGLU_CONFIG, 132, "dh_swiglu", swiglu)
    assert grid == (4,)
    assert constexprs == dict(GROUP_M=8, NUM_STAGES=4, PINGPONG=True, ROWS=128, EPILOGUE=gdx.SWIGLU_BWD.value,
                              SPLIT_TAIL=False)
    gate_up_desc, h_desc, dgu_desc = args[2:5]
    # the epilogue's chunks: 128 rows x swiglu_cols of [gate | up], h and d(gate, up)
    for desc, t in ((gate_up_desc, swiglu.gate_up), (h_desc, swiglu.h), (dgu_desc, dgu)):
        assert desc.base is t and desc.block_shape == [128, gdx.DH_SWIGLU_CONFIG.swiglu_cols]
    assert args[5] is dgu
    assert args[10] is swiglu.row_scale and args[11] is swiglu.dscale
    assert args[-3:] == (128, 128, 256)  # K = d, N = F; dgu's row stride


@pytest.mark.parametrize("change, match", [
    (dict(dgu_dtype=torch.float32), "dgu must be in w2's dtype"),
    (dict(dgu_cols=64), r"dgu must be \(sort rows, 2F\)"),
    (dict(gate_up_cols=120), r"gate_up must be \(sort rows, 2F\)"),
    (dict(h_dtype=torch.float16), r"h must be \(sort rows, F\) .* dtype"),
    (dict(h_strided=True), "unit last stride"),
    (dict(row_scale_dtype=torch.float64), "row_scale must be float32"),
    (dict(dscale_slots=1), "dscale must be float32, contiguous, one value per"),
    (dict(swiglu=None), "needs SwigluOperands"),
    (dict(config=DxConfig(128, 64, 4, True, swiglu_cols=12)), "swiglu_cols must be a power of two from 8"),
    (dict(config=DxConfig(128, 64, 4, True, swiglu_cols=4)), "swiglu_cols must be a power of two from 8"),
    (dict(config=DxConfig(128, 64, 4, True, swiglu_cols=256)), "to block_n = 128"),
    (dict(config=DxConfig(256, 64, 3)), "needs pingpong=True"),
    (dict(config=DxConfig(128, 64, 5, True)), "needs 263168 bytes of shared memory"),
    (dict(d_ff=200), r"F = 200 must be a multiple of block_n = 128 .*swiglu_backward_launch"),
    (dict(d_model=96), r"d = 96 must be a multiple of block_k = 64 .*swiglu_backward_launch"),
])
def test_swiglu_argument_checks_raise_value_errors(change, match):
    a, w2, dgu, swiglu, sort = _swiglu_case(d_model=change.get("d_model", 128), d_ff=change.get("d_ff", 128))
    if "dgu_dtype" in change:
        dgu = dgu.to(change["dgu_dtype"])
    if "dgu_cols" in change:
        dgu = dgu[:, :change["dgu_cols"]].contiguous()
    if "gate_up_cols" in change:
        swiglu = swiglu._replace(gate_up=swiglu.gate_up[:, :change["gate_up_cols"]])
    if "h_dtype" in change:
        swiglu = swiglu._replace(h=swiglu.h.to(change["h_dtype"]))
    if change.get("h_strided"):
        swiglu = swiglu._replace(h=swiglu.h.t().contiguous().t())
    if "row_scale_dtype" in change:
        swiglu = swiglu._replace(row_scale=swiglu.row_scale.to(change["row_scale_dtype"]))
    if "dscale_slots" in change:
        swiglu = swiglu._replace(dscale=swiglu.dscale[:, :change["dscale_slots"]].contiguous())
    if "swiglu" in change:
        swiglu = change["swiglu"]
    with pytest.raises(ValueError, match=match):
        gdx.launch_args(a, w2, dgu, sort, 128, change.get("config", gdx.DH_SWIGLU_CONFIG), 132, "dh_swiglu", swiglu)


def test_swiglu_cpu_tensors_are_refused_with_a_value_error():
    a, w2, dgu, swiglu, sort = _swiglu_case()
    with pytest.raises(ValueError, match="dh_swiglu_sm90: needs CUDA"):
        gdx.dh_swiglu_sm90(a, w2, dgu, swiglu, sort, 128)


def test_meta_stand_in_for_the_gathered_operand():
    """The Hopper family's plan (moe/hopper/backend.py) checks a meta tensor of the gathered copy's shape and dtype
    before the copy is made: it passes where the real copy would, and d % block_k still sends dh to Triton."""
    for d_model, passes in ((128, True), (96, False)):
        _, w2, dgu, swiglu, sort = _swiglu_case(d_model=d_model)
        stand_in = torch.empty((dgu.shape[0], w2.shape[1]), dtype=w2.dtype, device="meta")
        reason = gdx.unsupported_reason(stand_in, w2, dgu, sort, 128, gdx.DH_SWIGLU_CONFIG, "dh_swiglu", swiglu)
        assert (reason is None) == passes, reason
        assert passes or "dh_launch" in reason


def test_the_triton_path_off_hopper():
    """On the CPU the plan gives moe_backward's dh + SwiGLU step to the Triton kernels (the Gluon kernel needs a
    Hopper GPU), and says so."""
    from flashmoe_science.moe.gemms import TritonDhSwiglu
    from flashmoe_science.moe.plan import plan_kernels
    from flashmoe_science.moe.tiles import choose_tiles

    _, w2, _, _, _ = _swiglu_case()
    x = torch.zeros(16, w2.shape[1], dtype=w2.dtype)
    w1 = torch.zeros(w2.shape[0], 2 * w2.shape[2], w2.shape[1], dtype=w2.dtype)
    tiles = replace(choose_tiles(16, 2, 4, 128, 64, torch.device("cpu")), block_m=128)
    choice = plan_kernels(x, w1, w2, 2, tiles, training=True).choice("dh_swiglu")
    assert choice.backend == "triton" and isinstance(choice.plan, TritonDhSwiglu)
    assert "CUDA" in choice.why_not("hopper")


def test_configs_of_the_ab_script_fit_shared_memory():
    for config in AB_CONFIGS:
        gdx.check_config(config, gemm="dh")
    for config in SWIGLU_CONFIGS + [gdx.DH_SWIGLU_CONFIG]:
        gdx.check_config(config, gemm="dh_swiglu")


def _meta_case(num_tokens, top_k, num_experts, d_model, d_ff, dtype=torch.bfloat16):
    return _cpu_case(num_tokens, top_k, num_experts, d_model, d_ff, 128, torch.device("meta"), dtype)


NOT_INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                                     reason="a real sm_90 build, not the interpreter")


@pytest.mark.sm90_build
@NOT_INTERPRETED
@pytest.mark.parametrize("config", AB_CONFIGS, ids=lambda c: c.label().replace(" ", "-"))
def test_builds_for_sm90_with_tma_wgmma_row_stores_and_no_spills(config):
    """The sm_90 binary at Mixtral's dh (ptxas ships with triton: no GPU needed): TMA loads, warpgroup MMAs on
    shared-memory operands, 8-byte float32 stores and no atomics in the epilogue, no local memory."""
    compiled = gdx.compile_offline(*_meta_case(4096, 2, 8, 4096, 14336), config, gemm="dh")
    sass = sass_or_skip(compiled)
    assert re.search(r"\bHGMMA\.64x%dx16\.F32\.BF16" % config.block_n, sass)
    assert re.search(r"\bUTMALDG\b", sass)
    # per consumer, each thread stores its 128 accumulator floats (128x128 or 64x256 over 128 threads) in pairs
    assert len(re.findall(r"\bSTG\.E\.64\b", sass)) == 2 * 64
    assert not re.search(r"\b(RED|REDG|ATOM|ATOMG)\b", sass)
    assert spill_count(sass) <= spill_budget(), "spills"
    assert compiled.metadata.shared <= gdx.smem_bytes(config) <= gdx.HOPPER_SMEM_PER_BLOCK


@pytest.mark.sm90_build
@NOT_INTERPRETED
@pytest.mark.parametrize("model, config", [("mixtral", c) for c in SWIGLU_CONFIGS]
                         + [("qwen3", gdx.DH_SWIGLU_CONFIG)],
                         ids=lambda v: v.swiglu_label().replace(" ", "-") if isinstance(v, DxConfig) else v)
def test_swiglu_builds_for_sm90_without_spills(model, config):
    """The fused kernel's sm_90 binary at Mixtral's / Qwen3's dh: no local memory (the epilogue's chunks of
    config.swiglu_cols columns keep gate, up and h beside the accumulator), the epilogue's operands read from shared
    memory with ldmatrix and d(gate, up) written back with stmatrix (no global loads or stores of tile data: the
    producer's and consumers' TMA move them), and one float32 reduction per row of the tile per thread quad (REDG,
    no returned atomics)."""
    dims = dict(mixtral=(4096, 2, 8, 4096, 14336), qwen3=(4096, 8, 128, 2048, 768))[model]
    a, w2, dgu, swiglu, sort = _swiglu_case(*dims, device=torch.device("meta"))
    compiled = gdx.compile_offline(a, w2, dgu, sort, config, gemm="dh_swiglu", swiglu=swiglu)
    sass = sass_or_skip(compiled)
    assert spill_count(sass) <= spill_budget(), "spills"
    assert re.search(r"\bHGMMA\.64x%dx16\.F32\.BF16" % config.block_n, sass)
    chunks = config.block_n // config.swiglu_cols
    # the ring's two boxes, and per item gate, up and h per chunk (the producer); d(gate, up) per chunk (both consumers)
    assert len(re.findall(r"\bUTMALDG\b", sass)) >= 2 + 3 * chunks
    assert len(re.findall(r"\bUTMASTG\b", sass)) == 2 * 2 * chunks
    # 128 accumulator values per thread: gate, up and h by 4-wide ldmatrix (8 values), d(gate, up) by stmatrix
    assert len(re.findall(r"\bLDSM\b", sass)) == 2 * 3 * 128 // 8
    assert len(re.findall(r"\bSTSM\b", sass)) == 2 * 2 * 128 // 8
    assert not re.search(r"\bSTG\b", sass)
    assert len(re.findall(r"\bREDG\.E\.ADD\.F32", sass)) == 2 * 128 // 32
    assert not re.search(r"\b(ATOM|ATOMG)\b", sass)
    assert compiled.metadata.shared <= gdx.smem_bytes(config, gemm="dh_swiglu") <= gdx.HOPPER_SMEM_PER_BLOCK


# ------------------------------------------------------------------------------------------------------------ GPU
def _routing(kind, num_tokens, num_experts, top_k, device):
    if kind == "one_expert":  # every pair on expert 1: the others have no rows
        return torch.ones(num_tokens, top_k, dtype=torch.int64, device=device)
    ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), device=device)  # the last expert gets no rows
    if num_tokens > 1:
        ids[0, 0] = -1  # a dropped slot
    return ids


def _float64_dh(grad_out, w2, sort):
    """dh over the sorted rows in float64 (rows of no pair: NaN, never compared)."""
    rows = sort.tile_expert.numel() * sort.block_m
    ref = torch.full((rows, w2.shape[2]), float("nan"), dtype=torch.float64, device=w2.device)
    ids = sort.sorted_pair_ids.long()
    for e, (start, count) in enumerate(zip(sort.expert_row_start.tolist(), sort.expert_counts.tolist())):
        if count:
            sl = slice(start, start + count)
            ref[sl] = grad_out[ids[sl] // sort.top_k].double() @ w2[e].double()
    return ref


@pytest.mark.gpu
@pytest.mark.parametrize("config", AB_CONFIGS, ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k, routing, num_ctas", [
    (600, 384, 256, 8, 2, "random", None),
    (513, 256, 200, 16, 4, "random", 5),  # F = 200: a partial column block (TMA zero-fills); few CTAs
    (1, 128, 384, 8, 2, "random", None),  # one token
    (1000, 512, 136, 8, 1, "one_expert", None),  # every row on one expert; F = 136
    (4096, 2048, 768, 128, 8, "random", None),  # Qwen3-30B-A3B dims
])
def test_matches_float64_and_the_triton_dh_kernel(config, dtype, num_tokens, d_model, d_ff, num_experts, top_k,
                                                  routing, num_ctas):
    """dh_sm90 over dout gathered by gemms.sorted_rows (NaN in the padding rows it reads: they must not reach
    a valid row) against triton_gemm.dh_launch and float64, on the valid rows; the padding rows of dh (NaN) stay
    untouched."""
    from flashmoe_science.moe import gemms, triton_gemm
    from flashmoe_science.moe.dispatch import sort_pairs_by_expert
    from flashmoe_science.moe.tiles import GemmTiles, choose_tiles

    device = "cuda"
    ids = _routing(routing, num_tokens, num_experts, top_k, device)
    sort = sort_pairs_by_expert(ids, num_experts, 128)
    rows = sort.tile_expert.numel() * 128
    grad_out = torch.randn(num_tokens, d_model, device=device).to(dtype)
    w2 = (torch.randn(num_experts, d_model, d_ff, device=device) / d_model**0.5).to(dtype)
    dout_sorted = gemms.sorted_rows(grad_out, None, sort, rows)
    valid = sort.sorted_pair_ids < sort.num_pairs
    dout_sorted[~valid] = float("nan")
    # 128-row tiles as the Gluon kernel's (the heuristic picks fewer rows for the small cases), with a 128x128 dh tile
    # that fits shared memory at 128 rows
    tiles = replace(choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, torch.device(device)), block_m=128,
                    up_bwd=GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=3))
    ref = torch.full((rows, d_ff), float("nan"), device=device)
    triton_gemm.dh_launch(grad_out, w2, ref, sort, tiles)()
    out = torch.full((rows, d_ff), float("nan"), device=device)
    gdx.dh_sm90(dout_sorted, w2, out, sort, 128, config, num_ctas=num_ctas)
    torch.cuda.synchronize()
    assert out[~valid].isnan().all(), "a padding row of dh was written"
    out, ref = out[valid], ref[valid]
    assert not out.isnan().any()
    ref64 = _float64_dh(grad_out, w2, sort)[valid]
    scale = ref64.abs().max().item()
    # float32 accumulation of 16-bit products in both kernels, in a different order: ~1e-6 of the scale
    assert (out - ref).abs().max().item() <= 1e-5 * scale
    assert (out.double() - ref64).abs().max().item() <= 1e-5 * scale


def _swiglu_operands(sort, num_tokens, top_k, d_ff, dtype, device):
    """The forward's saved gate_up and h as the SwiGLU backward reads them (h = silu(gate) * up, rounded), NaN in the
    rows of no pair (the kernels must mask them), and routing weights (T, k) float32."""
    rows = sort.tile_expert.numel() * 128
    valid = sort.sorted_pair_ids < sort.num_pairs
    gate_up = (2 * torch.randn(rows, 2 * d_ff, device=device)).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=1)
    h = (torch.nn.functional.silu(gate) * up).to(dtype)
    gate_up[~valid] = float("nan")
    h[~valid] = float("nan")
    weights32 = torch.softmax(torch.randn(num_tokens, top_k, device=device), dim=1).contiguous()
    return gate_up, h, weights32


@pytest.mark.gpu
@pytest.mark.parametrize("config", SWIGLU_CONFIGS, ids=lambda c: c.swiglu_label().replace(" ", "-"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k, routing, num_ctas", [
    (600, 512, 1024, 8, 2, "random", None),  # Mixtral-like: 8 experts, top-2, 8 column blocks of F
    (512, 2048, 768, 128, 8, "random", None),  # Qwen3-30B-A3B dims: mostly padding rows (32 pairs per expert)
    (513, 256, 256, 16, 4, "random", 5),  # few CTAs: several items each, the epilogue buffers handed on
    (1, 128, 384, 8, 2, "random", None),  # one token
    (1000, 512, 640, 8, 1, "one_expert", None),  # every row on one expert
])
def test_fused_swiglu_matches_the_triton_dh_and_swiglu_kernels(config, dtype, num_tokens, d_model, d_ff,
                                                              num_experts, top_k, routing, num_ctas):
    """dh_swiglu_sm90 against dh_launch (float32 dh) + swiglu_backward_launch: d(gate, up) equal up to the float32
    accumulation order of dh (a rounding flip of the output dtype now and then), the routing-weight gradient close,
    zeros in the padding rows of used row tiles, rows of unused tiles untouched (NaN). dout's gathered copy, gate_up
    and h hold NaN in every row without a pair: none of it may reach a valid row."""
    from flashmoe_science.moe import gemms, triton_gemm
    from flashmoe_science.moe.dispatch import sort_pairs_by_expert
    from flashmoe_science.moe.tiles import GemmTiles, choose_tiles

    if dtype == torch.float16 and config != gdx.DH_SWIGLU_CONFIG:
        pytest.skip("float16 with the library's config only")
    device = "cuda"
    ids = _routing(routing, num_tokens, num_experts, top_k, device)
    sort = sort_pairs_by_expert(ids, num_experts, 128)
    rows = sort.tile_expert.numel() * 128
    valid = sort.sorted_pair_ids < sort.num_pairs
    used = sort.tile_expert.long()[torch.arange(rows, device=device) // 128] >= 0
    grad_out = torch.randn(num_tokens, d_model, device=device).to(dtype)
    w2 = (torch.randn(num_experts, d_model, d_ff, device=device) / d_model**0.5).to(dtype)
    gate_up, h, weights32 = _swiglu_operands(sort, num_tokens, top_k, d_ff, dtype, device)

    tiles = replace(choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, torch.device(device)), block_m=128,
                    up_bwd=GemmTiles(block_n=128, block_k=64, num_warps=8, num_stages=3))
    dh = torch.full((rows, d_ff), float("nan"), device=device)
    triton_gemm.dh_launch(grad_out, w2, dh, sort, tiles)()
    ref = torch.full((rows, 2 * d_ff), float("nan"), device=device, dtype=dtype)
    ref_dscale = torch.zeros(num_tokens, top_k, device=device)
    triton_gemm.swiglu_backward_launch(gate_up, dh, h, weights32, ref, ref_dscale, sort)()

    dout_sorted = gemms.sorted_rows(grad_out, None, sort, rows)
    dout_sorted[~valid] = float("nan")
    dgu = torch.full((rows, 2 * d_ff), float("nan"), device=device, dtype=dtype)
    dscale = torch.zeros(num_tokens, top_k, device=device)
    gdx.dh_swiglu_sm90(dout_sorted, w2, dgu, SwigluOperands(gate_up, h, weights32, dscale), sort, 128, config,
                       num_ctas=num_ctas)
    torch.cuda.synchronize()

    assert torch.all(dgu[used & ~valid] == 0), "a padding row of a used tile is not zero"
    assert dgu[~used].isnan().all(), "a row of an unused tile was written"
    ours, theirs = dgu[valid].float(), ref[valid].float()
    assert not ours.isnan().any()
    # dh differs in its last float32 bits (K order); after the rounding to dtype most elements are identical and the
    # others one ulp apart
    scale = theirs.abs().max().item()
    diff = (ours - theirs).abs()
    assert torch.all(diff <= torch.finfo(dtype).eps * theirs.abs() + 1e-5 * scale)
    assert (diff > 0).float().mean().item() <= 1e-2  # a systematic error (dh rounded, say) would flip ~half
    # float32 sums over F in another order (and per column block through atomics)
    assert (dscale - ref_dscale).abs().max().item() <= 1e-4 * ref_dscale.abs().max().item()
    assert torch.all(dscale.reshape(-1)[ids.reshape(-1) < 0] == 0)  # dropped slots


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k", [
    (1024, 512, 1024, 8, 2),  # Mixtral-like
    (1500, 512, 384, 8, 2),
    (4096, 2048, 768, 128, 8),  # Qwen3-30B-A3B dims
])
def test_backward_with_the_fused_dh_matches_the_backward_with_the_triton_kernels(monkeypatch, num_tokens, d_model,
                                                                                 d_ff, num_experts, top_k):
    """moe_backward takes dh_swiglu_sm90 on the H200 (128-row tiles); its gradients against moe_backward with
    dh_launch + swiglu_backward_launch, every buffer NaN-poisoned before it is written."""
    from flashmoe_science.backends import Choice
    from flashmoe_science.moe import layer, moe_route
    from flashmoe_science.moe.gemms import TRITON_RUNNERS
    from flashmoe_science.moe.plan import plan_kernels
    from flashmoe_science.moe.tiles import choose_tiles
    from moe_testing import make_experts

    monkeypatch.setenv("FLASHMOE_SCIENCE_POISON", "1")
    device = "cuda"
    x, w1, w2 = make_experts(num_tokens, d_model, d_ff, num_experts, torch.bfloat16, device)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts, device=device), top_k)
    weights32 = weights.float().contiguous()
    tiles = choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, torch.device(device))
    assert tiles.block_m == 128
    _, saved = layer.moe_forward(x, w1, w2, weights32, ids, plan_kernels(x, w1, w2, top_k, tiles, training=True),
                                 save_for_backward=True)
    assert saved.plan.choice("dh_swiglu").backend == "hopper"
    grad_out = torch.randn(num_tokens, d_model, device=device).to(torch.bfloat16)

    calls = []
    fused = gdx.dh_swiglu_sm90
    monkeypatch.setattr(gdx, "dh_swiglu_sm90", lambda *args, **kw: calls.append(1) or fused(*args, **kw))
    ours = layer.moe_backward(grad_out, x, w1, w2, weights32, saved)
    assert calls, "moe_backward did not take the fused Gluon dh"
    triton_dh = tuple((name, Choice("triton", TRITON_RUNNERS[name]) if name == "dh_swiglu" else choice)
                      for name, choice in saved.plan.gemms)
    theirs = layer.moe_backward(grad_out, x, w1, w2, weights32, saved._replace(plan=replace(saved.plan,
                                                                                           gemms=triton_dh)))
    torch.cuda.synchronize()
    assert len(calls) == 1
    for name, a, b in zip(("dx", "dw1", "dw2", "dweights"), ours, theirs):
        assert not a.isnan().any(), name
        scale = b.float().abs().max().item()
        # d(gate, up) differs by a rounding flip here and there; downstream each gradient is rounded to bf16 once
        # more (2^-8); dweights is float32 sums of float32 products
        tolerance = 1e-4 if name == "dweights" else 1e-2
        assert (a.float() - b.float()).abs().max().item() <= tolerance * scale, name
