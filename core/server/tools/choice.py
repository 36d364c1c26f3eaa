"""One choice's text → reasoning, content and tool calls, delta by delta: the ``<think>`` splitter (when the
server splits reasoning) feeds its content to the call parser of the model's format (when the request has
active tools). Both are cut-invariant, so the composition is too."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

from inferhal.core.server.tools.reasoning import ThinkSplitter
from inferhal.core.server.tools.scan import ToolCall


@dataclass
class Out:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, o: "Out") -> "Out":
        self.reasoning += o.reasoning
        self.content += o.content
        self.calls += o.calls
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChoiceParser:
    def __init__(self, thinking: Optional[bool], fmt: Optional[ModuleType]) -> None:
        """``thinking``: None = no reasoning split, else where it starts; ``fmt``: None = no call parsing."""
        self.think = ThinkSplitter(thinking) if thinking is not None else None
        self.calls = fmt.Parser() if fmt is not None else None
        self.total = Out()

    def _content(self, text: str, end: bool) -> Out:
        if self.calls is None:
            return Out(content=text)
        p = self.calls.feed(text)
        if end:
            p += self.calls.finish()
        return Out(content=p.content, calls=p.calls)

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
