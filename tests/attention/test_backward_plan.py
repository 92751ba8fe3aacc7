"""The backward decided in the forward (attention.autograd.BackwardPlan, BACKWARD_PLANS) on the CPU: which calls share
a plan, and when a plan runs its step, prepares it and repeats the prepared sequence. Nothing is launched: the
plans are made by the real planner (backend="triton", which the interpreter switch lets take CPU tensors) and the
repeat logic is driven by a recording step. The gradients themselves: test_backward.py (interpreter) and
test_backward_sm90_gpu.py."""

from __future__ import annotations

import pytest
import torch

from flashmoe_science.attention import autograd
from flashmoe_science.attention.features import PLAIN
from flashmoe_science.attention.plan import plan_attention
from flashmoe_science.attention.problem import dense_problem, new_outputs, packed_problem
from flashmoe_science.prepared_cache import SEEN_ONCE


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # backend="triton" takes CPU tensors; nothing is launched here
    monkeypatch.setattr(autograd, "BACKWARD_PLANS", {})


def _dense_plan(b=2, h=4, length=33, d=16, dtype=torch.bfloat16, transposed=False, misaligned=False, **options):
    if misaligned:  # one element past a 16-byte boundary: Triton specialises on the alignment
        q, k, v = (torch.randn(b * h * length * d + 1).to(dtype)[1:].view(b, h, length, d) for _ in range(3))
    elif transposed:
        q, k, v = (torch.randn(b, length, h, d).to(dtype).transpose(1, 2) for _ in range(3))
    else:
        q, k, v = (torch.randn(b, h, length, d).to(dtype) for _ in range(3))
    options.setdefault("backend", "triton")
    problem, _ = dense_problem(q, k, v, **options)
    plan = plan_attention(problem)
    out, lse = new_outputs(problem.q4)
    return autograd.backward_plan(plan, problem.q4, problem.k4, problem.v4, out, lse, problem.features)


def test_one_plan_per_forward_signature():
    first = _dense_plan(causal=True)
    assert _dense_plan(causal=True) is first  # fresh tensors, same signature: the same plan object
    assert len(autograd.BACKWARD_PLANS) == 1
    others = [
        _dense_plan(causal=False),
        _dense_plan(causal=True, window=(8, 0)),
        _dense_plan(causal=True, window=(9, 0)),
        _dense_plan(causal=True, softcap=5.0),
        _dense_plan(causal=True, deterministic=True),
        _dense_plan(causal=True, dtype=torch.float16),
        _dense_plan(causal=True, length=34),
        _dense_plan(causal=True, d=24),
        _dense_plan(causal=True, b=3),
        _dense_plan(causal=True, transposed=True),  # strides
        _dense_plan(causal=True, misaligned=True),
        _dense_plan(causal=True, softmax_scale=0.3),
    ]
    assert len({id(p) for p in [first, *others]}) == len(others) + 1
    assert len(autograd.BACKWARD_PLANS) == len(others) + 1
    assert _dense_plan(causal=True, deterministic=True) is others[4]


def test_the_plan_keeps_what_the_forward_decided():
    plan = _dense_plan(causal=True, softmax_scale=0.3)
    assert plan.softmax_scale == 0.3 and not plan.deterministic and plan.step.backend == "triton"
    assert _dense_plan(deterministic=True).deterministic


def test_torch_deterministic_mode_selects_its_own_plan():
    free = _dense_plan()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        strict = _dense_plan()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert strict is not free and strict.deterministic and not free.deterministic


def test_calls_with_per_call_tensors_are_not_cached():
    slopes = torch.rand(4)
    bias = torch.randn(2, 4, 33, 33)
    for options in (dict(alibi_slopes=slopes), dict(attn_bias=bias)):
        assert _dense_plan(**options) is not _dense_plan(**options)
    assert autograd.BACKWARD_PLANS == {}


def test_a_leading_index_of_the_per_index_loop_is_not_cached():
    q = torch.randn(2, 3, 4, 17, 16, dtype=torch.bfloat16)
    problem, _ = dense_problem(q, q, q, backend="triton")
    plan = plan_attention(problem)
    q0 = q[0]
    out, lse = new_outputs(q0)
    assert autograd.backward_key(plan, q0, q0, q0, out, lse, PLAIN) is None


def _packed_plan(lengths, max_len=None):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total, longest = int(cu[-1]), max_len or max(lengths)
    q, k, v = (torch.randn(total, 4, 16, dtype=torch.bfloat16) for _ in range(3))
    problem = packed_problem(q, k, v, cu, cu, longest, longest, causal=True, backend="triton")
    out, lse = new_outputs(problem.q4)
    plan = autograd.backward_plan(plan_attention(problem), problem.q4, problem.k4, problem.v4, out, lse,
                                  problem.features)
    return plan, problem.features


def test_packed_calls_share_a_plan_by_signature_not_by_lengths():
    first, features = _packed_plan([5, 9, 2], max_len=12)
    second, other = _packed_plan([7, 3, 6], max_len=12)  # the same count, total and maximum: the same plan
    assert second is first
    assert not torch.equal(features.varlen.cu_seqlens_q, other.varlen.cu_seqlens_q)  # each call keeps its own
    assert _packed_plan([5, 9, 2, 1], max_len=12)[0] is not first  # another sequence count
    assert _packed_plan([5, 9, 2], max_len=13)[0] is not first  # another maximal length (the grid)


class _RecordingStep:
    """A backward step that records what the plan asks of it; `prepare` hands out a recording launch (or None)."""

    backend, kernel = "test", "test.kernel"

    def __init__(self, preparable=True):
        self.preparable, self.log = preparable, []

    def run(self, q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale, deterministic,
            need_dbias):
        self.log.append(("run", features, dq is not None, dk is not None))
        return dq, dk, dv, None

    def prepare(self, q, k, v, out, lse, grad_out, delta, dq, dk, dv, features, softmax_scale):
        self.log.append(("prepare", features))
        if not self.preparable:
            return None

        def launch(q, k, v, out, lse, grad_out, delta, dq, dk, dv, features):
            assert dq.shape == q.shape and dk.stride() == k.stride() and delta.shape == lse.shape
            self.log.append(("launch", features))

        return launch


def _tensors(transposed_grad=False):
    q, k, v, out = (torch.randn(2, 3, 9, 8) for _ in range(4))
    grad_out = torch.randn(2, 9, 3, 8).transpose(1, 2) if transposed_grad else torch.randn(2, 3, 9, 8)
    return q, k, v, out, torch.randn(2, 3, 9), grad_out


def test_a_layout_is_prepared_on_its_second_backward_and_repeated_from_its_third():
    step = _RecordingStep()
    plan = autograd.BackwardPlan(step, 0.5, False)
    calls = [object() for _ in range(4)]  # stand-ins for each call's features: each launch gets its own
    for features in calls:
        dq, dk, dv, dbias = plan(*_tensors(), features)
        assert dq is not None and dk is not None and dv is not None and dbias is None
    assert step.log == [("run", calls[0], True, True), ("run", calls[1], True, True), ("prepare", calls[1]),
                        ("launch", calls[2]), ("launch", calls[3])]
    step.log.clear()
    plan(*_tensors(transposed_grad=True), calls[0])  # another grad_out layout: its own first backward
    assert step.log == [("run", calls[0], True, True)] and list(plan.launches.values())[-1] is SEEN_ONCE


def test_partial_gradients_and_unpreparable_steps_run_the_step():
    step = _RecordingStep()
    plan = autograd.BackwardPlan(step, 0.5, False)
    for _ in range(3):
        dq, dk, dv, _ = plan(*_tensors(), PLAIN, need_dq=False)
        assert dq is None and dk is not None
    assert [entry[0] for entry in step.log] == ["run"] * 3 and plan.launches == {}
    step = _RecordingStep(preparable=False)
    plan = autograd.BackwardPlan(step, 0.5, False)
    for _ in range(4):
        plan(*_tensors(), PLAIN)
    assert [entry[0] for entry in step.log] == ["run", "run", "prepare", "run", "run"]


def test_a_recorded_call_replays_its_forward_launch_and_its_backward_plan():
    """call.Recorded (a repeated plain call that records gradients, kept on the GPU only): the forward is its
    prepared launch, the backward its BackwardPlan, through autograd, with nothing planned again."""
    from flashmoe_science.attention import call
    from flashmoe_science.attention.record import ran, recording

    launched = []

    def prepared(q, k, v, out, lse):
        launched.append(q)
        out.copy_(q)
        lse.zero_()

    class Forward:  # a forward step's prepared launch, as the kernels' steps run it (`launch`)
        backend, kernel = "test", "test.forward"

        def launch(self, prepared, q, k, v, features=None):
            out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
            ran("forward", self.backend, self.kernel)
            prepared(q, k, v, out, lse)
            return out, lse

    forward = Forward()
    step = _RecordingStep()
    recorded = call.Recorded(prepared, forward, autograd.BackwardPlan(step, 0.5, False), PLAIN, 0.5)
    for _ in range(3):
        leaves = [t.requires_grad_() for t in _tensors()[:3]]
        with recording() as log:
            out, lse = call.replay(recorded, *leaves)
            assert out.requires_grad and not lse.requires_grad and torch.equal(out, leaves[0])
            out.sum().backward()
        assert launched[-1] is leaves[0] and log[0] == ("forward", "test", "test.forward")
        assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)
    assert [entry[0] for entry in step.log] == ["run", "run", "prepare", "launch"]
    assert all(entry[1] is PLAIN for entry in step.log)


def test_signature_leaves_out_the_strides_of_size_one_dims():
    """A batch of one whose batch stride differs (a view of a larger allocation) addresses as a fresh one: one
    signature; the layouts of larger dims still differ."""
    from flashmoe_science.prepared_cache import tensor_signature

    fresh = torch.empty(1, 4, 33, 64)
    other_batch_stride = fresh.as_strided(fresh.shape, (1, *fresh.stride()[1:]))
    viewed = torch.empty(1, 33, 4, 64).transpose(1, 2)
    assert tensor_signature(fresh) == tensor_signature(other_batch_stride)
    assert tensor_signature(fresh) != tensor_signature(viewed)
