"""Run a pytest file of Triton cases in a subprocess with TRITON_INTERPRET=1.

A subprocess, because Triton chooses interpret-or-compile when the kernel modules are imported: setting the
variable inside this process could come too late, or leak into other tests. (tests/ is on sys.path: pytest puts
the root conftest's folder there.)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_under_interpreter(cases: Path, timeout: int = 600) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
