"""The Gluon sm_90 weight-gradient GEMM (moe/hopper/wgrad_sm90.py): argument checks, launch plumbing, offline sm_90
builds, its work decomposition and a model of its barrier protocol on the CPU; its output against the Triton
kernel (``triton_gemm.wgrad_launch``) on the GPU (``-m gpu``), on synthetic operands and on the backward's own."""

from __future__ import annotations

import os
import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from flashmoe_science.moe.dispatch import ExpertSort, sort_buffers  # noqa: E402
from flashmoe_science.moe.hopper import wgrad_sm90 as gw  # noqa: E402
from flashmoe_science.moe.hopper.wgrad_sm90 import WgradConfig  # noqa: E402
from sm90_protocol import grouped_block, simulate  # noqa: E402

# the configs the A/B script measured (scripts/ab_moe_wgrad_sm90.py, git history)
AB_CONFIGS = [WgradConfig(256, 64, 3), WgradConfig(256, 64, 4, epilogue_split=2),
              WgradConfig(128, 64, 4, pingpong=True), WgradConfig(128, 64, 5, pingpong=True),
              WgradConfig(128, 64, 6, pingpong=True, epilogue_split=2)]


def _cpu_case(num_tokens=16, top_k=2, num_experts=4, M=256, N=64, block_m=128, device="cpu"):
    """Tensors of the right shapes (values unused: nothing runs)."""
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, block_m, device)  # shapes only
    tiles_max = sort.tile_expert.numel()
    a = torch.zeros(tiles_max * block_m, M, dtype=torch.bfloat16, device=device)
    b = torch.zeros(tiles_max * block_m, N, dtype=torch.bfloat16, device=device)
    out = torch.zeros(num_experts, M, N, dtype=torch.bfloat16, device=device)
    return a, b, out, sort


def test_launch_args_for_a_valid_call():
    a, b, out, sort = _cpu_case()
    grid, args, constexprs = gw.launch_args(a, b, out, sort, WgradConfig(), num_ctas=132)
    # 4 experts x (256 / 128 row blocks) x (64 columns: one 256-wide column block) = 8 work items
    assert grid == (8,)
    assert constexprs == dict(GROUP_M=8, NUM_STAGES=3, PINGPONG=False, ROWS=64, EPI_SPLIT=1)
    a_desc, b_desc, out_desc = args[:3]
    assert a_desc.block_shape == [64, 128] and b_desc.block_shape == [64, 256]  # (K rows, M) and (K rows, N) boxes
    assert out_desc.shape == [4 * 256, 64] and out_desc.block_shape == [64, 256]  # out viewed as (E*M, N)
    assert args[3:5] == (sort.expert_counts, sort.expert_row_start) and args[5:] == (4, 256, 64)
    _, args, constexprs = gw.launch_args(a, b, out, sort, WgradConfig(block_n=128, pingpong=True, epilogue_split=2),
                                         num_ctas=3)
    assert constexprs["ROWS"] == 128 and constexprs["PINGPONG"] and constexprs["EPI_SPLIT"] == 2
    assert args[2].block_shape == [128, 64]
    assert gw.launch_args(a, b, out, sort, WgradConfig(), num_ctas=3)[0] == (3,)


@pytest.mark.parametrize("change, match", [
    (dict(M=192), "multiple of 128"),
    (dict(sort_block_m=32), "multiple of block_k"),
    (dict(dtype=torch.float32), "16-bit float"),
    (dict(out_dtype=torch.float16), "16-bit float"),
    (dict(a_rows=-128), r"a and b must be \(sort rows, M\)"),
    (dict(out_experts=3), "the sort has 4 experts"),
    (dict(N=60), "16-byte aligned rows"),
    (dict(b_strided=True), "contiguous"),
    (dict(a_offset=True), "aligned base"),
    (dict(config=WgradConfig(block_n=256, pingpong=True)), "pingpong needs block_n 128"),
    (dict(config=WgradConfig(block_n=64)), "block_n must be 128 or 256"),
    (dict(config=WgradConfig(num_stages=1)), "at least 2"),
    (dict(config=WgradConfig(epilogue_split=4)), "epilogue_split"),
    (dict(config=WgradConfig(block_n=256, num_stages=4)), "shared memory"),
])
def test_argument_checks_raise_value_errors(change, match):
    a, b, out, sort = _cpu_case(M=change.get("M", 256), N=change.get("N", 64))
    if "sort_block_m" in change:
        sort = sort._replace(block_m=change["sort_block_m"])
        a, b = a[:sort.tile_expert.numel() * 32], b[:sort.tile_expert.numel() * 32]
    if "dtype" in change:
        a, b, out = a.to(change["dtype"]), b.to(change["dtype"]), out.to(change["dtype"])
    if "out_dtype" in change:
        out = out.to(change["out_dtype"])
    if "a_rows" in change:
        a = a[:change["a_rows"]]
    if "out_experts" in change:
        out = out[:change["out_experts"]]
    if change.get("a_offset"):  # a contiguous view 2 bytes into its storage
        a = torch.zeros(a.numel() + 1, dtype=a.dtype)[1:].view(a.shape)
    if change.get("b_strided"):
        b = b.t().contiguous().t()
    with pytest.raises(ValueError, match=match):
        gw.launch_args(a, b, out, sort, change.get("config", WgradConfig()), 132)


def test_cpu_tensors_are_refused_with_a_value_error():
    a, b, out, sort = _cpu_case()
    with pytest.raises(ValueError, match="CUDA"):
        gw.wgrad_sm90(a, b, out, sort)


def test_configs_of_the_ab_script_fit_shared_memory():
    for config in AB_CONFIGS:
        gw.check_config(config)


def test_work_items_cover_every_output_tile_once_within_the_experts_rows():
    """The kernel's work decomposition, in Python (``_work_item`` over every CTA's items): each (expert, row block,
    column block) once; each K step's rows inside the expert's rows padded to the sort's block_m."""
    num_experts, row_blocks, col_blocks, group_m = 5, 7, 3, 3
    for num_ctas in (1, 4, 132):
        seen = []
        for cta in range(num_ctas):
            for work in range(cta, num_experts * row_blocks * col_blocks, num_ctas):
                per_expert = row_blocks * col_blocks
                seen.append((work // per_expert, *grouped_block(work % per_expert, row_blocks, col_blocks, group_m)))
        assert sorted(seen) == [(e, i, j) for e in range(num_experts) for i in range(row_blocks)
                                for j in range(col_blocks)]
    for block_k in (32, 64, 128):
        for count in range(0, 300):
            padded = -(-count // 128) * 128
            steps = -(-count // block_k)
            assert count <= steps * block_k <= padded


@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("stages", [2, 3, 5])
def test_barrier_protocol_model(pingpong, stages):
    # sm90_protocol's model (shared with dx_sm90's tests) over wgrad's items: 4 experts with 3, 0, 1 and 5 K steps,
    # 2 x 3 tiles each, GROUP_M 2, 3 CTAs; every item reaches its epilogue, the empty expert's too (zeros)
    steps_of_expert = [3, 0, 1, 5]
    for cta in range(3):
        items = [(w, steps_of_expert[w // 6]) for w in range(cta, 24, 3)]
        for seed in range(6):
            errors, done = simulate(seed, stages, pingpong, items, epilogue_without_steps=True)
            assert not errors, errors[:3]
            expected = [w for w, _ in items]
            if pingpong:
                assert sorted(done[0] + done[1]) == expected
            else:
                assert done[0] == done[1] == expected


def _meta_dw1(num_tokens=4096, top_k=2, num_experts=8, d_model=4096, d_ff=14336):
    dev = torch.device("meta")
    sort, _, _ = sort_buffers(num_tokens, top_k, num_experts, 128, dev)  # shapes only
    tiles_max = sort.tile_expert.numel()
    a = torch.empty(tiles_max * 128, 2 * d_ff, dtype=torch.bfloat16, device=dev)
    b = torch.empty(tiles_max * 128, d_model, dtype=torch.bfloat16, device=dev)
    out = torch.empty(num_experts, 2 * d_ff, d_model, dtype=torch.bfloat16, device=dev)
    return a, b, out, sort


@pytest.mark.sm90_build
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="a real sm_90 build, not the interpreter")
@pytest.mark.parametrize("config", [WgradConfig(), WgradConfig(num_stages=4, epilogue_split=2),
                                    WgradConfig(block_n=128, num_stages=5, pingpong=True)],
                         ids=lambda c: c.label().replace(" ", "-"))
def test_builds_for_sm90_with_tma_wgmma_from_shared_memory_and_no_spills(config):
    """The sm_90 binary (ptxas ships with triton: no GPU needed): TMA loads and stores, warpgroup MMAs that read A
    transposed (tnspA) and B from shared-memory descriptors, no local memory, no operand loads into registers."""
    from flashmoe_science.gluon.build import offline_sass, spill_budget, spill_count

    compiled = gw.compile_offline(*_meta_dw1(), config)
    sass = offline_sass(compiled)
    if sass is None:
        pytest.skip("no cuobjdump in this triton")
    hgmma = re.findall(r"\bHGMMA\.64x(\d+)x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB", sass)
    assert hgmma and set(hgmma) == {str(config.block_n)}
    assert len(hgmma) == len(re.findall(r"\bHGMMA\b", sass))  # every HGMMA: both operands from shared memory
    assert re.search(r"\bUTMALDG\b", sass) and re.search(r"\bUTMASTG\b", sass)
    assert not re.search(r"\bLDSM\b", sass), "operands through registers"
    assert spill_count(sass) <= spill_budget(), "spills"
    assert compiled.metadata.shared <= gw.smem_bytes(config) <= gw.HOPPER_SMEM_PER_BLOCK


# ------------------------------------------------------------------------------------------------------------ GPU
GPU_CONFIGS = [WgradConfig(256, 64, 3), WgradConfig(256, 64, 4, epilogue_split=2),
               WgradConfig(128, 64, 4, pingpong=True), WgradConfig(128, 64, 5, pingpong=True, group_m=2)]


def _operands(sort, M, N, block_k, device):
    """Sorted-row operands a (rows, M), b (rows, N): random rows for the experts' pairs, zeros in the padding rows
    the kernel reads (up to the expert's next multiple of block_k, as the library's producers leave them: zeros in
    every padding row), NaN in every other row (must never be read); and the float32 reference a_e^T b_e."""
    rows = sort.tile_expert.numel() * sort.block_m
    a = torch.full((rows, M), float("nan"), device=device, dtype=torch.bfloat16)
    b = torch.full((rows, N), float("nan"), device=device, dtype=torch.bfloat16)
    ref32 = torch.zeros(len(sort.expert_counts), M, N, device=device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for e, (start, count) in enumerate(zip(sort.expert_row_start.tolist(), sort.expert_counts.tolist())):
            read = -(-count // block_k) * block_k
            a[start:start + read] = 0
            b[start:start + read] = 0
            a[start:start + count] = torch.randn(count, M, device=device).to(torch.bfloat16)
            b[start:start + count] = torch.randn(count, N, device=device).to(torch.bfloat16)
            ref32[e] = a[start:start + count].float().T @ b[start:start + count].float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return a, b, ref32


def _triton_wgrad(a, b, sort):
    from flashmoe_science.moe import triton_gemm
    from flashmoe_science.moe.tiles import GemmTiles

    out = torch.full((len(sort.expert_counts), a.shape[1], b.shape[1]), float("nan"), device=a.device,
                     dtype=a.dtype)
    triton_gemm.wgrad_launch(a, b, out, sort, GemmTiles(256, 64, 8, 3, block_m=128), group_m=8)()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("num_tokens, M, N, num_experts, top_k, num_ctas", [
    (600, 512, 384, 8, 2, None),  # N = 384: a partial 256-wide column block
    (513, 768, 256, 16, 4, 5),  # few CTAs: many (an odd number of) items each
    (4096, 1536, 2048, 128, 8, None),  # Qwen3-30B-A3B's dw1
])
def test_matches_the_triton_wgrad_kernel(config, num_tokens, M, N, num_experts, top_k, num_ctas):
    """Against triton_gemm.wgrad_launch and a float32 reference, with NaN in every row the kernel must not read, an
    expert without rows (its output must come out zero) and a dropped slot; out poisoned with NaN."""
    from flashmoe_science.moe.dispatch import sort_pairs_by_expert

    device = "cuda"
    ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), device=device)  # the last expert gets no rows
    ids[0, 0] = -1  # a dropped slot
    sort = sort_pairs_by_expert(ids, num_experts, 128)
    a, b, ref32 = _operands(sort, M, N, config.block_k, device)
    ref = _triton_wgrad(a, b, sort)
    out = torch.full_like(ref, float("nan"))
    gw.wgrad_sm90(a, b, out, sort, config, num_ctas=num_ctas)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert torch.all(out[-1] == 0)
    scale = ref32.abs().max().item()
    # both round a float32 sum to bf16 once (an element's error <= 2^-9 of it)
    assert (out.float() - ref.float()).abs().max().item() <= 8e-3 * scale
    assert (out.float() - ref32).abs().max().item() <= 8e-3 * scale


@pytest.mark.gpu
@pytest.mark.parametrize("config", [WgradConfig(256, 64, 3), WgradConfig(128, 64, 4, pingpong=True)],
                         ids=lambda c: c.label().replace(" ", "-"))
def test_on_the_backward_operands(monkeypatch, config):
    """dw1 and dw2 from the operands the library's kernels produce (training forward's h, the SwiGLU backward's
    d(gate, up), the row gathers' x and weight * dout), NaN-poisoned before they are written: their padding rows
    must come out zero for this kernel to match the Triton one."""
    from flashmoe_science.moe import gemms, layer, moe_route, triton_gemm
    from flashmoe_science.moe.plan import plan_kernels
    from flashmoe_science.moe.tiles import choose_tiles
    from moe_testing import make_experts

    monkeypatch.setenv("FLASHMOE_SCIENCE_POISON", "1")
    device = "cuda"
    num_tokens, d_model, d_ff, num_experts, top_k = 1500, 512, 384, 8, 2
    x, w1, w2 = make_experts(num_tokens, d_model, d_ff, num_experts, torch.bfloat16, device)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts, device=device), top_k)
    weights32 = weights.float().contiguous()
    tiles = choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, torch.device(device))
    assert tiles.block_m == 128
    _, saved = layer.moe_forward(x, w1, w2, weights32, ids, plan_kernels(x, w1, w2, top_k, tiles, training=True),
                                 save_for_backward=True)
    sort = saved.sort
    grad_out = torch.randn(num_tokens, d_model, device=device).to(torch.bfloat16)
    dgu, dweights = layer.backward_buffers(x, w1, sort, tiles)
    dh = gemms.dh_buffer(dgu)
    triton_gemm.dh_launch(grad_out, w2, dh, sort, tiles)()
    triton_gemm.swiglu_backward_launch(saved.gate_up, dh, saved.h, weights32, dgu, dweights, sort)()
    num_rows = dgu.shape[0]
    x_sorted = gemms.sorted_rows(x, None, sort, num_rows)
    g_sorted = gemms.sorted_rows(grad_out, weights32, sort, num_rows)
    for name, a, b, shape in (("dw1", dgu, x_sorted, w1.shape), ("dw2", g_sorted, saved.h, w2.shape)):
        ref = _triton_wgrad(a, b, sort)
        out = torch.full(shape, float("nan"), device=device, dtype=torch.bfloat16)
        gw.wgrad_sm90(a, b, out, sort, config)
        torch.cuda.synchronize()
        assert not out.isnan().any(), name
        scale = ref.float().abs().max().item()
        assert (out.float() - ref.float()).abs().max().item() <= 8e-3 * scale, name


def test_gpu_operand_helper_is_consistent():
    """_operands (it reads only the sort's counts and first rows) on the CPU: zeros exactly up to the read boundary,
    NaN past it."""
    counts = [130, 64, 0, 1]
    tiles = [-(-c // 128) for c in counts]
    starts = [128 * sum(tiles[:e]) for e in range(len(counts))]
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    sort = ExpertSort(i32([0] * 128 * (sum(tiles) + 1)), i32([0]), i32([0] * (sum(tiles) + 1)), i32(counts),
                      i32(starts), 128, 1, sum(counts))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    a, b, ref32 = _operands(sort, 16, 8, 64, "cpu")
    assert torch.backends.cuda.matmul.allow_tf32 == tf32
    for start, count in zip(starts, counts):
        read = -(-count // 64) * 64
        for t in (a, b):
            assert not t[start:start + count].isnan().any() and torch.all(t[start + count:start + read] == 0)
            assert t[start + read:start + -(-count // 128) * 128].isnan().all()
    assert a[-128:].isnan().all()  # the unused tile
    assert torch.all(ref32[2] == 0)
    torch.testing.assert_close(ref32[0], a[:130].float().T @ b[:130].float())
