import atexit
import os
import sys
import zlib

import pytest
import torch

import interpreter_driver
import readme_chain


# The skip reason of the Triton-kernel tests that a plain run executes in a TRITON_INTERPRET=1 child process (the
# drivers of tests/interpreter_driver.py); the parent drops its own copies of them instead of listing them as skipped.
INTERPRETER_CHILD = "runs in the TRITON_INTERPRET=1 child process"  # the start of the reason; the driver's file follows


def _runs_in_interpreter_child(item) -> bool:
    return any(str(mark.kwargs.get("reason", "")).startswith(INTERPRETER_CHILD) and (mark.args[0] if mark.args else True)
               for mark in item.iter_markers("skipif"))


# Left out of a plain `pytest` (the quick run a newcomer starts with): minutes-long tests and the offline sm_90 builds.
# `pytest --full` runs them too (CI does); so does naming test files or giving any -m expression.
FULL_SUITE_ONLY = ("slow", "sm90_build")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the full suite: also the tests marked slow (the Triton interpreter suites, the README "
                     "commands) and sm90_build (offline Gluon builds), which a plain `pytest` leaves out")
    parser.addoption("--every-build", action="store_true",
                     help="on a triton other than the one the Gluon kernels are tuned on, every parametrization of "
                     "the sm90_build tests (by default each test's first: one build per kernel family and check)")


def _tuned_or_every_build(config) -> bool:
    """Whether every sm90_build parametrization runs: --every-build, the interpreter, a triton without Gluon (the
    build tests skip themselves) or the triton the kernels are tuned on."""
    if config.getoption("--every-build") or triton_interpret_enabled():
        return True
    try:
        from flashmoe_science.gluon.compat import on_tuned_triton
    except ImportError:
        return True
    return on_tuned_triton()


def _untuned_build_repeats(config, items) -> list:
    """The sm90_build parametrizations after each test function's first, where they are left out: on a triton the
    Gluon kernels are not tuned on (gluon.compat.TUNED_TRITON), without --every-build. The spill budgets and SASS
    shapes are tuned on that one release, where CI builds the whole matrix; elsewhere the question is whether each
    kernel family builds (the whole matrix took 826 s of one core on triton 3.9, from an empty Triton cache)."""
    if _tuned_or_every_build(config):
        return []
    seen, repeats = set(), []
    for item in items:
        if item.get_closest_marker("sm90_build") is None or getattr(item, "callspec", None) is None:
            continue
        function = (item.path, item.originalname)
        if function in seen:
            repeats.append(item)
        seen.add(function)
    return repeats


def _quick_selection(config) -> bool:
    """A plain `pytest` over the configured testpaths: no --full, no -m, no files or node ids named."""
    return (not config.getoption("--full") and not config.option.markexpr
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS)


def pytest_report_header(config):
    if _quick_selection(config):
        return f"quick run: tests marked {' or '.join(FULL_SUITE_ONLY)} left out (`pytest --full` runs them)"
    if not _tuned_or_every_build(config):
        return "sm90_build: each test's first parametrization on this untuned triton (--every-build: all of them)"
    return None


@pytest.hookimpl(trylast=True)  # after -k, -m and --deselect: the interpreter child runs the selected drivers' files
def pytest_collection_modifyitems(config, items):
    if _quick_selection(config):
        dropped = [item for item in items if any(item.get_closest_marker(name) for name in FULL_SUITE_ONLY)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if item not in dropped]
    repeats = set(_untuned_build_repeats(config, items))
    if repeats:
        config.hook.pytest_deselected(items=list(repeats))
        items[:] = [item for item in items if item not in repeats]
    if not triton_interpret_enabled():
        dropped = [item for item in items if _runs_in_interpreter_child(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if not _runs_in_interpreter_child(item)]
    commands = readme_chain.commands_last(items)
    marks = interpreter_driver.drivers_last(items)
    if marks and not triton_interpret_enabled() and not config.option.collectonly:
        config.stash[interpreter_driver.CHILD] = interpreter_driver.start_child(config, marks)
    if commands and not config.option.collectonly:
        readme_chain.start(config, commands)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_unconfigure(config):
    """After the summary: silence stderr for the interpreter's teardown, where libtriton's nanobind bindings print
    a leak report (a few dozen lines) whenever triton compiled or interpreted a kernel in this process; triton
    silences the same report in its own compile workers."""
    if "triton" in sys.modules:
        sys.stderr.flush()
        atexit.register(_silence_stderr)


def _silence_stderr() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # fresh random inputs per test, but reproducible from the test id when a failure is reported
    seed = zlib.crc32(request.node.nodeid.encode())  # str hash() is salted per process: not reproducible
    torch.manual_seed(seed)
    yield


def triton_interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class _FakeCompiled:
    """A Triton CompiledKernel's stand-in: records the arguments of every `run`."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _FakeDriver:
    class active:  # noqa: N801 - mirrors triton.runtime.driver.driver.active
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 1234)


@pytest.fixture
def fake_compiled_kernel(monkeypatch):
    """PreparedLaunch on the CPU: Triton's driver reports device 0 and stream 1234; returns the class of compiled-kernel
    stand-ins that a fake JIT kernel's `warmup` should hand out."""
    from flashmoe_science import prepared_launch

    monkeypatch.setattr(prepared_launch, "driver", _FakeDriver)
    return _FakeCompiled

