"""Runs test files in a child pytest under TRITON_INTERPRET=1 (which must be set before triton is first imported:
see tests/attention/test_triton_interpreter.py's docstring) and fails with the child's report if any case fails;
`run_check_script` does the same for a check script that prints "ok N" after N passing draws.
(tests/ is on sys.path in every test: pytest puts the root conftest's folder there.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def run_under_interpreter(rootpath, *files: str, timeout: int = 300) -> str:
    """The child's summary line ("N passed in ..."); asserts that it passed and ran something."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-p", "no:warnings"]
    child = subprocess.run(cmd, cwd=rootpath, env=env, capture_output=True, text=True, timeout=timeout)
    report = (child.stdout + child.stderr)[-8000:]
    assert child.returncode == 0, f"interpreter suite failed (rc {child.returncode}):\n{report}"
    summary = child.stdout.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary) and not re.search(r"\b\d+ (failed|errors?)\b", summary), report
    return summary


def run_check_script(script: Path, seed: int, draws: int, timeout: int = 600) -> None:
    """Runs `script seed draws` under TRITON_INTERPRET=1 with the repository's src/ first on PYTHONPATH and asserts
    that it exited cleanly after printing "ok <draws>"."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(script), str(seed), str(draws)], env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0 and f"ok {draws}" in result.stdout, result.stdout + result.stderr
