"""Runs test files in a child pytest under TRITON_INTERPRET=1 (which must be set before triton is first imported:
see tests/attention/test_triton_interpreter.py's docstring) and fails with the child's report if any case fails.
(tests/ is on sys.path in every test: pytest puts the root conftest's folder there.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys


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
