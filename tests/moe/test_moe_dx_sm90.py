"""The Gluon sm_90 dx GEMM (moe/hopper/dx_sm90.py, its scatter epilogue; the dh mode: test_moe_dh_sm90.py):
argument checks, launch plumbing, an offline sm_90 build and a model of its barrier protocol on the CPU; its output
against the Triton dx kernel on the GPU (``-m gpu``)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from flashmoe_science.moe.dispatch import sort_buffers  # noqa: E402
from flashmoe_science.moe.hopper import dx_sm90 as gdx  # noqa: E402
from flashmoe_science.moe.hopper.dx_sm90 import DxConfig  # noqa: E402
from sm90_protocol import grouped_block, simulate, unit_item, work_units  # noqa: E402


def _cpu_case(num_tokens=16, top_k=2, num_experts=4, d_model=64, two_d_ff=128, block_m=128, device="cpu"):
    """Tensors of the right shapes (values unused: nothing runs)."""
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, block_m, device)  # shapes only
    tiles_max = sort.tile_expert.numel()
    dgu = torch.zeros(tiles_max * block_m, two_d_ff, dtype=torch.bfloat16, device=device)
    w1 = torch.zeros(num_experts, two_d_ff, d_model, dtype=torch.bfloat16, device=device)
    dx32 = torch.zeros(num_tokens, d_model, dtype=torch.float32, device=device)
    return dgu, w1, dx32, sort


def test_launch_args_for_a_valid_call():
    dgu, w1, dx32, sort = _cpu_case()
    grid, args, constexprs = gdx.launch_args(dgu, w1, dx32, sort, 128, DxConfig(), num_ctas=132)
    # 32 pairs over 4 experts: at most 0 + 4 row tiles; d = 64: one 256-wide column block
    assert grid == (sort.tile_expert.numel(),) == (4,)
    assert constexprs == dict(GROUP_M=8, NUM_STAGES=4, PINGPONG=False, ROWS=64, EPILOGUE=gdx.SCATTER_ADD.value,
                              SPLIT_TAIL=False)
    a_desc, b_desc = args[:2]
    assert a_desc.block_shape == [128, 64] and b_desc.block_shape == [64, 256]
    assert b_desc.shape == [4 * 128, 64]  # w1 viewed as (E*2F, d)
    assert args[5] is dx32
    assert args[-3:] == (128, 64, 64)  # K = 2F, N = d, dx32's row stride
    _, _, constexprs = gdx.launch_args(dgu, w1, dx32, sort, 128, DxConfig(block_n=128, pingpong=True), num_ctas=132)
    assert constexprs["ROWS"] == 128 and constexprs["PINGPONG"]


@pytest.mark.parametrize("change, match", [
    (dict(block_m=64), "128-row tiles"),
    (dict(sort_block_m=64), "128-row tiles"),
    (dict(two_d_ff=96), "multiple of block_k"),
    (dict(dtype=torch.float32), "16-bit float"),
    (dict(dx_dtype=torch.bfloat16), "dx32 must be float32"),
    (dict(dgu_rows=-128), r"dgu must be \(sort rows, 2F\)"),
    (dict(dx_rows=3), r"dx32 must be \(T, d\)"),
    (dict(d_model=60), "16-byte aligned rows"),
    (dict(w1_strided=True), "contiguous"),
    (dict(dgu_offset=True), "aligned base"),
    (dict(config=DxConfig(block_n=256, pingpong=True)), "pingpong needs block_n 128"),
    (dict(config=DxConfig(block_n=64)), "block_n must be 128 or 256"),
    (dict(config=DxConfig(num_stages=1)), "at least 2"),
    (dict(config=DxConfig(block_n=256, num_stages=5)), "shared memory"),
])
def test_argument_checks_raise_value_errors(change, match):
    d_model, two_d_ff = change.get("d_model", 64), change.get("two_d_ff", 128)
    dgu, w1, dx32, sort = _cpu_case(d_model=d_model, two_d_ff=two_d_ff)
    if "sort_block_m" in change:
        sort = sort._replace(block_m=change["sort_block_m"])
    if "dtype" in change:
        dgu, w1 = dgu.to(change["dtype"]), w1.to(change["dtype"])
    if "dx_dtype" in change:
        dx32 = dx32.to(change["dx_dtype"])
    if "dgu_rows" in change:
        dgu = dgu[:change["dgu_rows"]]
    if "dx_rows" in change:
        dx32 = dx32[:change["dx_rows"]]
    if change.get("dgu_offset"):  # a contiguous view 2 bytes into its storage
        dgu = torch.zeros(dgu.numel() + 1, dtype=dgu.dtype)[1:].view(dgu.shape)
    if change.get("w1_strided"):
        w1 = w1.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match=match):
        gdx.launch_args(dgu, w1, dx32, sort, change.get("block_m", 128), change.get("config", DxConfig()), 132)


def test_split_tail_is_refused_outside_dx():
    with pytest.raises(ValueError, match="split_tail needs dx"):
        gdx.check_config(DxConfig(block_n=128, pingpong=True, split_tail=True), gemm="dh")
    gdx.check_config(DxConfig(split_tail=True), gemm="dx")


def test_dx_config_by_k():
    # cooperative 128x256 with the tail split at long K (Mixtral's 2F = 28672), ping-pong at short K (Qwen3's 1536)
    assert gdx.dx_config(28672) == gdx.LONG_K_CONFIG and gdx.LONG_K_CONFIG.split_tail
    assert gdx.dx_config(1536) == gdx.SHORT_K_CONFIG and gdx.SHORT_K_CONFIG.pingpong
    assert gdx.dx_config(gdx.LONG_K) == gdx.LONG_K_CONFIG and gdx.dx_config(gdx.LONG_K - 64) == gdx.SHORT_K_CONFIG
    for config in (gdx.LONG_K_CONFIG, gdx.SHORT_K_CONFIG):
        gdx.check_config(config)


def test_split_tail_grid_takes_every_sm():
    dgu, w1, dx32, sort = _cpu_case()  # 4 row tiles x 1 column block, K = 128: 2 K steps each
    grid, _, constexprs = gdx.launch_args(dgu, w1, dx32, sort, 128, DxConfig(split_tail=True), num_ctas=132)
    assert grid == (8,) and constexprs["SPLIT_TAIL"]


def test_cpu_tensors_are_refused_with_a_value_error():
    dgu, w1, dx32, sort = _cpu_case()
    with pytest.raises(ValueError, match="CUDA"):
        gdx.dx_sm90(dgu, w1, dx32, sort, 128)


def test_configs_of_the_ab_script_fit_shared_memory():
    for config in (DxConfig(256, 64, 3), DxConfig(256, 64, 4), DxConfig(128, 64, 5),
                   DxConfig(128, 64, 6, pingpong=True)):
        gdx.check_config(config)


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("config", [DxConfig(), gdx.LONG_K_CONFIG, gdx.SHORT_K_CONFIG])
def test_builds_for_sm90_with_tma_wgmma_and_no_spills(config):
    """The sm_90 binary (ptxas ships with triton: no GPU needed): TMA loads, warpgroup MMAs, no local memory."""
    import re

    from flashmoe_science.gluon.build import offline_sass, spill_budget, spill_count

    num_tokens, top_k, num_experts = 4096, 2, 8
    dev = torch.device("meta")
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, 128, dev)  # shapes only
    tiles_max = sort.tile_expert.numel()
    dgu = torch.empty(tiles_max * 128, 28672, dtype=torch.bfloat16, device=dev)
    w1 = torch.empty(num_experts, 28672, 4096, dtype=torch.bfloat16, device=dev)
    dx32 = torch.empty(num_tokens, 4096, dtype=torch.float32, device=dev)
    compiled = gdx.compile_offline(dgu, w1, dx32, sort, config)
    sass = offline_sass(compiled)
    if sass is None:
        pytest.skip("no cuobjdump in this triton")
    assert re.search(r"\bHGMMA\.64x%dx16\.F32\.BF16" % config.block_n, sass)
    assert re.search(r"\bUTMALDG\b", sass)
    assert re.search(r"\bREDG\.E\.ADD\.F32", sass)
    assert spill_count(sass) <= spill_budget(), "spills"
    assert compiled.metadata.shared <= gdx.HOPPER_SMEM_PER_BLOCK


# ------------------------------------------------------------------------------------------ the barrier protocol
# sm90_protocol's model of the partitions (shared with wgrad_sm90's tests), over dx's work items: K = 2F steps per
# row tile of an expert, none for the unused tiles (tile_expert -1)
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("stages", [2, 3, 5])
def test_barrier_protocol_model(pingpong, stages):
    # 7 row tiles (the last one unused: tile_expert -1) x 4 column blocks, GROUP_M 3, 3 CTAs
    tile_expert = [0, 0, 1, 1, 1, 2, -1]
    for k_steps in (1, 2, 7):
        for cta in range(3):
            items = [(w, k_steps if tile_expert[grouped_block(w, 7, 4, 3)[0]] >= 0 else 0) for w in range(cta, 28, 3)]
            expected = [w for w, steps in items if steps]
            for seed in range(6):
                errors, done = simulate(seed, stages, pingpong, items)
                assert not errors, errors[:3]
                if pingpong:
                    assert sorted(done[0] + done[1]) == expected
                else:
                    assert done[0] == done[1] == expected


@pytest.mark.parametrize("num_ctas", [1, 7, 132])
@pytest.mark.parametrize("k_steps", [1, 3, 448])
def test_split_tail_units_cover_every_k_step_once(num_ctas, k_steps):
    """split_tail's work units (sm90_protocol mirrors _work_units / _unit_item): every K step of every item exactly
    once, whole items first, and the last wave's units spread over the CTAs as evenly as whole K steps allow."""
    for num_work in (1, 5, 131, 132, 133, 263, 1088, 2176):
        whole, parts, num_units = work_units(num_work, k_steps, num_ctas, True)
        seen = {}
        for unit in range(num_units):
            work, first, steps = unit_item(unit, whole, parts, k_steps)
            assert steps >= 1
            for ks in range(first, first + steps):
                seen[(work, ks)] = seen.get((work, ks), 0) + 1
        assert seen == {(w, k): 1 for w in range(num_work) for k in range(k_steps)}
        assert num_units - whole <= max(num_ctas, num_work % num_ctas)  # the tail's units fit one wave
        assert work_units(num_work, k_steps, num_ctas, False) == (num_work, 1, num_work)


@pytest.mark.parametrize("pingpong", [False, True])
def test_barrier_protocol_model_with_split_tail(pingpong):
    # 10 items of 5 K steps on 4 CTAs: 8 whole, the last 2 in 2 parts each (2 and 3 K steps)
    whole, parts, num_units = work_units(10, 5, 4, True)
    assert (whole, parts, num_units) == (8, 2, 12)
    for cta in range(4):
        items = [(unit, unit_item(unit, whole, parts, 5)[2]) for unit in range(cta, num_units, 4)]
        for seed in range(6):
            errors, done = simulate(seed, 3, pingpong, items)
            assert not errors, errors[:3]
            finished = sorted(done[0] + done[1]) if pingpong else done[0]
            assert finished == [unit for unit, _ in items]


# ------------------------------------------------------------------------------------------------------------ GPU
GPU_CONFIGS = [DxConfig(256, 64, 3), DxConfig(256, 64, 4), DxConfig(128, 64, 4), DxConfig(128, 64, 5),
               DxConfig(128, 64, 3, pingpong=True), DxConfig(128, 64, 5, pingpong=True),
               DxConfig(256, 64, 4, split_tail=True), DxConfig(128, 64, 4, pingpong=True, split_tail=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k, num_ctas", [
    (600, 384, 256, 8, 2, None),  # d = 384: a partial 256-wide column block
    (513, 256, 384, 16, 4, 5),  # few CTAs: many (an odd number of) items each
    (513, 256, 384, 16, 4, 7),  # a partial last wave (split_tail: its items in parts)
    (4096, 2048, 768, 128, 8, None),  # Qwen3-30B-A3B dims
])
def test_matches_the_triton_dx_kernel(config, num_tokens, d_model, d_ff, num_experts, top_k, num_ctas):
    """Against triton_gemm.dx_launch (both accumulate in float32 and add into float32) and a float32 reference,
    with NaN in every padding row of d(gate, up), an expert without rows and a dropped slot."""
    from flashmoe_science.moe import triton_gemm
    from flashmoe_science.moe.dispatch import sort_pairs_by_expert
    from flashmoe_science.moe.tiles import choose_tiles

    device = "cuda"
    ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), device=device)  # the last expert gets no rows
    ids[0, 0] = -1  # a dropped slot
    sort = sort_pairs_by_expert(ids, num_experts, 128)
    rows = sort.tile_expert.numel() * 128
    dgu = torch.randn(rows, 2 * d_ff, device=device).to(torch.bfloat16)
    dgu[sort.sorted_pair_ids >= sort.num_pairs] = float("nan")
    w1 = (torch.randn(num_experts, 2 * d_ff, d_model, device=device) / d_ff**0.5).to(torch.bfloat16)
    tiles = replace(choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, torch.device(device)), block_m=128)
    ref = torch.zeros(num_tokens, d_model, device=device)
    triton_gemm.dx_launch(dgu, w1, ref, sort, tiles)()
    out = torch.zeros_like(ref)
    gdx.dx_sm90(dgu, w1, out, sort, 128, config, num_ctas=num_ctas)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= 1e-5 * scale
    # float32 reference (no TF32): the valid rows of each expert
    ref32 = torch.zeros_like(ref)
    ids_sorted = sort.sorted_pair_ids.long()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for e, (start, count) in enumerate(zip(sort.expert_row_start.tolist(), sort.expert_counts.tolist())):
            if count:
                sl = slice(start, start + count)
                ref32.index_add_(0, ids_sorted[sl] // top_k, dgu[sl].float() @ w1[e].float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert (out - ref32).abs().max().item() <= 1e-5 * scale
