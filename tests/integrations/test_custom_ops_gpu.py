"""The custom ops on the GPU (H200: `pytest -m gpu tests/integrations`): fake implementations against the real
kernels (opcheck: shapes, dtypes and strides of every output, the Triton MoE's residuals included), a TransformerBlock
compiled by inductor with fullgraph=True (no graph breaks) and under CUDA graphs (mode="reduce-overhead"), its bf16
error vs float64 within twice eager mode's."""

import copy

import pytest
import torch

import flashmoe_science as fs
from flashmoe_science.attention import ops as attention_ops
from flashmoe_science.attention.decode import ops as decode_ops
from flashmoe_science.moe import ops as moe_ops
from flashmoe_science.nn import TransformerBlock

pytestmark = pytest.mark.gpu


def test_opcheck_on_the_kernels():
    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # deterministic=True: opcheck compares eager and traced gradients closely, and the one-pass sm_90 backward sums
    # dQ with TMA reduce-adds, whose last bits vary run to run
    torch.library.opcheck(attention_ops.attention_forward, (q, k, v, True, 0.125, None, None, None, "auto", True))
    qt = torch.randn(2, 300, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    torch.library.opcheck(attention_ops.attention_forward, (qt, k, v, False, 0.125, [64, 0], 30.0, None, "auto", True))
    for tokens in (1, 40, 3000):
        logits = torch.randn(tokens, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.library.opcheck(moe_ops.moe_route, (logits, 2, True, "softmax"))
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w1 = (0.05 * torch.randn(8, 512, 256, device="cuda", dtype=torch.bfloat16)).requires_grad_()
        w2 = (0.05 * torch.randn(8, 256, 256, device="cuda", dtype=torch.bfloat16)).requires_grad_()
        weights, ids = fs.moe_route(logits.detach(), 2)
        # not test_aot_dispatch_dynamic: it compares every output bit for bit, and the residual outputs (gate_up, h)
        # hold the row tiles' padding rows uninitialised (the backward never reads them); compiled and eager agree
        # on the layer's outputs and gradients in test_compiled_block_on_gpu
        torch.library.opcheck(moe_ops.fused_experts_forward, (x, w1, w2, weights.requires_grad_(), ids, "auto"),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    for paged in (False, True):
        caches = [torch.randn(64 if paged else 2, 32 if paged else 2048, 2, 128, device="cuda", dtype=torch.bfloat16)
                  for _ in range(2)]
        table = torch.randperm(64, device="cuda", dtype=torch.int32)[:2 * 32].view(2, 32) if paged else None
        seqlens = torch.tensor([300, 900], device="cuda", dtype=torch.int32)  # paged: at most 32 blocks of 32
        q1 = torch.randn(2, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
        torch.library.opcheck(decode_ops.attention_decode, (q1, *caches, seqlens, table, None, None, None, None, False, True,
                                                     None, None, None, None, 0, "auto", None, None, None, None,
                                                     None))


def _block_and_input(num_experts):
    block64 = TransformerBlock(256, 8, 512, num_experts=num_experts, top_k=2, n_kv_heads=2, qk_norm=True).cuda()
    block64 = block64.double()
    block16 = copy.deepcopy(block64).to(torch.bfloat16)
    x = torch.randn(4, 512, 256, device="cuda", dtype=torch.float64)
    return block64, block16, x


def _error(got, want):
    return (got.double() - want).abs().max().item()


@pytest.mark.parametrize("num_experts", [None, 8])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_block_on_gpu(num_experts, mode):
    block64, block16, x = _block_and_input(num_experts)
    explained = torch._dynamo.explain(block16)(x.to(torch.bfloat16))
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(block16, mode=mode, fullgraph=True)
    x16 = x.to(torch.bfloat16).requires_grad_()
    x64 = x.clone().requires_grad_()
    want = block64(x64)
    grad_out = torch.randn_like(want)
    (want_dx,) = torch.autograd.grad(want, x64, grad_out)
    eager = block16(x16)
    (eager_dx,) = torch.autograd.grad(eager, x16, grad_out.to(torch.bfloat16))
    for _ in range(3):  # CUDA graphs: warm-up runs, then recorded, then replayed
        got = compiled(x16)
        (got_dx,) = torch.autograd.grad(got, x16, grad_out.to(torch.bfloat16))
    assert _error(got, want) <= 2 * _error(eager, want) + 1e-2
    assert _error(got_dx, want_dx) <= 2 * _error(eager_dx, want_dx) + 1e-2
    with torch.no_grad():  # inference through the inference ops (no residuals), graphs replayed
        compiled_inference = torch.compile(block16, mode=mode, fullgraph=True)
        for _ in range(3):
            got = compiled_inference(x16)
        assert _error(got, want.detach()) <= 2 * _error(eager.detach(), want.detach()) + 1e-2
