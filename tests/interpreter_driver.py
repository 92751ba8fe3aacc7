"""Runs test files in a child pytest under TRITON_INTERPRET=1 (which must be set before triton is first imported:
see tests/attention/test_triton_interpreter.py's docstring). (tests/ is on sys.path in every test: pytest puts the root
conftest's folder there.)

A driver test names its files with the `interpreter_suite` mark and calls `run_marked_suite(request)`. ONE child runs
the files of every driver the run collected (each child pays the start-up of python, torch, triton and pytest, and its
imports; one child pays them once). It starts when collection ends (`start_child`, from tests/conftest.py), on the
other core while this process runs the other tests, and the drivers run last (conftest moves them): so the run shows
progress meanwhile, and the drivers wait only for what is left of the child. Each driver reads the child's JUnit XML
for its own files and fails with their report if any of their cases failed, or if one of its files ran no case."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SUITE_MARK = "interpreter_suite"
CHILD = pytest.StashKey["Child"]()  # the run's child, started by tests/conftest.py when collection ends


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


@dataclass
class Child:
    """The run's TRITON_INTERPRET=1 child, started by `start_child`; `result` waits for it once."""

    process: subprocess.Popen
    folder: tempfile.TemporaryDirectory
    deadline: float
    timeout: int
    files: tuple[str, ...]
    _run: ChildRun | None = None

    def result(self) -> ChildRun:
        if self._run is None:
            self._run = self._wait()
        return self._run

    def _wait(self) -> ChildRun:
        log = Path(self.folder.name) / "log"
        try:
            returncode = self.process.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            return ChildRun(None, f"stopped after {self.timeout} s:\n{log.read_text(errors='replace')[-8000:]}")
        run = ChildRun(returncode, log.read_text(errors="replace")[-8000:])
        xml = Path(self.folder.name) / "cases.xml"
        if xml.exists():
            for case in ElementTree.parse(xml).iter("testcase"):
                run.cases.setdefault(case.get("file", ""), []).append((case.get("name", ""), *_outcome(case)))
        return run

    def stop(self) -> None:
        """Ends the child if it still runs (a run stopped early, or past its timeout) and removes its files."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.folder.cleanup()


def start_child(config, marks) -> Child | None:
    """Starts the child for the files of every driver mark in ``marks`` (None when there are none)."""
    files = tuple(dict.fromkeys(f for m in marks for f in m.args))
    if not files:
        return None
    timeout = sum(m.kwargs["timeout"] for m in {id(m): m for m in marks}.values())
    folder = tempfile.TemporaryDirectory()
    xml = Path(folder.name) / "cases.xml"
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
           "--continue-on-collection-errors", f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    with open(Path(folder.name) / "log", "w") as log:
        process = subprocess.Popen(cmd, cwd=str(config.rootpath), env=dict(os.environ, TRITON_INTERPRET="1"),
                                   stdout=log, stderr=subprocess.STDOUT)
    child = Child(process, folder, time.monotonic() + timeout, timeout, files)
    config.add_cleanup(child.stop)
    return child


def drivers_last(items) -> list:
    """Moves the driver tests among ``items`` to the end (in their order) and returns their marks: the child runs
    their files while the other tests run."""
    drivers = [item for item in items if item.get_closest_marker(SUITE_MARK)]
    items[:] = [item for item in items if not item.get_closest_marker(SUITE_MARK)] + drivers
    return [item.get_closest_marker(SUITE_MARK) for item in drivers]


def run_marked_suite(request) -> str:
    """The files of this driver's `interpreter_suite` mark, run in the run's one TRITON_INTERPRET=1 child (with
    every collected driver's files); asserts that each ran a case and none failed; returns their summary."""
    own = request.node.get_closest_marker(SUITE_MARK)
    child = request.config.stash.get(CHILD, None)
    if child is None:  # collected without tests/conftest.py's hook: a child of this driver's files alone
        child = start_child(request.config, [own])
        request.config.stash[CHILD] = child
    return child.result().check(request.config.rootpath, own.args)
