"""CPU tests of the MoE front door: routing, the PyTorch reference, gradients, input checks."""

import pytest
import torch
import torch.nn.functional as F

from flashmoe_science.moe import fused_experts, fused_moe, grouped_experts, moe_route
from flashmoe_science.moe.reference import fused_experts_reference
from moe_testing import make_experts


def dense_moe64(x, w1, w2, router_logits, top_k, renormalize, scoring):
    """Independent oracle: every expert on every token, combined with a dense (T, E) routing matrix."""
    x, w1, w2, logits = (t.double() for t in (x, w1, w2, router_logits))
    scores = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    kept = torch.zeros_like(scores).scatter(1, scores.topk(top_k, dim=-1).indices, 1.0)
    gates = scores * kept
    if renormalize:
        gates = gates / gates.sum(-1, keepdim=True)
    d_ff = w1.shape[1] // 2
    gate = torch.einsum("td,efd->tef", x, w1[:, :d_ff])
    up = torch.einsum("td,efd->tef", x, w1[:, d_ff:])
    y = torch.einsum("tef,edf->ted", F.silu(gate) * up, w2)
    return torch.einsum("te,ted->td", gates, y)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_moe_matches_dense_oracle(scoring, renormalize, dtype):
    x, w1, w2 = make_experts(21, 24, 20, 6, dtype)
    logits = torch.randn(21, 6, dtype=dtype)
    out = fused_moe(x, w1, w2, logits, 3, renormalize=renormalize, scoring=scoring)
    expected = dense_moe64(x, w1, w2, logits, 3, renormalize, scoring)
    assert out.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_half_inputs_computed_in_float32():
    x, w1, w2 = make_experts(9, 16, 12, 4, torch.bfloat16)
    logits = torch.randn(9, 4)
    out = fused_moe(x, w1, w2, logits, 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_moe64(x, w1, w2, logits, 2, True, "softmax"), rtol=1e-2, atol=1e-2)


def test_moe_route_semantics():
    logits = torch.randn(13, 8, dtype=torch.bfloat16)
    weights, ids = moe_route(logits, 3)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and weights.shape == (13, 3)
    probs = torch.softmax(logits.float(), -1)
    expected = probs.topk(3, -1)
    assert torch.equal(ids, expected.indices)
    torch.testing.assert_close(weights, expected.values / expected.values.sum(-1, keepdim=True))
    torch.testing.assert_close(weights.sum(-1), torch.ones(13))
    raw, _ = moe_route(logits, 3, renormalize=False, scoring="sigmoid")
    torch.testing.assert_close(raw, torch.sigmoid(logits.float()).topk(3, -1).values)


def test_empty_experts_dropped_slots_and_zero_tokens():
    x, w1, w2 = make_experts(5, 8, 6, 10, torch.float64)
    ids = torch.tensor([[0, 1], [1, -1], [0, 1], [1, 0], [-1, -1]])
    weights = torch.rand(5, 2, dtype=torch.float64)
    out = fused_experts(x, w1, w2, weights, ids)
    kept = weights * (ids >= 0)
    # dense check with the dropped slots' weight removed
    d_ff = 6
    expected = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = F.silu(w1[e, :d_ff] @ x[t]) * (w1[e, d_ff:] @ x[t])
            expected[t] += kept[t, j] * (w2[e] @ h)
    torch.testing.assert_close(out, expected)
    assert torch.all(out[4] == 0)

    empty = fused_moe(x[:0], w1, w2, torch.randn(0, 10, dtype=torch.float64), 2)
    assert empty.shape == (0, 8)


def test_all_tokens_to_one_expert():
    x, w1, w2 = make_experts(17, 8, 6, 4, torch.float64)
    logits = torch.full((17, 4), -30.0, dtype=torch.float64)
    logits[:, 2] = 30.0
    out = fused_moe(x, w1, w2, logits, 1)
    expected = (F.silu(x @ w1[2, :6].T) * (x @ w1[2, 6:].T)) @ w2[2].T
    torch.testing.assert_close(out, expected)


def test_reference_gradcheck_float64():
    x, w1, w2 = make_experts(6, 5, 4, 3, torch.float64)
    weights = torch.rand(6, 2, dtype=torch.float64)
    ids = torch.stack([torch.randperm(3)[:2] for _ in range(6)])
    inputs = [t.clone().requires_grad_() for t in (x, w1, w2, weights)]
    assert torch.autograd.gradcheck(lambda a, b, c, w: fused_experts_reference(a, b, c, w, ids), inputs)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_router_logits_gradcheck(scoring):
    x, w1, w2 = make_experts(5, 6, 4, 4, torch.float64)
    logits = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda lg: fused_moe(x, w1, w2, lg, 2, scoring=scoring), (logits,))


# ------------------------------------------------------------------------------------------ bad input
def _good():
    x, w1, w2 = make_experts(4, 8, 6, 3, torch.float32)
    return dict(x=x, w1=w1, w2=w2, router_logits=torch.randn(4, 3), top_k=2)


@pytest.mark.parametrize(
    "change, error, name",
    [
        (dict(x=[[1.0]]), TypeError, "x"),
        (dict(x=torch.randn(4, 8, 1)), ValueError, "x"),
        (dict(x=torch.ones(4, 8, dtype=torch.int32)), TypeError, "x"),
        (dict(w1=torch.randn(3, 12, 8, dtype=torch.float64)), TypeError, "w1"),
        (dict(w1=torch.randn(3, 12, 7)), ValueError, "w1"),
        (dict(w1=torch.randn(3, 11, 8)), ValueError, "w1"),
        (dict(w1=torch.randn(3, 12)), ValueError, "w1"),
        (dict(w2=torch.randn(3, 8, 5)), ValueError, "w2"),
        (dict(w2=torch.randn(2, 8, 6)), ValueError, "w2"),
        (dict(router_logits=torch.randn(5, 3)), ValueError, "router_logits"),
        (dict(router_logits=torch.randn(4, 4)), ValueError, "router_logits"),
        (dict(router_logits=torch.ones(4, 3, dtype=torch.long)), TypeError, "router_logits"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=4), ValueError, "top_k"),
        (dict(top_k=2.0), TypeError, "top_k"),
        (dict(top_k=True), TypeError, "top_k"),
        (dict(scoring="relu"), ValueError, "scoring"),
        (dict(renormalize="yes"), TypeError, "renormalize"),
        (dict(backend="cuda"), ValueError, "backend"),
    ],
)
def test_fused_moe_rejects_bad_input(change, error, name):
    kwargs = {**_good(), **change}
    with pytest.raises(error, match=name):
        fused_moe(**kwargs)


@pytest.mark.parametrize(
    "weights, ids, error, name",
    [
        (torch.rand(4, 2), torch.zeros(4, 2), TypeError, "topk_ids"),
        (torch.rand(4, 2), torch.zeros(4, 3, dtype=torch.long), ValueError, "topk_ids"),
        (torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long), ValueError, "topk_weights"),
        (torch.ones(4, 2, dtype=torch.long), torch.zeros(4, 2, dtype=torch.long), TypeError, "topk_weights"),
        (torch.rand(4, 0), torch.zeros(4, 0, dtype=torch.long), ValueError, "topk_ids"),
    ],
)
def test_fused_experts_rejects_bad_routing(weights, ids, error, name):
    good = _good()
    with pytest.raises(error, match=name):
        fused_experts(good["x"], good["w1"], good["w2"], weights, ids)


def test_moe_route_rejects_bad_input():
    with pytest.raises(ValueError, match="top_k"):
        moe_route(torch.randn(3, 4), 5)
    with pytest.raises(ValueError, match="router_logits"):
        moe_route(torch.randn(3), 1)
    with pytest.raises(ValueError, match="scoring"):
        moe_route(torch.randn(3, 4), 1, scoring="softmax2")


def test_triton_backend_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = _good()
    with pytest.raises(ValueError, match="backend"):
        fused_moe(g["x"], g["w1"], g["w2"], g["router_logits"], 2, backend="triton")


@pytest.mark.parametrize("w1_shape, w2_shape, blamed", [
    ((3, 6, 8), (3, 8, 6), "w1"),  # w1 holds 2F = 6 rows where w2 says F = 6
    ((3, 12, 7), (3, 8, 6), "w1"),  # w1's d is not x's
    ((3, 12, 8), (3, 7, 6), "w2"),  # w2's d is not x's
])
def test_expert_shape_errors_name_the_weight_whose_dims_disagree(w1_shape, w2_shape, blamed):
    g = _good()
    with pytest.raises(ValueError, match=f"^{blamed} must") as error:
        fused_moe(g["x"], torch.randn(w1_shape), torch.randn(w2_shape), g["router_logits"], 2)
    if blamed == "w1" and w1_shape[2] == 8:  # both shapes are shown where the weights disagree
        assert str(tuple(w2_shape)) in str(error.value)


def test_describe_moe_names_the_reference_that_runs(monkeypatch):
    from flashmoe_science.moe import describe_moe, execute

    ran = []
    reference = execute.fused_experts_reference
    monkeypatch.setattr(execute, "fused_experts_reference", lambda *args: ran.append(1) or reference(*args))
    g = _good()
    description = describe_moe(g["x"], g["w1"], g["w2"], 2)
    assert description.splitlines()[:2] == ["experts: reference",
                                            "  not triton: x is on cpu: 'auto' runs the Triton kernels on CUDA "
                                            "tensors only"]
    fused_moe(**g)
    assert ran == [1]


def test_grouped_experts_rows_by_expert_counts():
    """Rows grouped by expert (a token dispatcher's layout): each row through its expert, scaled by its weight; rows
    past the counts are zeros; gradients reach x, the weights and the row weights."""
    x, w1, w2 = make_experts(17, 12, 10, 4, torch.float64)
    counts = torch.tensor([5, 0, 7, 3])  # 15 rows grouped, 2 padding rows after them
    row_weights = torch.rand(17, dtype=torch.float64)
    for t in (x, w1, w2, row_weights):
        t.requires_grad_(True)
    out = grouped_experts(x, w1, w2, counts, row_weights)
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts)
    expected = torch.zeros_like(x)
    d_ff = w1.shape[1] // 2
    for row, expert in enumerate(expert_of_row.tolist()):
        h = x[row] @ w1[expert].T
        expected[row] = row_weights[row] * ((F.silu(h[:d_ff]) * h[d_ff:]) @ w2[expert].T)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    for ours, theirs in zip(torch.autograd.grad(out, (x, w1, w2, row_weights), grad),
                            torch.autograd.grad(expected, (x, w1, w2, row_weights), grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    unweighted = grouped_experts(x, w1, w2, counts)  # row_weights None: ones
    torch.testing.assert_close(unweighted * row_weights[:, None], out, rtol=1e-12, atol=1e-12)
    assert not unweighted[15:].any()


@pytest.mark.parametrize("counts, row_weights, error, name", [
    (torch.tensor([1.0, 2.0, 0.0, 0.0]), None, TypeError, "tokens_per_expert"),
    (torch.tensor([1, 2, 0]), None, ValueError, "tokens_per_expert"),
    (torch.tensor([1, 2, 0, 0]), torch.ones(5, 2), ValueError, "row_weights"),
])
def test_grouped_experts_rejects_bad_input(counts, row_weights, error, name):
    x, w1, w2 = make_experts(5, 8, 6, 4, torch.float32)
    with pytest.raises(error, match=name):
        grouped_experts(x, w1, w2, counts, row_weights)
