"""Runs ``interpreter_cases.py`` (the Triton kernels on CPU) in a subprocess with TRITON_INTERPRET=1.

A subprocess, because Triton chooses interpret-or-compile when the kernel modules are imported: setting the
variable inside this process could come too late, or leak into other tests.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = str(HERE.parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "interpreter_cases.py")],
        cwd=HERE.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
