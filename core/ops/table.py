"""An active backend's op table: op ID → implementation, with where each came from.

Fallback to the reference implementation happens per op, is recorded (``provenance``), is logged once
per op, and is refused under ``strict``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

from inferhal.core.ops.vocabulary import OPS, check_op_id
from inferhal.core.profile import ExecLevel

log = logging.getLogger("inferhal.ops")


class StrictFallbackError(RuntimeError):
    """An op has no native implementation and ``backend.strict=true`` forbids the reference fallback."""


class FallbackLog(list):
    """An op implementation's per-call fallbacks, ``(op_id, reason)`` each (its ``fallback_log``, read by
    ``inferhal qualify``). A server on a backend that falls back every step must not grow without bound, so
    only the newest ``keep`` entries stay; ``total`` counts every entry, ``counts`` each distinct one
    (reasons come from configurations and operator limits: few)."""

    def __init__(self, keep: int = 1024) -> None:
        super().__init__()
        self.keep, self.total, self.counts = keep, 0, {}

    def append(self, entry: tuple[str, str]) -> None:
        self.total += 1
        self.counts[entry] = self.counts.get(entry, 0) + 1
        if len(self) >= self.keep:
            del self[: len(self) - self.keep + 1]
        super().append(entry)

    def mark(self) -> int:
        """Where the log stands now, for :meth:`since`."""
        return self.total

    def since(self, mark: int) -> list:
        """The entries appended after :meth:`mark` returned ``mark`` (the newest ``keep`` of them)."""
        n = min(self.total - mark, len(self))
        return list(self[len(self) - n:]) if n > 0 else []


@dataclass(frozen=True)
class OpImpl:
    """A native op with its execution level (defaults to the backend profile's level)."""

    fn: Callable[..., Any]
    level: ExecLevel | None = None
    note: str = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class OpEntry:
    op_id: str
    fn: Callable[..., Any]
    level: ExecLevel
    native: bool
    note: str = ""


class OpTable:
    """Resolved ops of one backend. ``table["norm.rms"](x, w, p)`` or ``table.get("norm.rms")``."""

    def __init__(
        self,
        backend: str,
        native: Mapping[str, Any],
        fallback: Mapping[str, Any],
        default_level: ExecLevel,
        strict: bool = False,
    ) -> None:
        for op_id in list(native) + list(fallback):
            check_op_id(op_id)
        self.backend = backend
        self.strict = strict
        self._entries: dict[str, OpEntry] = {}
        self._warned: set[str] = set()
        for op_id in OPS:
            if op_id in native:
                impl = native[op_id]
                level = getattr(impl, "level", None) or default_level
                note = getattr(impl, "note", "")
                self._entries[op_id] = OpEntry(op_id, impl, ExecLevel(level), True, note)
            elif op_id in fallback:
                self._entries[op_id] = OpEntry(op_id, fallback[op_id], ExecLevel.FALLBACK, False, "reference")

    def entry(self, op_id: str) -> OpEntry:
        check_op_id(op_id)
        if op_id not in self._entries:
            raise NotImplementedError(f"op {op_id!r} is implemented neither by backend {self.backend!r} nor by reference")
        e = self._entries[op_id]
        if not e.native:
            if self.strict:
                raise StrictFallbackError(
                    f"op {op_id!r} has no native implementation in backend {self.backend!r}, and "
                    f"backend.strict=true forbids the reference fallback"
                )
            if op_id not in self._warned:
                self._warned.add(op_id)
                log.warning("backend %s: op %s falls back to the reference implementation", self.backend, op_id)
        return e

    def get(self, op_id: str) -> Callable[..., Any]:
        return self.entry(op_id).fn

    __getitem__ = get

    def provenance(self) -> dict[str, str]:
        """op ID → execution level string ("device", "interpreter", ..., "fallback", or "absent")."""
        return {op: (self._entries[op].level.value if op in self._entries else "absent") for op in OPS}

    def fallbacks(self) -> list[str]:
        return [op for op, e in self._entries.items() if not e.native]

    def natives(self) -> list[str]:
        return [op for op, e in self._entries.items() if e.native]

    @contextlib.contextmanager
    def intercept(self, wrap: Callable[[OpEntry], Callable[..., Any]],
                  ops: Iterable[str] | None = None) -> Iterator[list[str]]:
        """Within the block, calls to each op (``ops``, default every one this table has) go to
        ``wrap(entry)`` instead, a callable that usually calls ``entry.fn`` itself: a timer, a spy.

        Level, nativeness and note stay the entry's. Only lookups made inside the block see the wrapper (the
        models look their ops up per call). Interceptions nest; on leaving, also by an exception, each op
        gets back the entry it had on entering. Yields the op IDs wrapped. An op ID outside the vocabulary, or
        one this table lacks, is refused before anything changes.
        """
        chosen = list(self._entries) if ops is None else list(ops)
        for op_id in chosen:
            check_op_id(op_id)
            if op_id not in self._entries:
                raise NotImplementedError(f"intercept: op {op_id!r} is implemented neither by backend "
                                          f"{self.backend!r} nor by reference")
        saved = {op_id: self._entries[op_id] for op_id in chosen}
        try:
            for op_id, e in saved.items():
                self._entries[op_id] = dataclasses.replace(e, fn=wrap(e))
            yield list(saved)
        finally:
            self._entries.update(saved)
