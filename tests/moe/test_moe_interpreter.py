"""Runs ``interpreter_cases.py`` (the Triton kernels on CPU) in a subprocess with TRITON_INTERPRET=1."""

from pathlib import Path

from interpreter_subprocess import run_under_interpreter


def test_triton_kernels_under_interpreter():
    run_under_interpreter(Path(__file__).resolve().parent / "interpreter_cases.py")
