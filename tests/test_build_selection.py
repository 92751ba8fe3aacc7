"""Which offline sm_90 builds a run selects (tests/conftest.py): every parametrization on the triton the Gluon kernels
are tuned on or with --every-build, each build test's first elsewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

compat = pytest.importorskip("flashmoe_science.gluon.compat")

ROOT = Path(__file__).resolve().parents[1]
FILE = "tests/moe/test_moe_down_sm90.py"  # two build tests of two parametrizations each


def _collected(*options: str) -> list[str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "sm90_build", FILE, *options], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_untuned_triton_builds_each_check_once_unless_every_build():
    every = _collected("--every-build")
    assert len(every) == 4
    default = _collected()
    if compat.on_tuned_triton():
        assert default == every
    else:
        firsts = {}
        for line in every:
            firsts.setdefault(line.split("[")[0], line)
        assert default == list(firsts.values())
