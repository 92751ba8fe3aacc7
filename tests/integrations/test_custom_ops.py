"""The torch.compile custom ops (custom_ops.py and the ops modules beside the front doors) on the CPU: fake implementations and autograd registrations
(torch.library.opcheck), compiled graphs without breaks (fullgraph=True, torch._dynamo.explain) whose outputs and
gradients equal eager mode's, and bad input failing at trace time. The Triton kernels through the same ops run in
interpreter_ops_cases.py (TRITON_INTERPRET=1 subprocess); inductor and CUDA graphs in test_custom_ops_gpu.py."""

from pathlib import Path

import pytest
import torch

import flashmoe_science as fs
from flashmoe_science.attention import ops as attention_ops
from flashmoe_science.attention.decode import ops as decode_ops
from flashmoe_science.moe import ops as moe_ops
from flashmoe_science.nn import TransformerBlock
from interpreter_driver import interpreter_suite, run_marked_suite

HERE = Path(__file__).resolve().parent


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def _assert_compiled_matches(fn, inputs, atol=1e-12):
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got, want = compiled(*inputs), fn(*inputs)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    grad_out = torch.randn_like(want)
    differentiable = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    for g, w in zip(_grads(got, differentiable, grad_out), _grads(want, differentiable, grad_out)):
        torch.testing.assert_close(g, w, atol=atol, rtol=1e-9)


def _qkv(shape_q, shape_k, dtype=torch.float64):
    q = torch.randn(shape_q, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_k, dtype=dtype, requires_grad=True)
    v = torch.randn(shape_k, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shapes", [((2, 4, 33, 32), (2, 2, 40, 32)),  # GQA, Lq != Lk
                                    ((17, 16), (9, 16)),  # 2-D
                                    ((3, 5, 24), (3, 7, 24)),  # 3-D
                                    ((2, 3, 2, 6, 16), (2, 3, 1, 6, 16))])  # 5-D
def test_compiled_attention_matches_eager(shapes, causal):
    q, k, v = _qkv(*shapes)
    _assert_compiled_matches(lambda q, k, v: fs.flash_attention_science(q, k, v, causal=causal), (q, k, v))


@pytest.mark.parametrize("features", [dict(window=(5, 0)), dict(softcap=3.0), dict(window=(3, 2), softcap=2.0),
                                      dict(alibi_slopes="per-head")])
def test_compiled_attention_features_match_eager(features):
    q, k, v = _qkv((2, 4, 19, 16), (2, 2, 23, 16))
    if features.get("alibi_slopes") == "per-head":
        features = dict(alibi_slopes=torch.rand(4, dtype=torch.float32))
    causal = "window" not in features or features["window"][1] == 0
    _assert_compiled_matches(lambda q, k, v: fs.flash_attention_science(q, k, v, causal=causal, **features),
                             (q, k, v), atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_varlen_matches_eager(causal):
    lengths_q, lengths_k = [5, 0, 9, 1], [7, 3, 9, 2]
    q = torch.randn(sum(lengths_q), 4, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lengths_k), 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lengths_k), 2, 16, dtype=torch.float64, requires_grad=True)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    _assert_compiled_matches(
        lambda q, k, v: fs.flash_attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=causal, window=(4, -1)),
        (q, k, v), atol=1e-10)


def test_compiled_attention_lse_and_transposed_layout():
    # a (B, L, H, D) buffer seen as (B, H, L, D): the op's output keeps that memory order
    q = torch.randn(2, 12, 4, 16, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 12, 2, 16, dtype=torch.float64).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 12, 2, 16, dtype=torch.float64).transpose(1, 2).requires_grad_()

    def attention(q, k, v):
        return fs.flash_attention_science(q, k, v, causal=True, softmax_scale=0.3, return_lse=True)

    (out, lse), (want_out, want_lse) = torch.compile(attention, backend="aot_eager", fullgraph=True)(q, k, v), \
        attention(q, k, v)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    assert out.stride() == torch.empty_like(q).stride()  # as the GPU kernels' out (the reference's is contiguous)


def test_compiled_attention_empty_keys():
    q, k, v = _qkv((1, 2, 5, 16), (1, 2, 0, 16))
    out = torch.compile(lambda q, k, v: fs.flash_attention_science(q, k, v), backend="aot_eager",
                        fullgraph=True)(q, k, v)
    assert torch.equal(out, torch.zeros_like(q))
    (dq,) = torch.autograd.grad(out.sum(), [q])
    assert torch.equal(dq, torch.zeros_like(q))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_compiled_moe_matches_eager(scoring, renormalize):
    x = torch.randn(21, 16, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(4, 24, 16, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(4, 16, 12, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(21, 4, dtype=torch.float64, requires_grad=True)
    _assert_compiled_matches(
        lambda x, w1, w2, logits: fs.fused_moe(x, w1, w2, logits, 2, renormalize=renormalize, scoring=scoring),
        (x, w1, w2, logits))


def test_compiled_moe_route_and_experts_matches_eager():
    x = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(3, 8, 16, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(3, 16, 4, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)

    def experts(x, w1, w2, logits):
        weights, ids = fs.moe_route(logits, 2)
        return fs.fused_experts(x, w1, w2, weights, ids)

    _assert_compiled_matches(experts, (x, w1, w2, logits))


def test_compiled_moe_inference_has_no_residuals():
    x, w1, w2 = torch.randn(5, 16), torch.randn(4, 24, 16), torch.randn(4, 16, 12)
    logits = torch.randn(5, 4)
    compiled = torch.compile(lambda *a: fs.fused_moe(*a, 2), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w1, w2, logits), fs.fused_moe(x, w1, w2, logits, 2))
    explained = torch._dynamo.explain(lambda *a: fs.fused_moe(*a, 2))(x, w1, w2, logits)
    targets = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
    assert any("fused_moe_inference" in t for t in targets), targets


@pytest.mark.parametrize("num_experts", [None, 4])
def test_transformer_block_compiles_without_graph_breaks(num_experts):
    block = TransformerBlock(64, 4, 96, num_experts=num_experts, top_k=2, n_kv_heads=2, qk_norm=True)
    x = torch.randn(2, 10, 64, requires_grad=True)
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got, want = compiled(x), block(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    params = [x, *block.parameters()]
    for g, w in zip(torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_opcheck():
    q, k, v = _qkv((1, 2, 7, 16), (1, 1, 9, 16), torch.float32)
    torch.library.opcheck(attention_ops.attention_forward, (q, k, v, True, 0.25, None, None, None, "auto", False))
    logits = torch.randn(6, 4, requires_grad=True)
    torch.library.opcheck(moe_ops.moe_route, (logits, 2, True, "softmax"))
    x, w1 = torch.randn(6, 16, requires_grad=True), torch.randn(4, 24, 16, requires_grad=True)
    w2 = torch.randn(4, 16, 12, requires_grad=True)
    weights, ids = fs.moe_route(logits.detach(), 2)
    torch.library.opcheck(moe_ops.fused_experts_forward, (x, w1, w2, weights.requires_grad_(), ids, "auto"))
    caches = [torch.randn(2, 24, 2, 16) for _ in range(2)]
    decode_args = (torch.randn(2, 1, 4, 16), *caches, torch.tensor([3, 20], dtype=torch.int32), None)
    torch.library.opcheck(decode_ops.attention_decode,
                          (*decode_args, None, None, None, None, False, True, None, None, None, None, 0, "auto", None,
                           None, None, None, None))
    new_kv = [torch.randn(2, 1, 2, 16) for _ in range(2)]
    torch.library.opcheck(decode_ops.attention_decode_append, (*decode_args, *new_kv, None, None, False, True, None, None,
                                                        None, None, 0, "auto", None, None, None, None, None))
    leftpad = torch.tensor([1, 4], dtype=torch.int32)
    torch.library.opcheck(decode_ops.attention_decode_append, (*decode_args, *new_kv, None, None, False, True, None, None,
                                                        None, None, 0, "auto", None, None, leftpad, None, None))



def test_bad_input_fails_at_trace_time():
    q, k, v = torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    compiled = torch.compile(lambda q, k, v: fs.flash_attention_science(q, k, v), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(Exception, match="multiple of k's head count"):
        compiled(q, k, v)
    x, w1, w2 = torch.randn(5, 16), torch.randn(4, 24, 16), torch.randn(4, 16, 12)
    compiled_moe = torch.compile(lambda *a: fs.fused_moe(*a, 5), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="top_k must be in"):
        compiled_moe(x, w1, w2, torch.randn(5, 4))


@interpreter_suite(HERE / "interpreter_ops_cases.py", timeout=600)
def test_triton_kernels_through_the_ops_under_interpreter(request):
    pytest.importorskip("triton")
    run_marked_suite(request)


@pytest.mark.parametrize("append", [False, True])
def test_compiled_decode_matches_eager(append):
    batch, capacity, heads_kv, head_dim = 2, 24, 2, 16
    q = torch.randn(batch, 2, 4, head_dim, dtype=torch.float64)
    caches = [torch.randn(batch, capacity, heads_kv, head_dim, dtype=torch.float64) for _ in range(2)]
    seqlens = torch.tensor([5, 17], dtype=torch.int32)
    new = [torch.randn(batch, 2, heads_kv, head_dim, dtype=torch.float64) for _ in range(2)] if append else [None] * 2

    def decode(q, k_cache, v_cache):
        return fs.flash_attention_decode(q, k_cache, v_cache, seqlens, k_new=new[0], v_new=new[1], window=(6, 0),
                                         return_lse=True)

    eager_caches = [c.clone() for c in caches]
    want_out, want_lse = decode(q, *eager_caches)
    compiled = torch.compile(decode, backend="aot_eager", fullgraph=True)
    got_out, got_lse = compiled(q, *caches)
    torch.testing.assert_close(got_out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-12, rtol=0)
    for got, want in zip(caches, eager_caches):  # the appended keys and values land in the caches as in eager mode
        assert torch.equal(got, want)


def test_compiled_decode_with_leftpad_and_e4m3_cache_matches_eager():
    """(opcheck cannot take e4m3 tensors on the CPU: its schema check multiplies them)"""
    q = torch.randn(2, 3, 4, 16)
    caches = [(torch.randn(2, 24, 2, 16) * 2).to(torch.float8_e4m3fn) for _ in range(2)]
    seqlens, leftpad = torch.tensor([5, 17], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    scales = torch.rand(2) + 0.5, torch.rand(2) + 0.5
    new = [torch.randn(2, 3, 2, 16) for _ in range(2)]

    def decode(q, k_cache, v_cache):
        return fs.flash_attention_decode(q, k_cache, v_cache, seqlens, k_new=new[0], v_new=new[1],
                                         cache_leftpad=leftpad, k_scale=scales[0], v_scale=scales[1])

    eager_caches = [c.clone() for c in caches]
    want = decode(q, *eager_caches)
    got = torch.compile(decode, backend="aot_eager", fullgraph=True)(q, *caches)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for got_cache, want_cache in zip(caches, eager_caches):
        assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))


def test_each_check_runs_once_per_call(monkeypatch):
    """The ops run the layer below the public functions: an eager op call, an eager public call and a compiled call
    (after its trace) each check their inputs once."""
    from flashmoe_science.attention import problem

    calls = []
    check_inputs = problem.check_inputs
    monkeypatch.setattr(problem, "check_inputs", lambda *args: (calls.append(args), check_inputs(*args))[1])
    q, k, v = (torch.randn(2, 3, 9, 16) for _ in range(3))
    torch.ops.flashmoe_science.attention_forward(q, k, v, True, 0.25, None, None, None, "auto", False)
    fs.flash_attention_science(q, k, v, causal=True)
    assert len(calls) == 2
    compiled = torch.compile(lambda q, k, v: fs.flash_attention_science(q, k, v, causal=True), backend="aot_eager",
                             fullgraph=True)
    compiled(q, k, v)  # the trace runs the fake implementation's checks too
    calls.clear()
    compiled(q, k, v)
    assert len(calls) == 1
