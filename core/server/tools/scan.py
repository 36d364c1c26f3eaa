"""Pieces every incremental parser here uses: a parsed :class:`ToolCall`, the :class:`Parsed` output of one
delta, how much of a buffer's end may still grow into a marker (:func:`held`), and the :class:`Content`
sink that drops the whitespace around call blocks the same way for every cut of the stream."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable


#: a factory of call ids (tests pass a deterministic one)
IdFactory = Callable[[], str]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One call: the function's name and its arguments (a JSON object, parsed)."""

    name: str
    arguments: dict
    id: str = field(default_factory=new_call_id)

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json()}}
        return d if index is None else {"index": index, **d}


@dataclass
class Parsed:
    """What a parser gives for one delta (or at the end): text and completed calls, in the order they came."""

    items: list = field(default_factory=list)  # str (content) | ToolCall

    def text(self, s: str) -> None:
        if s:
            if self.items and isinstance(self.items[-1], str):
                self.items[-1] += s
            else:
                self.items.append(s)

    def call(self, c: ToolCall) -> None:
        self.items.append(c)

    def __iadd__(self, other: "Parsed") -> "Parsed":
        for x in other.items:
            self.text(x) if isinstance(x, str) else self.call(x)
        return self

    @property
    def content(self) -> str:
        return "".join(x for x in self.items if isinstance(x, str))

    @property
    def calls(self) -> list[ToolCall]:
        return [x for x in self.items if not isinstance(x, str)]


def held(buf: str, *markers: str) -> int:
    """The length of ``buf``'s longest suffix that is a proper prefix of one of ``markers``: text a later
    delta may complete into a marker, so it is not yet released."""
    best = 0
    for m in markers:
        for n in range(min(len(buf), len(m) - 1), best, -1):
            if m.startswith(buf[-n:]):
                best = n
                break
    return best


class Content:
    """Content text outside call blocks. Whitespace right before a call block and right after one is
    dropped (the format's own separators); trailing whitespace is held until text follows it."""

    def __init__(self) -> None:
        self._ws = ""
        self._after_call = False

    def text(self, s: str) -> str:
        if self._after_call:
            s = s.lstrip()
            if not s:
                return ""
            self._after_call = False
        s = self._ws + s
        core = s.rstrip()
        self._ws = s[len(core):]
        return core

    def call(self) -> None:
        self._ws, self._after_call = "", True

    def finish(self) -> str:
        out, self._ws = self._ws, ""
        return out


class BlockParser:
    """What every call parser shares: text outside call blocks is content (what may still grow into the
    format's ``START`` marker is held back); inside a block, :meth:`step` consumes what it can. A format
    defines ``START``, :meth:`step` (→ False to wait for more text) and :meth:`unterminated` (a block the
    text ends in), and may react to a block's start in :meth:`opened`."""

    START = ""

    def __init__(self, new_id: IdFactory = new_call_id) -> None:
        self.buf, self.inside, self.new_id = "", False, new_id
        self.sink = Content()

    def feed(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while True:
            if not self.inside:
                i = self.buf.find(self.START)
                if i < 0:
                    cut = len(self.buf) - held(self.buf, self.START)
                    out.text(self.sink.text(self.buf[:cut]))
                    self.buf = self.buf[cut:]
                    return out
                out.text(self.sink.text(self.buf[:i]))
                self.buf, self.inside = self.buf[i + len(self.START):], True
                self.opened()
            elif not self.step(out):
                return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self.inside:
            self.unterminated(out)
        else:
            out.text(self.sink.text(self.buf))
        self.buf, self.inside = "", False
        out.text(self.sink.finish())
        return out

    def opened(self) -> None:
        pass

    def step(self, out: Parsed) -> bool:
        raise NotImplementedError

    def unterminated(self, out: Parsed) -> None:
        raise NotImplementedError


def loads_object(text: str) -> Any:
    """``text`` as JSON, or None when it is not valid JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None
