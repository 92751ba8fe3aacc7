import os
import zlib

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


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

