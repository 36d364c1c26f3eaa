"""One choice's text → reasoning, then content and tool calls in the order they came, delta by delta: the
``<think>`` splitter (when the server splits reasoning) feeds its content to the call parser of the model's
format (when the request has active tools). Both are cut-invariant, so the composition is too."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Optional

from inferhal.core.server.tools.reasoning import ThinkSplitter
from inferhal.core.server.tools.scan import Parsed


@dataclass
class Out(Parsed):
    """A :class:`~.scan.Parsed` with the reasoning before its items (reasoning ends before content starts)."""

    reasoning: str = ""

    def __iadd__(self, o: Parsed) -> "Out":
        self.reasoning += getattr(o, "reasoning", "")
        return Parsed.__iadd__(self, o)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.items)


class ChoiceParser:
    def __init__(self, thinking: Optional[bool], fmt: Optional[ModuleType]) -> None:
        """``thinking``: None = no reasoning split, else where it starts; ``fmt``: None = no call parsing."""
        self.think = ThinkSplitter(thinking) if thinking is not None else None
        self.calls = fmt.Parser() if fmt is not None else None
        self.total = Out()

    def _content(self, text: str, end: bool) -> Out:
        out = Out()
        if self.calls is None:
            out.text(text)
            return out
        out += self.calls.feed(text)
        if end:
            out += self.calls.finish()
        return out

    def feed(self, text: str, end: bool = False) -> Out:
        """What ``text`` adds (``end``: it is the choice's last text)."""
        if self.think is None:
            out = self._content(text, end)
        else:
            s = self.think.feed(text)
            if end:
                f = self.think.finish()
                s.reasoning, s.content = s.reasoning + f.reasoning, s.content + f.content
            out = self._content(s.content, end)
            out.reasoning = s.reasoning
        self.total += out
        return out
