"""Runs test files in a child pytest under TRITON_INTERPRET=1 (which must be set before triton is first imported:
see tests/attention/test_triton_interpreter.py's docstring). (tests/ is on sys.path in every test: pytest puts the root
conftest's folder there.)

A driver test names its files with the `interpreter_suite` mark and calls `run_marked_suite(request)`. The first
driver of a pytest run starts ONE child for the files of every driver the run collected (each child pays the start-up
of python, torch, triton and pytest, and its imports; one child pays them once), reads the child's JUnit XML per file
and keeps it; every driver then fails with the report of its own files if any of their cases failed, or if one of
its files ran no case. So the first driver's time is that of every interpreter suite of the run."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SUITE_MARK = "interpreter_suite"
SUITES = pytest.StashKey[list]()  # the collected drivers' marks, stashed by tests/conftest.py


def interpreter_suite(*files, timeout: int = 300):
    """The mark of a driver test: `files` (paths) run in the run's one TRITON_INTERPRET=1 child, `timeout` seconds
    of the child's time are this driver's share."""
    return getattr(pytest.mark, SUITE_MARK)(*(str(Path(f).resolve()) for f in files), timeout=timeout)


@dataclass
class ChildRun:
    """The child's exit status (None: stopped at its timeout), the tail of its output, its cases per file (the path
    relative to the root: (test name, outcome, message))."""

    returncode: int | None
    report: str
    cases: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)

    def check(self, rootpath: Path, files) -> str:
        """Asserts that each of `files` ran a case, and none failed; returns "N passed, M skipped" of them."""
        names = [os.path.relpath(f, rootpath) for f in files]
        attributed = sum(outcome in ("failed", "error") for cases in self.cases.values() for _, outcome, _ in cases)
        assert self.returncode == 0 or (self.returncode == 1 and attributed), (
            f"interpreter child failed (rc {self.returncode}) outside any case:\n{self.report}")
        mine = [case for name in names for case in self.cases.get(name, [])]
        failed = [f"{name} ({outcome}): {message}" for name, outcome, message in mine if outcome in ("failed", "error")]
        assert not failed, "interpreter cases failed:\n" + "\n\n".join(failed)[-8000:]
        empty = [name for name in names if not any(o == "passed" for _, o, _ in self.cases.get(name, []))]
        assert not empty, f"no case passed in {empty} under the interpreter:\n{self.report}"
        passed = sum(outcome == "passed" for _, outcome, _ in mine)
        return f"{passed} passed, {len(mine) - passed} skipped of {', '.join(names)}"


def _outcome(case: ElementTree.Element) -> tuple[str, str]:
    for tag in ("failure", "error", "skipped"):
        found = case.find(tag)
        if found is not None:
            text = f"{found.get('message', '')}\n{found.text or ''}".strip()
            return {"failure": "failed"}.get(tag, tag), text[-3000:]
    return "passed", ""


@functools.lru_cache(maxsize=None)
def _run_child(rootpath: str, files: tuple[str, ...], timeout: int) -> ChildRun:
    env = dict(os.environ, TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory() as folder:
        xml = Path(folder) / "cases.xml"
        cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
               "--continue-on-collection-errors", f"--junitxml={xml}", "-o", "junit_family=xunit1"]
        try:
            child = subprocess.run(cmd, cwd=rootpath, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as stopped:
            return ChildRun(None, f"stopped after {timeout} s:\n{str(stopped.stdout or '')[-8000:]}")
        run = ChildRun(child.returncode, (child.stdout + child.stderr)[-8000:])
        if xml.exists():
            for case in ElementTree.parse(xml).iter("testcase"):
                run.cases.setdefault(case.get("file", ""), []).append((case.get("name", ""), *_outcome(case)))
        return run


def suites_of(items) -> list:
    """The `interpreter_suite` marks of the collected items: the child runs the files of them all."""
    return [m for m in (item.get_closest_marker(SUITE_MARK) for item in items) if m]


def run_marked_suite(request) -> str:
    """The files of this driver's `interpreter_suite` mark, run in the run's one TRITON_INTERPRET=1 child (with
    every collected driver's files); asserts that each ran a case and none failed; returns their summary."""
    own = request.node.get_closest_marker(SUITE_MARK)
    marks = request.config.stash.get(SUITES, None) or [own]
    files = tuple(dict.fromkeys(f for m in marks for f in m.args))
    timeout = sum(m.kwargs["timeout"] for m in {id(m): m for m in marks}.values())
    run = _run_child(str(request.config.rootpath), files, timeout)
    return run.check(request.config.rootpath, own.args)

