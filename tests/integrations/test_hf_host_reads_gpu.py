"""The padded path of attn_implementation=hf.ATTN_IMPLEMENTATION on the GPU: no synchronisation once warm (CUDA's
sync debug mode turned to errors around a forward and backward), a CUDA-graph capture of the forward and of the
forward + backward whose replays on new contents (other lengths) match eager calls."""

import pytest
import torch

pytest.importorskip("transformers")

from flashmoe_science.integrations import hf  # noqa: E402

pytestmark = pytest.mark.gpu
BATCH, HEADS, KV_HEADS, LENGTH, DIM = 4, 8, 2, 384, 64


class _Causal:
    is_causal = True


def _inputs(lengths, grad=False):
    q = torch.randn(BATCH, HEADS, LENGTH, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k, v = (torch.randn(BATCH, KV_HEADS, LENGTH, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
            for _ in range(2))
    return q, k, v, _mask(lengths)


def _mask(lengths):
    return torch.arange(LENGTH, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]


def _attend(q, k, v, mask):
    return hf.flashmoe_science_attention(_Causal(), q, k, v, mask)[0]


def test_forward_and_backward_do_not_synchronise():
    q, k, v, mask = _inputs([384, 100, 257, 0], grad=True)
    grad = torch.randn(BATCH, LENGTH, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    torch.autograd.grad(_attend(q, k, v, mask), (q, k, v), grad)  # compiles and plans
    mask = _mask([300, 384, 1, 17])  # a new mask: its rows are built again
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.grad(_attend(q, k, v, mask), (q, k, v), grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _captured(step, *static):
    step(*static)  # eager first: compiles, plans, and warms the allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*static)
        torch.cuda.current_stream().synchronize()
        with torch.cuda.graph(graph):
            outputs = step(*static)
    torch.cuda.current_stream().wait_stream(stream)
    return graph, outputs


def _refill(static, fresh):
    with torch.no_grad():
        for target, source in zip(static, fresh):
            target.copy_(source)


def test_forward_captured_in_a_cuda_graph():
    static = _inputs([384, 100, 257, 0])
    with torch.no_grad():
        graph, out = _captured(_attend, *static)
        fresh = _inputs([5, 384, 200, 383])
        _refill(static, fresh)
        graph.replay()
        torch.testing.assert_close(out, _attend(*fresh), atol=0, rtol=0)


def test_forward_and_backward_captured_in_a_cuda_graph():
    static = _inputs([384, 100, 257, 0], grad=True)
    grad = torch.randn(BATCH, LENGTH, HEADS, DIM, device="cuda", dtype=torch.bfloat16)

    def step(q, k, v, mask):
        out = _attend(q, k, v, mask)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    graph, outputs = _captured(step, *static)
    fresh = _inputs([5, 384, 200, 383], grad=True)
    _refill(static, fresh)
    graph.replay()
    want = step(*fresh)
    torch.testing.assert_close(outputs[0], want[0], atol=0, rtol=0)
    for got, expected in zip(outputs[1:], want[1:]):  # dQ's float32 adds arrive in any order: its last bits vary
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
