"""Progress of the long commands: a tqdm bar with rate and ETA on a terminal; in a log file (stderr not a terminal)
one plain line per update instead of a single line of carriage returns.

tqdm is imported here, when a bar is made, never at ``import flashmoe_science``.
"""

from __future__ import annotations

import sys
from typing import TextIO

LOG_INTERVAL_S = 10.0  # at most one line per this many seconds in a log file


class _LineStream:
    """A stream for tqdm that turns each redraw (``"\\r" + bar``) into a line of its own."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(total: int | None, desc: str, unit: str = "it", enabled: bool = True, stream: TextIO | None = None,
                 **options):
    """A tqdm bar on ``stream`` (stderr by default): redrawn in place on a terminal, a line every
    ``LOG_INTERVAL_S`` seconds otherwise; ``enabled=False`` shows nothing. ``options`` go to tqdm (``initial``,
    ``unit_scale``)."""
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    interactive = bool(getattr(stream, "isatty", lambda: False)())
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled,
                file=stream if interactive else _LineStream(stream),
                mininterval=0.2 if interactive else LOG_INTERVAL_S, dynamic_ncols=interactive, ascii=not interactive,
                **options)
