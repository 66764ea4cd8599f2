"""Progress displays for long work (the demo, the export, ``stats --watch``), one look everywhere.

Owns: the live line (rewritten in place with ``\\r`` on a terminal, one line every few seconds
otherwise), the notices printed between its updates, and the text of a bar.

It must not know what is being counted nor decide where the output goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

PROGRESS_EVERY_S = 2.0  # when the stream is not a terminal
BAR_WIDTH = 24


class Progress:
    """A live progress line: rewritten with '\\r' on a terminal, else one line every few seconds."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.last = 0.0
        self.width = 0
        self.last_text = ""
        self.shown = ""

    def show(self, text: str, force: bool = False) -> None:
        """Show ``text`` (on a terminal at once; otherwise at most every PROGRESS_EVERY_S unless
        forced)."""
        now = time.monotonic()
        if force and text == self.shown:
            return
        self.last_text = text
        if self.tty:
            pad = max(0, self.width - len(text))
            self.out.write("\r" + text + " " * pad)
            self.width = len(text)
            self.out.flush()
        elif force or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.shown = text
            self.out.write(text + "\n")
            self.out.flush()

    def note(self, text: str) -> None:
        """Print a notice on a line of its own. On a terminal it takes the live line's place, and
        the live line is drawn again below it."""
        if self.tty and self.width:
            pad = max(0, self.width - len(text))
            self.out.write("\r" + text + " " * pad + "\n")
            self.width = 0
            self.show(self.last_text)
        else:
            self.out.write(text + "\n")
            self.out.flush()

    def end(self) -> None:
        """Leave the line (on a terminal, move below it)."""
        if self.tty and self.width:
            self.out.write("\n")
            self.out.flush()
            self.width = 0


def bar(done: int, total: int | None) -> str:
    """``[########----------------]  35%`` (just the count when the total is unknown)."""
    if not total:
        return f"{done}"
    frac = min(1.0, done / total)
    filled = int(frac * BAR_WIDTH)
    return f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {frac * 100:3.0f}%"


CLEAR_HOME = "\x1b[H\x1b[2J"  # cursor home, clear the screen: the table is redrawn in place


def watch(
    render: Callable[[], str],
    out: TextIO,
    *,
    interval: float = 2.0,
    count: int = 0,
    title: str = "",
) -> int:
    """Redraw ``render()`` every ``interval`` seconds: in place on a terminal, else one block per
    refresh under a time stamp. ``count`` > 0 stops after that many; Ctrl-C stops (status 0)."""
    tty = out.isatty()
    n = 0
    try:
        while True:
            stamp = f"{title}  {time.strftime('%H:%M:%S')}  (every {interval:g} s, Ctrl-C to stop)"
            text = render()
            out.write(
                (CLEAR_HOME if tty else "") + stamp + "\n" + text + "\n" + ("" if tty else "\n")
            )
            out.flush()
            n += 1
            if count and n >= count:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
