"""The Triton MoE kernels on the GPU: bf16/fp16/fp32 against float64, forward and backward.

Run on the H200: ``PYTHONPATH=src python -m pytest -m gpu tests/moe/test_moe_gpu.py -q``.
Budget: our error vs float64 <= 2 x the error of the same computation in PyTorch ops in the same dtype (the
per-expert loop), plus a few ulps of slack; never NaN where the reference is finite. Buffers the kernels
should fully write are NaN-poisoned first (FLASHMOE_SCIENCE_POISON=1).
"""

import pytest
import torch

from flashmoe_science.moe import fused_experts, fused_moe, moe_route
from flashmoe_science.moe.dispatch import sort_pairs_by_expert
from flashmoe_science.moe.tiles import GemmTiles
from moe_testing import (
    assert_within_budget,
    make_experts,
    reference64,
    torch_loop_same_dtype,
    weight_gradient_operands,
)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _poison_and_exact_fp32(monkeypatch):
    monkeypatch.setenv("FLASHMOE_SCIENCE_POISON", "1")
    # PyTorch's fp32 baseline must be true fp32, not tf32
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def _leaves(tensors, dtype=None):
    return [(t.detach().to(dtype) if dtype else t.detach().clone()).requires_grad_() for t in tensors]


def check_forward_backward(x, w1, w2, weights, ids, backward=True):
    """Ours (triton) vs float64 within 2x PyTorch's same-dtype error, output and (optionally) all four grads."""
    leaves = _leaves((x, w1, w2, weights))
    out = fused_experts(*leaves, ids, backend="triton")
    leaves64 = _leaves((x, w1, w2, weights), torch.float64)
    ref = reference64(*leaves64, ids)
    same_leaves = _leaves((x, w1, w2, weights))
    same = torch_loop_same_dtype(*same_leaves, ids)
    assert_within_budget("out", out.detach(), same.detach(), ref.detach())
    if not backward:
        return
    grad_out = torch.randn(out.shape, device=out.device).to(out.dtype)
    ours = torch.autograd.grad(out, leaves, grad_out)
    refs = torch.autograd.grad(ref, leaves64, grad_out.double())
    sames = torch.autograd.grad(same, same_leaves, grad_out)
    for name, g_ours, g_same, g_ref in zip(("dx", "dw1", "dw2", "dweights"), ours, sames, refs):
        assert_within_budget(name, g_ours, g_same, g_ref)


SHAPES = [
    # T, d, F, E, k
    (1, 512, 256, 8, 2),  # one token
    (16, 1024, 512, 8, 2),  # decode-sized batch: 16-row tiles, split-K in GEMM2
    (77, 200, 136, 6, 2),  # d and F not multiples of any tile
    (300, 512, 384, 16, 4),  # 64-row tiles
    (2048, 1024, 768, 8, 2),  # 128-row tiles
    (700, 256, 128, 256, 8),  # E=256, k=8
    (4096, 2048, 768, 128, 8),  # Qwen3-30B-A3B layer dims
]


@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_float64(num_tokens, d_model, d_ff, num_experts, top_k, dtype):
    x, w1, w2 = make_experts(num_tokens, d_model, d_ff, num_experts, dtype, DEVICE)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts, device=DEVICE), top_k)
    check_forward_backward(x, w1, w2, weights, ids)


@pytest.mark.parametrize("num_tokens, num_experts", [(300, 8), (1024, 4)])  # 64- and 128-row tiles
def test_float32_matches_float64(num_tokens, num_experts):
    # float32 operands take twice the shared memory of the measured (2-byte) tiles: tiles.fit_shared_memory
    x, w1, w2 = make_experts(num_tokens, 256, 192, num_experts, torch.float32, DEVICE)
    weights, ids = moe_route(torch.randn(num_tokens, num_experts, device=DEVICE), 2)
    check_forward_backward(x, w1, w2, weights, ids)


def test_mixtral_layer_at_16_tokens():
    x, w1, w2 = make_experts(16, 4096, 14336, 8, torch.bfloat16, DEVICE)
    weights, ids = moe_route(torch.randn(16, 8, device=DEVICE), 2)
    check_forward_backward(x, w1, w2, weights, ids, backward=False)


def test_all_tokens_to_one_expert():
    x, w1, w2 = make_experts(1000, 512, 256, 8, torch.bfloat16, DEVICE)
    logits = torch.full((1000, 8), -20.0, device=DEVICE)
    logits[:, 5] = 20.0
    weights, ids = moe_route(logits, 1)
    assert torch.all(ids == 5)
    check_forward_backward(x, w1, w2, weights, ids)


def test_experts_without_tokens_and_dropped_slots():
    x, w1, w2 = make_experts(4, 256, 128, 64, torch.bfloat16, DEVICE)
    ids = torch.tensor([[3, 60], [3, -1], [60, 3], [-1, -1]], device=DEVICE)
    weights = torch.rand(4, 2, device=DEVICE)
    check_forward_backward(x, w1, w2, weights, ids)


def test_zero_tokens():
    x, w1, w2 = make_experts(0, 256, 128, 8, torch.bfloat16, DEVICE)
    w1.requires_grad_()
    out = fused_moe(x, w1, w2, torch.randn(0, 8, device=DEVICE), 2)
    assert out.shape == (0, 256)
    out.float().sum().backward()
    assert torch.all(w1.grad == 0)


def test_router_logits_gradient():
    x, w1, w2 = make_experts(64, 256, 128, 8, torch.float32, DEVICE)
    logits = torch.randn(64, 8, device=DEVICE, requires_grad=True)
    grad_out = torch.randn(64, 256, device=DEVICE)
    (ours,) = torch.autograd.grad(fused_moe(x, w1, w2, logits, 2), logits, grad_out)
    (ref,) = torch.autograd.grad(fused_moe(x, w1, w2, logits, 2, backend="reference"), logits, grad_out)
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("num_tokens, top_k, num_experts", [(16384, 8, 128), (16384, 2, 8), (3, 8, 256)])
def test_sort_matches_stable_argsort(num_tokens, top_k, num_experts):
    ids = torch.randn(num_tokens, num_experts, device=DEVICE).topk(top_k, dim=-1).indices
    sort = sort_pairs_by_expert(ids, num_experts, 64)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    assert torch.equal(sort.expert_counts.long(), counts)
    padded = (counts + 63) // 64 * 64
    starts = torch.cumsum(padded, 0) - padded
    assert torch.equal(sort.expert_row_start.long(), starts)
    rows = torch.cat([starts[e] + torch.arange(int(counts[e]), device=DEVICE) for e in range(num_experts)])
    assert torch.equal(sort.sorted_pair_ids[rows].long(), torch.argsort(flat, stable=True))
    assert torch.equal(sort_pairs_by_expert(ids, num_experts, 64).sorted_pair_ids, sort.sorted_pair_ids)


@pytest.mark.parametrize("persistent_tiles", [
    GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=3, block_m=128, persistent=1),  # tensor-core tile
    GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=4, block_m=128, persistent=1),
    GemmTiles(block_n=128, block_k=64, num_warps=4, num_stages=2, block_m=64, persistent=2),  # block_m 64's
])
def test_persistent_weight_gradient_is_the_tile_grid_bit_for_bit(persistent_tiles):
    # experts without rows, with fewer rows than a step, with partial last steps; 1472 x 800 outputs (partial tiles
    # both ways): 384 or more tiles for 132 or 264 programs
    from dataclasses import replace

    from flashmoe_science.moe import triton_gemm

    counts, M, N = (300, 0, 1000, 37, 64, 129, 700, 5), 1472, 800
    sort, a, b, ref = weight_gradient_operands(counts, M, N, 128, torch.bfloat16, DEVICE)
    outs = []
    for gemm in (persistent_tiles, replace(persistent_tiles, persistent=0)):
        out = torch.full((len(counts), M, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        triton_gemm.wgrad_launch(a, b, out, sort, gemm, group_m=8)()
        outs.append(out)
    assert torch.all(outs[0][1] == 0)
    torch.testing.assert_close(outs[0].double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    assert torch.equal(outs[0], outs[1])  # the same MMAs in the same order per tile, one writer each


def test_cuda_graph_capture_has_no_host_sync():
    x, w1, w2 = make_experts(256, 512, 256, 16, torch.bfloat16, DEVICE)
    logits = torch.randn(256, 16, device=DEVICE)
    with torch.no_grad():
        expected = fused_moe(x, w1, w2, logits, 4)  # also compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused_moe(x, w1, w2, logits, 4)
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("entry", ["fused_moe", "fused_experts"])
@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k, dtype, exact", [
    (16, 1024, 192, 64, 2, torch.float16, True),  # (one token: the decode path, test_moe_decode_gpu.py)
    (33, 256, 128, 16, 1, torch.float32, True),
    (4, 1024, 2048, 8, 2, torch.bfloat16, False),  # split-K in down: float32 atomics in any order
    (64, 512, 256, 128, 8, torch.bfloat16, False),  # E=128, k=8: eight float32 atomic adds per element
    (16384, 1536, 256, 64, 8, torch.bfloat16, True),  # the TorchTitan Qwen3-MoE job's layer: the rows combine
])
def test_repeated_signature_takes_the_prepared_launches(monkeypatch, entry, num_tokens, d_model, d_ff, num_experts,
                                                        top_k, dtype, exact):
    """The second inference call of a signature skips the checks, the tiles and Triton's binding (moe.execute.PREPARED):
    bit for bit the full path's output where the combine is order-independent (at most two float32 atomic adds per
    output element, or the rows combine's fixed order), and within budget on new data of that signature."""
    from flashmoe_science.moe import execute, layer

    def call(x, w1, w2, logits):
        if entry == "fused_moe":
            return fused_moe(x, w1, w2, logits, top_k)
        return fused_experts(x, w1, w2, *moe_route(logits, top_k))

    def inputs():
        return (*make_experts(num_tokens, d_model, d_ff, num_experts, dtype, DEVICE),
                torch.randn(num_tokens, num_experts, device=DEVICE))

    execute.PREPARED.clear()
    x, w1, w2, logits = inputs()
    with torch.no_grad():
        first = call(x, w1, w2, logits)
        (prepared,) = execute.PREPARED.values()
        tiles = getattr(prepared, "forward", prepared).tiles  # (fused_moe's: the routing, then the forward)
        assert exact == (tiles.down.split_k == 1 and (top_k <= 2 or tiles.combine == "rows"))

        def full_path(*args, **kwargs):
            raise AssertionError("a repeated signature took the full path")

        monkeypatch.setattr(layer, "moe_forward", full_path)
        again = call(x, w1, w2, logits)
        if exact:
            assert torch.equal(first, again)
        else:
            torch.testing.assert_close(again, first, rtol=1e-2, atol=1e-2)
        x2, w1_2, w2_2, logits2 = inputs()
        out2 = call(x2, w1_2, w2_2, logits2)
        assert len(execute.PREPARED) == 1
    weights, ids = moe_route(logits2, top_k)
    assert_within_budget("out", out2, torch_loop_same_dtype(x2, w1_2, w2_2, weights, ids),
                         reference64(x2, w1_2, w2_2, weights, ids))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_device_that_is_not_current():
    """Triton launches on the current device; the API makes it the tensors' device for the call."""
    x, w1, w2 = make_experts(8, 256, 128, 8, torch.bfloat16, "cuda:1")
    logits = torch.randn(8, 8, device="cuda:1")
    with torch.cuda.device(0), torch.no_grad():
        for _ in range(2):  # full path, then the prepared launches
            out = fused_moe(x, w1, w2, logits, 2)
    assert out.device == x.device
    weights, ids = moe_route(logits, 2)
    same = torch_loop_same_dtype(x, w1, w2, weights, ids)
    assert_within_budget("out", out, same, reference64(x, w1, w2, weights, ids))


def test_training_steps_reuse_prepared_launches():
    """Every kernel launch of a signature that ran before (the training forward's and the backward's included) goes
    through moe.launch._PREPARED instead of Triton's binding: a second step on new data adds no entry and its
    gradients stay within budget; inputs whose 16-byte alignment differs get entries of their own and the same
    results bit for bit (top_k = 2: the float32 combines add two terms, in either order exactly)."""
    from flashmoe_science.moe import launch

    def inputs():
        x, w1, w2 = make_experts(40, 256, 192, 8, torch.bfloat16, DEVICE)
        return x, w1, w2, *moe_route(torch.randn(40, 8, device=DEVICE), 2)

    def outputs_and_grads(x, w1, w2, weights, ids, grad_out):
        leaves = [t.requires_grad_() for t in (x, w1, w2, weights)]
        out = fused_experts(*leaves, ids, backend="triton")
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    launch._PREPARED.clear()
    check_forward_backward(*inputs())
    entries = len(launch._PREPARED)
    assert entries >= 11  # routing, sort (one chunk), up, down; dh, SwiGLU backward, dx, two gathers, dw1, dw2
    check_forward_backward(*inputs())
    assert len(launch._PREPARED) == entries

    x, w1, w2, weights, ids = inputs()
    grad_out = torch.randn_like(x)
    aligned = outputs_and_grads(x.clone(), w1.clone(), w2.clone(), weights.clone(), ids, grad_out)
    entries = len(launch._PREPARED)
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=DEVICE)[1:].view_as(x)  # 2 bytes past 16
    shifted.copy_(x)
    misaligned = outputs_and_grads(shifted, w1.clone(), w2.clone(), weights.clone(), ids, grad_out)
    assert len(launch._PREPARED) > entries
    for name, a, b in zip(("out", "dx", "dw1", "dw2", "dweights"), aligned, misaligned):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("scoring, renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True),
                                                  ("sigmoid", False)])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, dtype", [
    (1, 8, 2, torch.bfloat16), (1000, 128, 8, torch.bfloat16), (333, 256, 8, torch.float32),
    (64, 1024, 4, torch.float16)])
def test_triton_routing_matches_pytorch_routing(num_tokens, num_experts, top_k, dtype, scoring, renormalize):
    """moe_route on CUDA (one Triton launch each way) against the PyTorch routing in float64 on the same logits:
    the same experts in the same order where no two scores are within float32 rounding, weights and the logits'
    gradient within float32 rounding."""
    from flashmoe_science.moe.routing import route_reference

    logits = (torch.randn(num_tokens, num_experts, device=DEVICE) * 2).to(dtype).requires_grad_()
    weights, ids = moe_route(logits, top_k, renormalize, scoring)
    logits64 = logits.detach().double().requires_grad_()
    ref_weights, ref_ids = route_reference(logits64, top_k, renormalize, scoring)
    scores = torch.sort(torch.softmax(logits64.detach(), -1) if scoring == "softmax" else logits64.detach(),
                        descending=True).values[:, :top_k + 1]
    clear = (scores[:, :-1] - scores[:, 1:]).abs().min(dim=1).values > 1e-6 * scores[:, 0].abs()
    assert torch.equal(ids[clear], ref_ids[clear])
    torch.testing.assert_close(weights[clear].double(), ref_weights.detach()[clear], rtol=1e-5, atol=1e-7)
    grad = torch.randn(num_tokens, top_k, device=DEVICE)
    (ours,) = torch.autograd.grad(weights, logits, grad)
    (ref,) = torch.autograd.grad(ref_weights, logits64, grad.double())
    assert ours.dtype == dtype
    torch.testing.assert_close(ours[clear].double(), ref[clear], rtol=2e-2 if dtype != torch.float32 else 1e-4,
                               atol=1e-2 if dtype != torch.float32 else 1e-6)


@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k", [
    (4096, 512, 768, 8, 2),  # 1024 rows per expert: 128-row tiles, the Gluon GEMMs on Hopper
    (64, 256, 192, 8, 2),  # 16 rows per expert: the Triton GEMMs everywhere
    (4096, 512, 704, 8, 2),  # F not a multiple of 128: the fused dh declines on Hopper, the other GEMMs are Gluon
    (16384, 1536, 256, 64, 8),  # the TorchTitan Qwen3-MoE job's layer: the rows combine's down and dx
])
def test_describe_moe_names_the_kernels_that_run(monkeypatch, num_tokens, d_model, d_ff, num_experts, top_k):
    """describe_moe's plan is the one a training call runs: the GEMM kernels it names (Gluon and Triton) are the
    ones launched, forward and backward."""
    from flashmoe_science.moe import describe_moe
    from moe_testing import described_kernels, spy_on_gemm_kernels

    x, w1, w2 = make_experts(num_tokens, d_model, d_ff, num_experts, torch.bfloat16, DEVICE)
    logits = torch.randn(num_tokens, num_experts, device=DEVICE)
    ran = spy_on_gemm_kernels(monkeypatch, gluon=True)
    description = describe_moe(x, w1, w2, top_k)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    fused_moe(*leaves, logits, top_k).sum().backward()
    torch.cuda.synchronize()
    assert ran == described_kernels(description), description


@pytest.mark.parametrize("combine", ["atomic", "rows"])
@pytest.mark.parametrize("num_tokens, d_model, d_ff, num_experts, top_k", [
    (2048, 512, 256, 16, 8),  # 1024 rows per expert: 128-row tiles, the Gluon down and dx on Hopper
    (1000, 264, 136, 12, 8),  # d and F not multiples of the Gluon tiles: the Triton down and dx
    (3000, 512, 256, 8, 1),  # top-1 (TorchTitan's expert-parallel rows)
])
def test_both_combines_match_float64(combine, num_tokens, d_model, d_ff, num_experts, top_k):
    """The down GEMM and dx with either combine (tiles.COMBINES), whatever the heuristic would pick, forward and
    backward against float64 within the same-dtype budget; the rows combine gives the same bits on every run."""
    from dataclasses import replace

    from flashmoe_science.moe import layer
    from flashmoe_science.moe.plan import plan_kernels
    from flashmoe_science.moe.tiles import choose_tiles

    x, w1, w2 = make_experts(num_tokens, d_model, d_ff, num_experts, torch.bfloat16, DEVICE)
    logits = torch.randn(num_tokens, num_experts, device=DEVICE)
    weights, ids = moe_route(logits, top_k)
    ids[0, 0] = -1  # a dropped slot
    weights32 = weights.float().contiguous()
    tiles = replace(choose_tiles(num_tokens, top_k, num_experts, d_model, d_ff, x.device), combine=combine)
    plan = plan_kernels(x, w1, w2, top_k, tiles, training=True)
    grad_out = torch.randn_like(x)

    def run():
        out, saved = layer.moe_forward(x, w1, w2, weights32, ids, plan, save_for_backward=True)
        return (out, *layer.moe_backward(grad_out, x, w1, w2, weights32, saved))

    ours = run()
    leaves64 = _leaves((x, w1, w2, weights), torch.float64)
    ref = reference64(*leaves64, ids)
    refs = (ref, *torch.autograd.grad(ref, leaves64, grad_out.double()))
    same_leaves = _leaves((x, w1, w2, weights))
    same = torch_loop_same_dtype(*same_leaves, ids)
    sames = (same, *torch.autograd.grad(same, same_leaves, grad_out))
    for name, g_ours, g_same, g_ref in zip(("out", "dx", "dw1", "dw2", "dweights"), ours, sames, refs):
        assert_within_budget(name, g_ours.to(g_same.dtype), g_same.detach(), g_ref.detach())
    if combine == "rows":
        again = run()
        assert torch.equal(ours[0], again[0]) and torch.equal(ours[1], again[1])
