"""How far a long read is, as one line on stderr (a prompt's prefill, a library document)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Reads shorter than this say nothing: they are over before a line would help.
QUIET_BELOW_TOKENS = 512


class ProgressLine:
    """One line redrawn on a terminal (at most 4 times a second), else a line after 2 s and
    then every 10 s."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last = -1.0
        self.drawn = False  # a line is on the terminal, to clear before what follows

    def show(self, total: int, seconds: float, line: Callable[[], str]) -> None:
        """Draw ``line()`` for a read of ``total`` tokens ``seconds`` in, when one is due."""
        if total < QUIET_BELOW_TOKENS:
            return
        due = 0.25 if self.tty else (2.0 if self.last < 0 else 10.0)
        if seconds - max(self.last, 0.0) < due:
            return
        self.last = seconds
        text = line()
        self.stream.write(f"\r{text}\x1b[K" if self.tty else f"{text}\n")
        self.stream.flush()
        self.drawn = self.tty

    def clear(self) -> None:
        """Take a redrawn line off the terminal."""
        if self.drawn:
            self.drawn = False
            self.stream.write("\r\x1b[K")
            self.stream.flush()
