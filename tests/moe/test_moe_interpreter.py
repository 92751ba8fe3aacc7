"""Runs ``interpreter_cases.py`` (the Triton kernels on CPU) in a subprocess with TRITON_INTERPRET=1."""

from pathlib import Path

import pytest

from interpreter_driver import run_under_interpreter

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(HERE.parents[1], str(HERE / "interpreter_cases.py"), timeout=600)
