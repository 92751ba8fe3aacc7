"""Which kernels ran: every execute step reports `(direction, backend, kernel)` here, kept only while `recording()`
is on (a test comparing `describe_dispatch` with what ran; a tool). Off, a report is one global read."""

from __future__ import annotations

import contextlib

_LOG: list[tuple[str, str, str]] | None = None


@contextlib.contextmanager
def recording():
    """Collect the reports of the calls made inside the block: a list of (direction, backend, kernel), direction
    "forward" or "backward", in the order the steps ran."""
    global _LOG
    previous, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        _LOG = previous


def ran(direction: str, backend: str, kernel: str) -> None:
    """An execute step ran `kernel` of `backend`."""
    if _LOG is not None:
        _LOG.append((direction, backend, kernel))
