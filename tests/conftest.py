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
