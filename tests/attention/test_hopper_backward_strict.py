"""backend="hopper" is strict in the backward as in the forward, on the CPU (the planner on Hopper's traits, the
Gluon launch replaced: nothing is launched): the Gluon backward runs wherever it can, a call it cannot take raises
naming the argument and the reason, a failed build raises GluonUnavailable; backend="auto" keeps its fallbacks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from flashmoe_science.attention.features import PLAIN  # noqa: E402
from flashmoe_science.attention.hopper import backend  # noqa: E402
from flashmoe_science.attention.plan import describe, plan_attention  # noqa: E402
from flashmoe_science.attention.problem import dense_problem  # noqa: E402
from flashmoe_science.backends import NoBackend  # noqa: E402
from flashmoe_science.device import DeviceTraits  # noqa: E402
from flashmoe_science.gluon import availability  # noqa: E402


@pytest.fixture(autouse=True)
def on_hopper(monkeypatch):
    """CPU tensors planned as on a 132-SM Hopper with the Gluon kernels on."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a backend asked for by name takes CPU tensors; nothing launches
    monkeypatch.setattr(backend, "_on_hopper", lambda q: True)
    monkeypatch.setattr(backend, "device_traits", lambda device: DeviceTraits((9, 0), 132, 232448))
    monkeypatch.setattr(availability, "_failure", None)


def _plan(requested, length=128, head_dim=64, **options):
    q, k, v = (torch.randn(1, 2, length, head_dim, dtype=torch.bfloat16) for _ in range(3))
    return plan_attention(dense_problem(q, k, v, backend=requested, **options)[0])


def test_hopper_runs_its_backward_where_auto_picks_the_faster_triton_one():
    """At D=64 and 128 queries the Triton backward measured faster: "auto" takes it, "hopper" runs its own."""
    auto = _plan("auto")
    assert auto.backend == "hopper" and auto.backward_choice.backend == "triton"
    assert "measured faster" in auto.backward_choice.why_not("hopper")
    hopper = _plan("hopper")
    assert hopper.backward_choice.backend == "hopper" and hopper.backward.fallback is None
    assert describe(hopper).backward_backend == "hopper"


def test_a_backward_hopper_cannot_take_raises_naming_the_argument_and_the_reason():
    """At D=32 the Gluon forward runs and the Gluon backward cannot: "hopper" raises (describe_dispatch says so),
    "auto" runs the Triton backward."""
    with pytest.raises(NoBackend, match=r"backend='hopper' cannot take this call: it takes head dims padding to "
                                        r".*\(in the backward"):
        _plan("hopper", head_dim=32).backward_choice
    dispatch = describe(_plan("hopper", head_dim=32))
    assert dispatch.backend == "hopper" and "a backward raises: backend='hopper'" in dispatch.reason
    auto = _plan("auto", head_dim=32)
    assert auto.backend == "hopper" and auto.backward_choice.backend == "triton"


def _inputs(dq=True, dkdv=True):
    q, k, v, out, grad_out = (torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16) for _ in range(5))
    lse, delta = torch.zeros(1, 2, 128), torch.zeros(1, 2, 128)
    return (q, k, v, out, lse, grad_out, delta, torch.empty_like(q) if dq else None,
            torch.empty_like(k) if dkdv else None, torch.empty_like(v) if dkdv else None, PLAIN, 0.125, False, False)


def test_strict_backward_takes_every_launch_its_fallback_would(monkeypatch):
    """Only dK/dV wanted, and a grad_out TMA cannot read (the stride-0 gradient of a sum): "hopper" computes dQ
    too, copies grad_out and drops what was not asked for; "auto" runs its fallback there."""
    launched = []
    monkeypatch.setattr(backend, "launch_backward", lambda *args: launched.append(args))
    args = list(_inputs(dq=False))
    args[5] = torch.ones(()).to(torch.bfloat16).expand(1, 2, 128, 64)  # stride 0: TMA cannot read it
    dq, dk, dv, dbias = backend.HopperBackward().run(*args)
    (launch,) = launched
    assert dq is None and dk is args[8] and dv is args[9] and dbias is None
    assert launch[7] is not None and launch[5].is_contiguous()  # a dQ buffer and a contiguous grad_out

    ran = []

    class Fallback:
        def run(self, *args):
            ran.append(args)
            return args[7:10] + (None,)

    backend.HopperBackward(fallback=Fallback()).run(*args)
    assert len(ran) == 1 and len(launched) == 1


def test_strict_backward_build_failure_raises(monkeypatch):
    from triton.compiler.errors import CompilationError

    def build_failure(*args):
        raise CompilationError("def kernel():\n    pass\n", None, "it does not build")

    monkeypatch.setattr(backend, "launch_backward", build_failure)
    with pytest.warns(RuntimeWarning, match="attention backward kernel does not build"), \
            pytest.raises(availability.GluonUnavailable, match="backend='hopper'"):
        backend.HopperBackward().run(*_inputs())


def test_host_errors_of_the_backward_launch_propagate(monkeypatch):
    def host_bug(*args):
        raise AttributeError("'CallFeatures' object has no attribute 'windw'")

    monkeypatch.setattr(backend, "launch_backward", host_bug)
    with pytest.raises(AttributeError, match="windw"):
        backend.HopperBackward(fallback=object()).run(*_inputs())
    assert availability.unavailable_reason() is None
