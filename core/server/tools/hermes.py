"""The Hermes tool-call format (the Llama/SmolLM2 and Gemma families here), as Hermes-2-Pro, Qwen 2.5/3
and vLLM's ``hermes`` parser write it: a call is one JSON object between tags on their own lines,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the available functions go into the system prompt between ``<tools></tools>`` (one JSON object each), and
tool results come back in a user turn as ``<tool_response>...</tool_response>`` blocks (Qwen 2.5's
template does the same; a user turn keeps templates that only know system/user/assistant working).
xgrammar's builtin ``qwen_3`` structural tag (xgrammar/builtin_structural_tag.py) constrains exactly
this call syntax, which :mod:`.constrain` uses.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from inferhal.core.server.tools.scan import BlockParser, Parsed, ToolCall, loads_object

START, END = "<tool_call>", "</tool_call>"
NAME = "hermes"
XGRAMMAR_MODEL = "qwen_3"


def render_call(name: str, arguments: dict) -> str:
    return f"{START}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{END}"


def render_calls(calls: list[tuple[str, dict]]) -> str:
    return "\n".join(render_call(n, a) for n, a in calls)


def system_prompt(functions: list[dict]) -> str:
    """The tools part of the system prompt; ``functions``: OpenAI function objects (name, description,
    parameters)."""
    lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return ("# Tools\n\nYou may call the functions below to answer. Their JSON schemas are inside "
            f"<tools></tools>:\n<tools>\n{lines}\n</tools>\n\nTo call a function, write a JSON object with its "
            "name and its arguments between <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function name>, "arguments": <the arguments as a JSON object>}\n</tool_call>')


def render_results(results: list[str]) -> str:
    return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


def call_of(body: str) -> Optional[tuple[str, dict]]:
    """The (name, arguments) a call body holds, or None when it is not a well-formed call."""
    obj: Any = loads_object(body.strip())
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = loads_object(args)
    return (obj["name"], args) if isinstance(args, dict) else None


class HermesParser(BlockParser):
    """Content and calls from a choice's text, delta by delta. A call is released when its closing tag
    arrives (or at the end, if its body is a complete call); a tagged body that is not a well-formed call
    stays content, tags and all."""

    START = START

    def step(self, out: Parsed) -> bool:
        j = self.buf.find(END)
        if j < 0:
            return False
        body, self.buf, self.inside = self.buf[:j], self.buf[j + len(END):], False
        self._close(body, END, out)
        return True

    def unterminated(self, out: Parsed) -> None:
        self._close(self.buf, "", out)

    def _close(self, body: str, end: str, out: Parsed) -> None:
        call = call_of(body)
        if call is None:
            out.text(self.sink.text(START + body + end))
        else:
            self.sink.call()
            out.call(ToolCall(call[0], call[1], self.new_id()))


Parser = HermesParser  # the format's parser, by the name every format module gives it
