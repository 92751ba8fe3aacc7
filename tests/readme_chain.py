"""Runs the README command tests' commands (tests/test_readme_commands.py) in one background thread of the pytest
process, in their order and one folder, started when collection ends (tests/conftest.py): each command is a child
process, so the thread only waits while this process runs the other tests, and the README tests, moved to the end of
the run, wait only for what is left of the chain. Each test reads its own command's exit status and output."""

from __future__ import annotations

import subprocess
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import pytest

MARK = "readme_command"
CHAIN = pytest.StashKey["Chain"]()


@dataclass
class Outcome:
    """A command's exit status (None: stopped at the timeout) and its stdout and stderr together."""

    returncode: int | None
    output: str


class Chain:
    """The commands of ``items`` (each test's ``readme_command`` mark: argv, environment, timeout in seconds), run one
    after the other in a temporary folder by a daemon thread; ``outcome(nodeid)`` waits for one command's Outcome."""

    def __init__(self, items):
        self.folder = tempfile.TemporaryDirectory(prefix="readme-")
        self.commands = [(item.nodeid, *item.get_closest_marker(MARK).args) for item in items]
        self.futures = {nodeid: Future() for nodeid, *_ in self.commands}
        self.process: subprocess.Popen | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="readme-commands", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for nodeid, argv, env, timeout in self.commands:
            if self.stopped:
                self.futures[nodeid].set_result(Outcome(None, "the run ended before this command started"))
                continue
            try:
                self.process = subprocess.Popen(argv, cwd=self.folder.name, env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True)
                if self.stopped:  # stop() ran between the check above and the start: it saw no process to kill
                    self.process.kill()
                try:
                    output, _ = self.process.communicate(timeout=timeout)
                    self.futures[nodeid].set_result(Outcome(self.process.returncode, output))
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    output, _ = self.process.communicate()
                    self.futures[nodeid].set_result(Outcome(None, output))
            except BaseException as error:  # noqa: BLE001 - handed to the test that waits for this command
                self.futures[nodeid].set_exception(error)

    def outcome(self, nodeid: str) -> Outcome:
        return self.futures[nodeid].result()

    def stop(self) -> None:
        self.stopped = True
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        self.thread.join(timeout=30)
        self.folder.cleanup()


def commands_last(items) -> list:
    """Moves the README command tests among ``items`` to the end (in their order) and returns them."""
    commands = [item for item in items if item.get_closest_marker(MARK)]
    items[:] = [item for item in items if not item.get_closest_marker(MARK)] + commands
    return commands


def start(config, items) -> None:
    """Starts the chain of ``items`` (README command tests) for this run."""
    chain = Chain(items)
    config.stash[CHAIN] = chain
    config.add_cleanup(chain.stop)


def outcome(request) -> Outcome:
    """This README test's command's Outcome: from the run's chain, or, where tests/conftest.py's hook started none
    with this test in it, from a chain of this command alone."""
    chain = request.config.stash.get(CHAIN, None)
    if chain is not None and request.node.nodeid in chain.futures:
        return chain.outcome(request.node.nodeid)
    alone = Chain([request.node])
    try:
        return alone.outcome(request.node.nodeid)
    finally:
        alone.stop()
