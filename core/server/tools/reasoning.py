"""Reasoning output: a choice's text split into ``reasoning_content`` and ``content`` for models that think
in ``<think>...</think>`` (DeepSeek R1/V3.1+/V4, Qwen 3).

Where it starts comes from the request: with thinking on (``chat_template_kwargs`` ``thinking`` or
``enable_thinking`` true, as DeepSeek's and Qwen's templates read them) the chat template has opened the
block in the prompt, so the text is reasoning up to the first ``</think>``; with it off (or not given),
the text is content unless it opens with ``<think>`` itself (leading whitespace aside). Either way a
leading ``<think>`` is dropped, and only the first ``</think>`` closes the reasoning: everything after it
is content. vLLM's reasoning parsers take the same starting state from ``chat_template_kwargs``.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferhal.core.server.tools.scan import held

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ThinkSplitter:
    """Incremental and cut-invariant: the same split for every way the text arrives in deltas."""

    def __init__(self, thinking: bool) -> None:
        # "start": not yet known whether a block opens; "open": in reasoning, a leading <think> may follow
        self.state = "open" if thinking else "start"
        self.buf = ""

    def feed(self, text: str) -> Split:
        self.buf += text
        out = Split()
        while True:
            if self.state in ("start", "open"):
                s = self.buf.lstrip()
                if s.startswith(OPEN):
                    self.buf, self.state = s[len(OPEN):], "reasoning"
                    continue
                if OPEN.startswith(s):  # nothing but whitespace, or the start of <think>: wait
                    return out
                self.state = "content" if self.state == "start" else "reasoning"
            elif self.state == "reasoning":
                i = self.buf.find(CLOSE)
                if i >= 0:
                    out.reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(CLOSE):], "content"
                    continue
                cut = len(self.buf) - held(self.buf, CLOSE)
                out.reasoning += self.buf[:cut]
                self.buf = self.buf[cut:]
                return out
            else:
                out.content += self.buf
                self.buf = ""
                return out

    def finish(self) -> Split:
        out = Split()
        if self.state in ("start", "content"):
            out.content = self.buf
        else:
            out.reasoning = self.buf
        self.buf = ""
        return out
