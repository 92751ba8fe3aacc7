"""The forward's down GEMM in the Gluon sm_90 kernel (moe/hopper/dx_sm90.py, ``down_sm90``: the dx kernel with w2
read K-major and the routing weight in its scatter epilogue): argument checks, launch plumbing and an offline sm_90
build on the CPU; its output against the Triton down kernel and a float32 reference, its prepared launch, and the
forward that runs it, on the GPU (``-m gpu``)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from flashmoe_science.moe.dispatch import sort_buffers  # noqa: E402
from flashmoe_science.moe.hopper import dx_sm90 as gdx  # noqa: E402
from flashmoe_science.moe.hopper.dx_sm90 import DxConfig  # noqa: E402


def _cpu_case(num_tokens=16, top_k=2, num_experts=4, d_model=256, d_ff=128, block_m=128, device="cpu"):
    """Tensors of the right shapes (values unused: nothing runs): h, w2, out32, weights, sort."""
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, block_m, device)  # shapes only
    rows = sort.tile_expert.numel() * block_m
    h = torch.zeros(rows, d_ff, dtype=torch.bfloat16, device=device)
    w2 = torch.zeros(num_experts, d_model, d_ff, dtype=torch.bfloat16, device=device)
    out32 = torch.zeros(num_tokens, d_model, dtype=torch.float32, device=device)
    weights = torch.zeros(num_tokens, top_k, dtype=torch.float32, device=device)
    return h, w2, out32, weights, sort


def test_launch_args_read_w2_k_major_with_the_routing_weights():
    h, w2, out32, weights, sort = _cpu_case()
    grid, args, constexprs = gdx.launch_args(h, w2, out32, sort, 128, DxConfig(), num_ctas=132, gemm="down",
                                             row_scale=weights)
    assert constexprs["EPILOGUE"] == gdx.DOWN.value and gdx.b_k_major(gdx.DOWN)
    assert not gdx.b_k_major(gdx.SCATTER_ADD)
    a_desc, b_desc = args[:2]
    assert a_desc.block_shape == [128, 64]
    assert b_desc.block_shape == [256, 64] and b_desc.shape == [4 * 256, 128]  # w2 viewed (E*d, F): (N, K) boxes
    assert args[5] is out32 and args[10] is weights
    assert args[-3:] == (128, 256, 256)  # K = F, N = d, out32's row stride
    assert grid == (4,)  # at most 4 used row tiles x one 256-wide column block


def test_kernel_head_is_what_launch_args_pass():
    h, w2, out32, weights, sort = _cpu_case()
    config = DxConfig(block_n=128, pingpong=True)
    _, args, _ = gdx.launch_args(h, w2, out32, sort, 128, config, 132, "down", row_scale=weights)
    head = gdx.kernel_head("down", config, h, w2, out32, sort.sorted_pair_ids, sort.tile_expert, sort.expert_counts,
                           sort.expert_row_start, weights)
    assert len(head) == 12
    for mine, theirs in zip(head, args):
        if isinstance(mine, torch.Tensor):
            assert mine is theirs
        else:
            assert mine.base.data_ptr() == theirs.base.data_ptr() and mine.base.shape == theirs.base.shape
            assert (mine.block_shape, mine.shape) == (theirs.block_shape, theirs.shape)


@pytest.mark.parametrize("change, match", [
    (dict(row_scale=None), "row_scale must be the routing weights"),
    (dict(row_scale_dtype=torch.bfloat16), "row_scale must be the routing weights"),
    (dict(w2_transposed=True), r"h must be \(sort rows, F\)"),
    (dict(d_ff=96), "multiple of block_k"),
    (dict(out_rows=3), r"out32 must be \(T, d\)"),
    (dict(out_dtype=torch.bfloat16), "out32 must be float32"),
])
def test_argument_checks_raise_value_errors(change, match):
    h, w2, out32, weights, sort = _cpu_case(d_ff=change.get("d_ff", 128))
    if "row_scale" in change:
        weights = change["row_scale"]
    if "row_scale_dtype" in change:
        weights = weights.to(change["row_scale_dtype"])
    if change.get("w2_transposed"):  # (E, F, d): dx's orientation, not the forward's
        w2 = w2.transpose(1, 2).contiguous()
    if "out_rows" in change:
        out32 = out32[:change["out_rows"]]
    if "out_dtype" in change:
        out32 = out32.to(change["out_dtype"])
    with pytest.raises(ValueError, match=match):
        gdx.launch_args(h, w2, out32, sort, 128, DxConfig(), 132, "down", row_scale=weights)


def test_split_tail_is_allowed_for_down():
    gdx.check_config(DxConfig(split_tail=True), gemm="down")
    assert gdx.down_config(14336) == gdx.dx_config(14336) and gdx.down_config(768) == gdx.dx_config(768)


def test_cpu_forward_keeps_the_triton_down_launch():
    from flashmoe_science.moe.hopper.backend import HopperDown, HopperDownLaunch
    from flashmoe_science.moe.launch import Launch
    from flashmoe_science.moe.plan import plan_kernels
    from flashmoe_science.moe.tiles import choose_tiles

    h, w2, out32, weights, sort = _cpu_case()
    x = torch.zeros(out32.shape, dtype=w2.dtype)
    w1 = torch.zeros(w2.shape[0], 2 * w2.shape[2], w2.shape[1], dtype=w2.dtype)
    tiles = replace(choose_tiles(16, 2, 4, 256, 128, torch.device("cpu")), block_m=128)
    down = plan_kernels(x, w1, w2, 2, tiles).runner("down")
    assert isinstance(down.launch(h, w2, out32, weights, sort, tiles), Launch)
    assert down.sort_tensors == ("sorted_pair_ids", "tile_expert")
    hopper = HopperDown(gdx.down_config(w2.shape[2]))
    assert isinstance(hopper.launch(h, w2, out32, weights, sort, tiles), HopperDownLaunch)
    assert hopper.sort_tensors == gdx.DOWN_SORT_TENSORS


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("config", [gdx.LONG_K_CONFIG, gdx.SHORT_K_CONFIG])
def test_builds_for_sm90_with_transposed_b_and_no_spills(config):
    """The sm_90 binary at Mixtral's dims (ptxas ships with triton: no GPU needed): TMA loads, warpgroup MMAs that
    read B transposed, float32 reductions into the output, no local memory."""
    from flashmoe_science.gluon.build import offline_sass, spill_budget, spill_count

    num_tokens, top_k, num_experts, d_model, d_ff = 4096, 2, 8, 4096, 14336
    dev = torch.device("meta")
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, 128, dev)  # shapes only
    h = torch.empty(sort.tile_expert.numel() * 128, d_ff, dtype=torch.bfloat16, device=dev)
    w2 = torch.empty(num_experts, d_model, d_ff, dtype=torch.bfloat16, device=dev)
    out32 = torch.empty(num_tokens, d_model, dtype=torch.float32, device=dev)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
    compiled = gdx.compile_offline(h, w2, out32, sort, config, gemm="down", row_scale=weights)
    sass = offline_sass(compiled)
    if sass is None:
        pytest.skip("this triton ships no cuobjdump")
    assert "UTMALDG" in sass and "HGMMA" in sass and "RED" in sass
    assert spill_count(sass) <= spill_budget()


# ------------------------------------------------------------------------------------------------------------ GPU
GPU_CONFIGS = [gdx.LONG_K_CONFIG, gdx.SHORT_K_CONFIG, DxConfig(256, 64, 4), DxConfig(128, 64, 5, pingpong=True)]


def _gpu_case(num_tokens, d_model, d_ff, num_experts, top_k):
    """Routing with an expert that gets no rows and a dropped slot; NaN in every padding row of h (they must not
    reach the output); routing weights in (0, 1)."""
    from flashmoe_science.moe.dispatch import sort_pairs_by_expert

    device = "cuda"
    ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), device=device)  # the last expert gets no rows
    ids[0, 0] = -1  # a dropped slot
    sort = sort_pairs_by_expert(ids, num_experts, 128)
    rows = sort.tile_expert.numel() * 128
    h = torch.randn(rows, d_ff, device=device).to(torch.bfloat16)
    h[sort.sorted_pair_ids >= sort.num_pairs] = float("nan")
    w2 = (torch.randn(num_experts, d_model, d_ff, device=device) / d_ff**0.5).to(torch.bfloat16)
    weights = torch.rand(num_tokens, top_k, device=device)
    return h, w2, weights, sort


def _fp32_down(h, w2, weights, sort, num_tokens):
    """out[token] += weight * h[row] @ w2[e].T in float32 by torch (no TF32), per expert over its valid rows."""
    out = torch.zeros(num_tokens, w2.shape[1], device=h.device)
    ids = sort.sorted_pair_ids.long()
    flat_weights = weights.reshape(-1)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for e, (start, count) in enumerate(zip(sort.expert_row_start.tolist(), sort.expert_counts.tolist())):
            if count:
                rows = slice(start, start + count)
                y = (h[rows].float() @ w2[e].float().T) * flat_weights[ids[rows], None]
                out.index_add_(0, ids[rows] // sort.top_k, y)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k, num_ctas", [
    (600, 384, 256, 8, 2, None),  # d = 384: a partial 256-wide column block (B boxes read the next expert's rows)
    (513, 256, 384, 16, 4, 7),  # a partial last wave (split_tail: its items in parts)
    (4096, 2048, 768, 128, 8, None),  # Qwen3-30B-A3B dims
])
def test_matches_the_triton_down_kernel(config, num_tokens, d_model, d_ff, num_experts, top_k, num_ctas):
    """Against triton_gemm.down_forward_launch (both accumulate in float32 and add into float32) and a float32
    reference."""
    from flashmoe_science.moe import triton_gemm
    from flashmoe_science.moe.tiles import choose_tiles

    h, w2, weights, sort = _gpu_case(num_tokens, d_model, d_ff, num_experts, top_k)
    tiles = replace(choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, torch.device("cuda")), block_m=128)
    ref = torch.zeros(num_tokens, d_model, device="cuda")
    triton_gemm.down_forward_launch(h, w2, ref, weights, sort, tiles)()
    out = torch.zeros_like(ref)
    gdx.down_sm90(h, w2, out, weights, sort, 128, config, num_ctas=num_ctas)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= 1e-5 * scale
    assert (out - _fp32_down(h, w2, weights, sort, num_tokens)).abs().max().item() <= 1e-5 * scale


@pytest.mark.gpu
def test_prepared_down_matches_a_direct_call_on_new_tensors():
    """prepare_down's launch, called on other tensors of the same signature (new h, w2, weights and output; the
    same sort), gives what a direct call gives on them."""
    h, w2, weights, sort = _gpu_case(600, 384, 256, 8, 2)
    gdx.down_sm90(h, w2, torch.zeros(600, 384, device="cuda"), weights, sort, 128)
    prepared = gdx.prepare_down(h, w2, torch.zeros(600, 384, device="cuda"), weights, sort)
    h2, w2b, weights2 = torch.randn_like(h), torch.randn_like(w2), torch.rand_like(weights)
    direct, again = torch.zeros(600, 384, device="cuda"), torch.zeros(600, 384, device="cuda")
    gdx.down_sm90(h2, w2b, direct, weights2, sort, 128)
    prepared(h2, w2b, again, weights2, *(getattr(sort, name) for name in gdx.DOWN_SORT_TENSORS))
    torch.cuda.synchronize()
    assert (again - direct).abs().max().item() <= 1e-5 * direct.abs().max().item()


@pytest.mark.gpu
def test_forward_runs_the_gluon_down_and_matches_the_reference():
    """moe_forward on Hopper with 128-row tiles takes the Gluon down kernel (HopperDownLaunch); its output, eager
    and prepared, against the float64 reference within 2x PyTorch's own bf16 error."""
    from flashmoe_science.moe import layer, moe_route
    from flashmoe_science.moe.hopper.backend import HopperDownLaunch
    from flashmoe_science.moe.plan import plan_kernels
    from moe_testing import assert_within_budget, make_experts, reference64, torch_loop_same_dtype

    torch.manual_seed(0)
    num_tokens, num_experts, top_k, d_model, d_ff = 1024, 8, 2, 512, 768
    x, w1, w2 = make_experts(num_tokens, d_model, d_ff, num_experts, torch.bfloat16, "cuda")
    weights, ids = moe_route(torch.randn(num_tokens, num_experts, device="cuda"), top_k)
    weights32 = weights.float().contiguous()
    plan = plan_kernels(x, w1, w2, top_k)
    if plan.tiles.block_m != 128:
        pytest.skip(f"the heuristic chose block_m={plan.tiles.block_m}")
    *_, launches = layer._forward_launches(x, w1, w2, weights32, ids, plan)
    assert isinstance(launches[-1], HopperDownLaunch)
    out, _ = layer.moe_forward(x, w1, w2, weights32, ids)
    prepared = layer.prepare_forward(x, w1, w2, weights32, ids)
    assert prepared.down_sort_tensors == gdx.DOWN_SORT_TENSORS
    again = prepared(x, w1, w2, weights32, ids)
    ref = reference64(x, w1, w2, weights, ids)
    baseline = torch_loop_same_dtype(x, w1, w2, weights, ids)
    assert_within_budget("eager", out, baseline, ref)
    assert_within_budget("prepared", again, baseline, ref)


# ---------------------------------------------------------------------------------------------- the rows combine
def test_rows_variant_stores_to_sorted_rows_in_the_operand_dtype():
    # the rows combine (tiles.COMBINES): out is (sort rows, d) in h's dtype; the float32 (T, d) accumulator and a
    # config with the tail split (its K parts only meet in atomics) are refused
    h, w2, out32, weights, sort = _cpu_case()
    rows = torch.zeros(h.shape[0], w2.shape[1], dtype=torch.bfloat16)
    config = gdx.down_config(w2.shape[2], rows=True)
    _, args, constexprs = gdx.launch_args(h, w2, rows, sort, 128, config, num_ctas=132, gemm="down_rows",
                                          row_scale=weights)
    assert constexprs["EPILOGUE"] == gdx.DOWN_ROWS.value and gdx.b_k_major(gdx.DOWN_ROWS)
    assert args[5] is rows and args[-1] == rows.stride(0)
    assert "out_rows must be (sort rows, d)" in gdx.unsupported_reason(h, w2, out32.to(torch.bfloat16), sort, 128,
                                                                       config, "down_rows", row_scale=weights)
    assert "dtype" in gdx.unsupported_reason(h, w2, rows.float(), sort, 128, config, "down_rows", row_scale=weights)
    assert "split_tail" in gdx.unsupported_reason(h, w2, rows, sort, 128, replace(config, split_tail=True),
                                                  "down_rows", row_scale=weights)
    assert not gdx.down_config(14336, rows=True).split_tail and gdx.down_config(14336).split_tail


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("gemm", ["down_rows", "dx_rows"])
def test_rows_variants_build_for_sm90_with_plain_stores_and_no_spills(gemm):
    """The rows combine's down and dx at the TorchTitan Qwen3-MoE job's dims (d = 1536, F = 256, 64 experts, top-8,
    16384 tokens) in the tile the planner gives them: TMA loads, warpgroup MMAs, bf16 stores and no atomics."""
    import re

    from flashmoe_science.gluon.build import offline_sass, spill_budget, spill_count
    from flashmoe_science.moe.hopper.backend import _config

    num_tokens, top_k, num_experts, d_model, d_ff = 16384, 8, 64, 1536, 256
    dev = torch.device("meta")
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, 128, dev)  # shapes only
    rows = sort.tile_expert.numel() * 128
    out = torch.empty(rows, d_model, dtype=torch.bfloat16, device=dev)
    config = _config(gemm, d_ff)
    if gemm == "down_rows":
        a = torch.empty(rows, d_ff, dtype=torch.bfloat16, device=dev)
        w = torch.empty(num_experts, d_model, d_ff, dtype=torch.bfloat16, device=dev)
        weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
        compiled = gdx.compile_offline(a, w, out, sort, config, gemm=gemm, row_scale=weights)
    else:
        a = torch.empty(rows, 2 * d_ff, dtype=torch.bfloat16, device=dev)
        w = torch.empty(num_experts, 2 * d_ff, d_model, dtype=torch.bfloat16, device=dev)
        compiled = gdx.compile_offline(a, w, out, sort, config, gemm=gemm)
    sass = offline_sass(compiled)
    if sass is None:
        pytest.skip("this triton ships no cuobjdump")
    assert re.search(r"\bHGMMA\.64x%dx16\.F32\.BF16" % config.block_n, sass)
    assert re.search(r"\bUTMALDG\b", sass) and re.search(r"\bSTG\.E\b", sass)
    assert not re.search(r"\bRED", sass), "the rows combine's epilogue adds nothing atomically"
    assert spill_count(sass) <= spill_budget()
