"""A Gluon build failure on a future triton (simulated: the kernel launch raises what a failed build raises) never
fails a call: backend="auto" warns once, naming the triton version, and runs the portable Triton kernels from then
on (attention forward and backward, the MoE GEMMs); backend="hopper" raises GluonUnavailable; `info` says so. An
error of the host code around a launch is no build failure: it propagates."""

from __future__ import annotations

import ast
import warnings

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from triton.compiler.errors import CompilationError  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from flashmoe_science.gluon import availability  # noqa: E402


def _build_failure(*args, **kwargs):
    raise CompilationError("def kernel(x):\n    tma.async_load(x)\n", ast.parse("tma.async_load(x)").body[0],
                           "RuntimeError: async_load has been removed; call async_tensor_load instead")


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    """Each test starts as a fresh process would: no build failure recorded."""
    monkeypatch.setattr(availability, "_failure", None)
    monkeypatch.setattr(availability, "_function_failures", {})


def test_first_failure_warns_once_with_the_triton_version_and_turns_gluon_off():
    import triton

    with pytest.warns(RuntimeWarning) as caught:
        assert not availability.run_gluon("attention forward", _build_failure)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"triton {triton.__version__}" in message and "portable Triton kernels" in message
    assert "attention forward" in message and "async_load has been removed" in message
    assert "does not build" in availability.unavailable_reason()
    launched = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert not availability.run_gluon("MoE dx", lambda: launched.append(1))
    assert not launched  # off for the rest of the process: not even tried
    assert availability.describe().startswith("off: the Gluon sm_90 attention forward kernel does not build")


def test_strict_raises_a_clear_error():
    with pytest.warns(RuntimeWarning), pytest.raises(availability.GluonUnavailable,
                                                     match="backend='hopper': the Gluon sm_90 attention forward"):
        availability.run_gluon("attention forward", _build_failure, strict=True)
    with pytest.raises(availability.GluonUnavailable):  # and every later strict call
        availability.run_gluon("attention forward", lambda: None, strict=True)


def test_errors_that_are_not_build_failures_propagate():
    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        availability.run_gluon("attention forward", out_of_memory)
    assert availability.unavailable_reason() is None


def test_host_errors_propagate_and_leave_gluon_on():
    """An error of the host code around a launch (ours: a missing attribute, a wrong argument) is no build failure:
    it propagates unchanged, nothing is recorded and no warning is given, strict or not."""
    def attribute_error():
        return object().tiles

    def type_error():
        raise TypeError("attention_forward_sm90() got an unexpected keyword argument 'bias'")

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for launch in (attribute_error, type_error):
            for strict in (False, True):
                with pytest.raises((AttributeError, TypeError)) as raised:
                    availability.run_gluon("attention forward", launch, strict)
                assert type(raised.value) in (AttributeError, TypeError)
    assert availability.unavailable_reason() is None


@gluon.jit
def _calls_a_missing_op(x_ptr):
    gl.no_such_op(x_ptr)


@gluon.jit
def _does_nothing(x_ptr):
    pass


def _compile(kernel):
    from flashmoe_science.gluon.build import compile_offline

    compile_offline(kernel, (torch.empty(16, device="meta"),), {}, arch=90, options={"num_warps": 4})


def _runtime_warnings(caught):
    return [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_real_compile_error_falls_back_once():
    """Triton's front end rejecting a @gluon.jit body (a Gluon name this triton lacks) is a build failure: one
    warning, the fallback, the Gluon kernels off for the process."""
    with pytest.warns(RuntimeWarning) as caught:
        assert not availability.run_gluon("attention forward", lambda: _compile(_calls_a_missing_op))
    (warning,) = _runtime_warnings(caught)
    assert "does not build" in str(warning.message) and "CompilationError" in str(warning.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert not availability.run_gluon("attention forward", lambda: _compile(_calls_a_missing_op))


def test_an_error_inside_triton_compile_is_a_build_failure(monkeypatch):
    """An MLIR pass of the Gluon lowering fails with a RuntimeError raised inside triton.compile: a build failure;
    the same type raised by the host code is not one."""
    from triton.backends.nvidia.compiler import CUDABackend

    def failing_pass(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")

    assert not availability.is_build_failure(RuntimeError("PassManager::run failed"))
    monkeypatch.setattr(CUDABackend, "gluon_to_ttgir", failing_pass)
    with pytest.raises(RuntimeError) as raised:
        _compile(_does_nothing)
    assert availability.is_build_failure(raised.value)
    with pytest.warns(RuntimeWarning, match="RuntimeError: PassManager::run failed"):
        assert not availability.run_gluon("MoE dx", lambda: _compile(_does_nothing))


def test_tested_range():
    assert availability.in_tested_range("3.6.0") and availability.in_tested_range("3.9.1")
    assert not availability.in_tested_range("3.10.0") and not availability.in_tested_range("3.5.1")
    assert availability.describe().startswith(("available", "triton"))


def _qkv(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 64, 64, generator=g, dtype=torch.float16).requires_grad_(requires_grad)
            for _ in range(3)]


def _hopper_plan(strict=False, fallback=None):
    """An sm_90 forward plan for 64-row bf16-shaped test inputs, as the planner would make on Hopper: with
    `fallback` (the walk's plan for a failed build) unless `strict` (backend="hopper")."""
    from flashmoe_science.attention.hopper.backend import HopperForward
    from flashmoe_science.attention.hopper.tiles import sm90_forward_tiles

    return HopperForward(sm90_forward_tiles(64, False, 64), persistent=False, q_buffers=1, cross_item=False,
                         fallback=None if strict else fallback)


def test_attention_forward_falls_back_to_the_triton_kernel(monkeypatch):
    from flashmoe_science.attention.triton import backend as triton_backend, fwd as triton_fwd
    from flashmoe_science.attention.features import PLAIN
    from flashmoe_science.attention.hopper import fwd_sm90

    ran = []
    monkeypatch.setattr(fwd_sm90, "attention_forward_sm90", _build_failure)
    monkeypatch.setattr(triton_fwd, "attention_forward", lambda *args: ran.append(args[-1]))
    q, k, v = _qkv()
    fallback = triton_backend.forward_plan(q, k, v, PLAIN)
    plan = _hopper_plan(fallback=fallback)
    with pytest.warns(RuntimeWarning, match="attention forward kernel does not build"):
        plan.run(q, k, v, PLAIN, 0.125)
    assert ran == [fallback.tiles]  # the planned fallback ran: the Triton forward, with its own tiles
    plan.run(q, k, v, PLAIN, 0.125)  # later calls: no warning, no Gluon attempt
    assert len(ran) == 2
    # later calls plan the Triton kernel: the Hopper backend's decline (after its device checks) returns this reason
    assert "attention forward kernel does not build" in availability.unavailable_reason()


def test_attention_forward_strict_raises(monkeypatch):
    from flashmoe_science.attention.features import PLAIN
    from flashmoe_science.attention.hopper import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "attention_forward_sm90", _build_failure)
    q, k, v = _qkv()
    with pytest.warns(RuntimeWarning), pytest.raises(availability.GluonUnavailable, match="backend='hopper'"):
        _hopper_plan(strict=True).run(q, k, v, PLAIN, 0.125)


def test_attention_backward_falls_back_to_the_triton_kernels(monkeypatch):
    from flashmoe_science.attention.triton import bwd as triton_bwd
    from flashmoe_science.attention.autograd import _KernelAttention
    from flashmoe_science.attention.features import PLAIN
    from flashmoe_science.attention.hopper import backend
    from flashmoe_science.attention.plan import Plan
    from flashmoe_science.attention.problem import dense_problem
    from flashmoe_science.attention.triton.backend import TritonBackward
    from flashmoe_science.attention.tiles import backward_tiles
    from flashmoe_science.backends import Choice
    from flashmoe_science.device import INTERPRETER_TRAITS

    ran = []
    monkeypatch.setattr(backend, "launch_backward", _build_failure)
    monkeypatch.setattr(triton_bwd, "attention_backward", lambda *args, **kwargs: ran.append(args))
    q, k, v = _qkv(requires_grad=True)
    forward = _hopper_plan()
    monkeypatch.setattr(type(forward), "run", lambda self, q, *rest: (torch.zeros_like(q), torch.zeros(q.shape[:3])))
    fallback = TritonBackward(backward_tiles(64, q.dtype, False, INTERPRETER_TRAITS))
    plan = Plan(dense_problem(q, k, v)[0], Choice("hopper", forward), ())
    plan.__dict__["backward_choice"] = Choice("hopper", backend.HopperBackward(fallback=fallback))  # as on Hopper
    out, _ = _KernelAttention.apply(q, k, v, None, PLAIN, 0.125, plan)
    with pytest.warns(RuntimeWarning, match="attention backward kernel does not build"):
        out.sum().backward()
    assert len(ran) == 1 and q.grad is not None and k.grad is not None


def test_moe_gemms_fall_back_to_the_triton_kernels(monkeypatch):
    from flashmoe_science.backends import choose
    from flashmoe_science.device import DeviceTraits
    from flashmoe_science.moe import gemms
    from flashmoe_science.moe.hopper import backend, wgrad_sm90

    monkeypatch.setattr(backend, "device_traits", lambda device: DeviceTraits((9, 0), 132, 232448))
    monkeypatch.setattr(backend, "_kernel_reason", lambda *args: None)
    monkeypatch.setattr(wgrad_sm90, "wgrad_sm90", _build_failure)
    ran = []
    monkeypatch.setitem(gemms.TRITON_RUNNERS, "dw1", lambda *args: ran.append(args))
    x = type("OnCuda", (), {"is_cuda": True, "device": "cuda", "shape": (4096, 64), "dtype": torch.bfloat16})()
    w1, w2 = torch.empty(8, 256, 64, dtype=torch.bfloat16), torch.empty(8, 64, 128, dtype=torch.bfloat16)
    tiles = type("Tiles", (), {"block_m": 128})()
    problem = gemms.GemmProblem("dw1", x, w1, w2, 2, tiles)
    hopper = backend.HopperGemms()

    assert hopper.decline(problem) is None
    choice = choose((hopper, gemms.TritonGemms()), problem)  # the walk plans the fallback: the Triton runner
    assert choice.fallback.backend == "triton" and choice.plan.fallback is gemms.TRITON_RUNNERS["dw1"]
    with pytest.warns(RuntimeWarning, match="MoE weight-gradient kernel does not build"):
        choice.plan(None, None, None, None, tiles)
    assert len(ran) == 1
    assert "does not build" in hopper.decline(problem)  # every later MoE call plans the Triton kernels


def test_info_reports_the_gluon_kernels(capsys):
    from flashmoe_science.cli import main

    assert main(["info"]) == 0
    assert "Gluon sm_90 kernels" in capsys.readouterr().out


def test_plan_time_build_outside_the_tested_range(monkeypatch):
    """On a triton outside the tested range the first plan builds one kernel offline: a failure is recorded there,
    at plan time (one warning), and every plan after declines the Gluon kernels; nothing is built twice."""
    monkeypatch.setattr(availability, "_probed", False)
    monkeypatch.setattr(availability, "in_tested_range", lambda version: False)
    builds = []

    def failing_build():
        builds.append(1)
        _build_failure()

    with pytest.warns(RuntimeWarning, match="attention forward kernel does not build"):
        reason = availability.plan_time_reason("attention forward", failing_build)
    assert "does not build" in reason
    assert availability.plan_time_reason("MoE dx", failing_build) == reason and builds == [1]


def test_plan_time_build_records_any_error_of_the_offline_build(monkeypatch):
    """The offline build runs no call's arguments, only code the build tests pass on the tested releases: outside
    that range a Gluon name that moved fails it as an AttributeError at the kernel module's import, and counts."""
    monkeypatch.setattr(availability, "_probed", False)
    monkeypatch.setattr(availability, "in_tested_range", lambda version: False)

    def moved_name():
        raise AttributeError("module 'triton.experimental.gluon.language' has no attribute 'thread_barrier'")

    with pytest.warns(RuntimeWarning, match="AttributeError: module 'triton.experimental.gluon.language'"):
        assert "does not build" in availability.plan_time_reason("attention forward", moved_name)


def test_plan_time_build_inside_the_tested_range_builds_nothing(monkeypatch):
    monkeypatch.setattr(availability, "_probed", False)
    monkeypatch.setattr(availability, "in_tested_range", lambda version: True)
    assert availability.plan_time_reason("attention forward", _build_failure) is None


@pytest.mark.sm90_build
@pytest.mark.parametrize("family", ["attention", "moe"])
def test_the_plan_time_builds_build(monkeypatch, family):
    """The kernels plan_time_reason builds (attention's D=64 forward, the MoE dx) build on this triton."""
    from flashmoe_science.attention.hopper import backend as attention
    from flashmoe_science.moe.hopper import backend as moe

    monkeypatch.setattr(availability, "_probed", False)
    monkeypatch.setattr(availability, "in_tested_range", lambda version: False)
    if family == "attention":
        assert attention.gluon_refusal() is None
    else:
        assert availability.plan_time_reason("MoE dx", moe._build_dx) is None
    assert availability._probed


def test_the_walk_plans_the_fallback_of_a_kernel_built_at_launch():
    """backends.choose fills a plan's `fallback` with the next family's plan (and its reasons) for "auto"; a family
    asked for by name walks alone: no fallback, its build failure raises."""
    from dataclasses import dataclass

    from flashmoe_science.backends import choose

    @dataclass(frozen=True)
    class Built:
        fallback: object = None

    class Family:
        def __init__(self, name, plan, why=None):
            self.name, self._plan, self._why = name, plan, why

        def decline(self, problem):
            return self._why

        def plan(self, problem):
            return self._plan

    walk = (Family("gluon", Built()), Family("other", "other plan", "it declines"), Family("portable", "plan"))
    choice = choose(walk, None)
    assert choice.plan.fallback == "plan" and choice.fallback.backend == "portable"
    assert choice.fallback.declined == (("other", "it declines"),)
    assert choose(walk, None, "gluon").plan.fallback is None


def test_describe_names_the_planned_fallback():
    from flashmoe_science.attention import plan as planner
    from flashmoe_science.backends import Choice

    choice = Choice("hopper", None, (), Choice("triton", None))
    sentence = planner._fallback(choice, planner.ATTENTION_BACKENDS, "where only dQ is wanted")
    assert sentence == ("; where only dQ is wanted or where its build fails on this triton (once, remembered): "
                        "the portable Triton kernel")
    assert planner._fallback(Choice("triton", None), planner.ATTENTION_BACKENDS) == ""


def _user_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def test_a_user_functions_failed_build_refuses_that_function_alone():
    """A build carrying a user's mask_mod that fails is the mod's failure: one warning naming it, the Gluon kernels
    stay on for every other call, and that mod is refused from then on (not built again); strict raises the same
    reason."""
    other = object()
    with pytest.warns(RuntimeWarning) as caught:
        assert not availability.run_gluon("attention forward", _build_failure, user_fn=_user_mod)
    (warning,) = _runtime_warnings(caught)
    assert "_user_mod does not build in the Gluon sm_90 attention forward" in str(warning.message)
    assert "the other calls keep the Gluon kernels" in str(warning.message)
    assert availability.unavailable_reason() is None
    assert availability.function_refusal(_user_mod).startswith("_user_mod does not build")
    assert availability.function_refusal(other) is None
    launched = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no second warning, no second build
        assert not availability.run_gluon("attention forward", lambda: launched.append(1), user_fn=_user_mod)
        assert not launched
        with pytest.raises(availability.GluonUnavailable, match="backend='hopper': _user_mod does not build"):
            availability.run_gluon("attention forward", lambda: None, strict=True, user_fn=_user_mod)
        assert availability.run_gluon("attention forward", lambda: launched.append(1), user_fn=other)
        assert availability.run_gluon("MoE dx", lambda: launched.append(1))
    assert launched == [1, 1]
