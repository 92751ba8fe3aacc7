"""A packed training call repeated with the same cu_seqlens tensor (a model's layers within one batch) on the GPU:
no device synchronisation from its second call on, the first call's plan and launches, and results within the
float64 rule (`pytest -m gpu tests/attention/test_varlen_replay_gpu.py`)."""

import pytest
import torch

from flashmoe_science import flash_attention_varlen
from flashmoe_science.attention import call

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _documents(generator, total: int, longest: int) -> list[int]:
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(1, longest + 1, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n]


def _reference(q, k, v, cu, grad, dtype):
    """Causal attention per document in `dtype` (PyTorch's SDPA, GQA by repeating k and v): out, dq, dk, dv."""
    group = q.shape[1] // k.shape[1]
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    outs = []
    for lo, hi in ((lo, hi) for lo, hi in zip(cu[:-1], cu[1:]) if hi > lo):
        qs, ks, vs = (t[lo:hi].transpose(0, 1) for t in leaves)
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(grad.to(dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def test_repeated_packed_training_call_runs_without_a_sync():
    generator = torch.Generator().manual_seed(3)
    lengths = _documents(generator, 4 * 1031, 700)
    cu_list = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    total, longest = cu_list[-1], max(lengths)
    q = torch.randn(total, 12, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    grad = torch.randn_like(q)
    results = []
    for layer in range(4):  # the first call checks the values and plans; the others replay
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.cuda.synchronize()
        if layer:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = flash_attention_varlen(*leaves, cu, cu, longest, longest, causal=True)
            out.backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append((out.detach(), *(t.grad for t in leaves)))
    assert any(isinstance(entry, call.Recorded) for entry in call.PREPARED_PACKED.values())
    reference = _reference(q, k, v, cu_list, grad, torch.float64)
    torch_errors = [(t.double() - r).abs().max().item()
                    for t, r in zip(_reference(q, k, v, cu_list, grad, torch.bfloat16), reference)]
    for result in results:
        assert torch.equal(result[0], results[0][0])  # the forward is deterministic
        for name, ours, ref, torch_error in zip(("out", "dq", "dk", "dv"), result, reference, torch_errors):
            error = (ours.double() - ref).abs().max().item()
            assert error <= 2 * torch_error + 1e-2, (name, error, torch_error)


@pytest.mark.parametrize("lengths", [[384, 100, 257, 0], [0, 100, 257, 384], [1, 5, 17, 3]])
@pytest.mark.parametrize("d", [64, 128])
def test_rows_past_the_last_sequence(lengths, d):
    """cu_seqlens ending short of the packed rows (the padded path's layout: unchecked, the rows after the last
    sequence attended by none): the grid, sized by the rows, has CTAs past the last work item; they must exit
    (they hung the persistent sm_90 forward before). Outputs and gradients of the real rows within the float64
    rule."""
    rows = 4 * 384
    cu_list = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(rows, 8, d, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(rows, 2, d, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(2))
    grad = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention_varlen(*leaves, cu, cu, 384, 384, causal=True, check_values=False)
    out.backward(grad)
    real = cu_list[-1]
    ours = [out.detach()[:real], *(t.grad[:real] for t in leaves)]
    reference = _reference(q[:real], k[:real], v[:real], cu_list, grad[:real], torch.float64)
    same_dtype = _reference(q[:real], k[:real], v[:real], cu_list, grad[:real], torch.bfloat16)
    for mine, torch_own, exact in zip(ours, same_dtype, reference):
        bound = 2 * (torch_own.double() - exact).abs().max().item() + 1e-2
        assert (mine.double() - exact).abs().max().item() <= bound


def test_work_list_is_built_without_a_sync_and_replays_in_a_cuda_graph():
    """seqlen.varlen_work_list on the device: no synchronisation, its definition's exact integers
    (work_list_interpreter_check.sorted_work_list), and captured in a CUDA graph it recomputes from the cu_seqlens
    values of each replay."""
    from work_list_interpreter_check import sorted_work_list

    from flashmoe_science.attention.seqlen import varlen_work_list, work_items_bound

    generator = torch.Generator().manual_seed(5)
    lengths = [torch.randint(0, 900, (40,), generator=generator) for _ in range(2)]  # one cu shape, empty ones
    lengths[0][7] = lengths[1][0] = 0
    slots = work_items_bound(40, 40 * 900, 40 * 900, 128)
    cus = [torch.cat([torch.zeros(1, dtype=torch.int32), n.cumsum(0).to(torch.int32)]) for n in lengths]
    cu = cus[0].cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = varlen_work_list(cu, 128, slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert eager.tolist() == sorted_work_list(cus[0].tolist(), 128, slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = varlen_work_list(cu, 128, slots)
    for values in cus:
        cu.copy_(values)
        graph.replay()
        torch.cuda.synchronize()
        assert captured.tolist() == sorted_work_list(values.tolist(), 128, slots)
