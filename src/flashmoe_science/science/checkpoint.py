"""Saving a long command's state: often enough that an interrupt loses at most a minute, atomically, and at a point
where the state is whole when the user presses Ctrl-C.

    with deferred_interrupt() as interrupt:
        checkpoint = Checkpoint(out_dir / "checkpoint.pt")
        for step in ...:
            ...                                        # one whole step
            if checkpoint.due() or interrupt.requested:
                checkpoint.save(state())
            if interrupt.requested:
                raise Interrupted(checkpoint.path)     # the command prints how to resume
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import torch

CHECKPOINT_INTERVAL_S = 60.0


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, after the command saved its state to ``path``: running the same command again resumes from it."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.path = Path(path)


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file, then a rename: a run killed while saving leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    torch.save(obj, temporary)
    temporary.replace(path)


class Checkpoint:
    """``due()`` once ``interval_s`` seconds passed since it was made or last saved (0: after every step)."""

    def __init__(self, path: Path, interval_s: float = CHECKPOINT_INTERVAL_S):
        self.path, self.interval_s = Path(path), interval_s
        self._saved_at = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self._saved_at >= self.interval_s

    def save(self, state: dict) -> None:
        save_atomic(state, self.path)
        self._saved_at = time.monotonic()


class deferred_interrupt:
    """Inside ``with deferred_interrupt() as interrupt:`` a first Ctrl-C (SIGINT) only sets ``interrupt.requested``,
    which the loop checks after each whole step; a second one raises KeyboardInterrupt at once. Outside the main
    thread (where Python delivers signals) it changes nothing."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "deferred_interrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self.requested and exc_type is None:  # Ctrl-C after the last check: never swallowed
            raise KeyboardInterrupt
