"""Output that stays readable in a terminal and in a log.

:func:`console`: a rich Console. On a terminal it has the terminal's width (at least ``min_width``);
written to a pipe or a file it is wide enough that no table is cut and no line wraps (rich would otherwise
assume 80 columns: ``plan kv`` printed "200,41…"), and it has no colour codes.

:class:`Progress`: a progress bar on a terminal; elsewhere plain lines (``[qualify] 12/58 0:35 norm.rms[...]``)
at most every ``every`` seconds and at the end, so a log shows that long work is moving.
"""

from __future__ import annotations

import sys
import time
from typing import Any

LOG_WIDTH = 1000  # columns when not on a terminal: wide enough for any table we print


def console(stderr: bool = False, min_width: int = 0):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if _isatty(stream):
        con = Console(file=stream)
        return Console(file=stream, width=min_width) if con.width < min_width else con
    return Console(file=stream, width=LOG_WIDTH, no_color=True, highlight=False)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _clock(sec: float) -> str:
    m, s = divmod(int(sec), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class Progress:
    """``with Progress("qualify", total) as p: p.advance(desc)`` → a bar on a TTY, plain lines otherwise.

    ``advance(desc, n=1)`` counts ``n`` done and names what comes next; ``note(text)`` sets a trailing
    field (e.g. tokens per second)."""

    def __init__(self, label: str, total: int | None, *, stderr: bool = True, every: float = 10.0,
                 enabled: bool = True) -> None:
        self.label, self.total, self.every, self.enabled = label, total, every, enabled
        self.stream = sys.stderr if stderr else sys.stdout
        self.done, self.desc, self.extra = 0, "", ""
        self._bar: Any = None
        self._last: float | None = None  # the first call always prints
        self._t0 = time.perf_counter()

    def __enter__(self) -> "Progress":
        if self.enabled and _isatty(self.stream):
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn,
                                       TimeElapsedColumn)

            self._bar = Bar(TextColumn(f"[bold]{self.label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[extra]}"), TextColumn("{task.description}"),
                            console=console(stderr=self.stream is sys.stderr), transient=False)
            self._bar.start()
            self._task = self._bar.add_task("", total=self.total, extra="")
        return self

    def advance(self, desc: str = "", n: int = 1) -> None:
        self.done += n
        self.desc = desc
        self._show()

    def note(self, extra: str) -> None:
        self.extra = extra
        self._show()

    def _show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=self.desc, extra=self.extra)
            return
        now = time.perf_counter()
        if not final and self._last is not None and now - self._last < self.every:
            return
        self._last = now
        of = f"/{self.total}" if self.total is not None else ""
        parts = [f"[{self.label}] {self.done}{of}", _clock(now - self._t0), self.extra, "done" if final else self.desc]
        print(" ".join(p for p in parts if p), file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self.enabled and self.done:
            self._show(final=True)

