"""Runs ``interpreter_cases.py`` (the Triton kernels on CPU) in a subprocess with TRITON_INTERPRET=1."""

from pathlib import Path

import pytest

from interpreter_driver import interpreter_suite, run_marked_suite

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@interpreter_suite(HERE / "interpreter_cases.py", timeout=600)
def test_triton_kernels_under_interpreter(request):
    pytest.importorskip("triton")
    run_marked_suite(request)
