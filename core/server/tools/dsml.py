"""DeepSeek-V4's tool-call format, DSML (the DeepSeek-V3.2 grammar in a V4 wrapper):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

The bars are U+FF5C (fullwidth), not ``|``. A string parameter is written as is with ``string="true"``;
any other value as JSON with ``string="false"``. Sources: DeepSeek's own encoder
(huggingface.co/deepseek-ai/DeepSeek-V4-Pro, ``encoding/encoding_dsv4.py``; V3.2's
``encoding/encoding_dsv32.py`` has the invoke/parameter templates and ``tool_output_template``); vLLM's
``vllm/tool_parsers/deepseekv4_tool_parser.py`` ("V4 keeps the V3.2 DSML invoke/parameter grammar, but
wraps tool calls in ``<｜DSML｜tool_calls>``") over ``deepseekv32_tool_parser.py``; xgrammar 0.2.9's
``get_deepseek_v4_structural_tag`` (builtin_structural_tag.py: ``"\\n\\n<｜DSML｜tool_calls>\\n"``, each
invoke ended by ``"</｜DSML｜invoke>\\n"``, style ``deepseek_xml`` parameters), which :mod:`.constrain` uses.
Tool results go back as ``<tool_result>...</tool_result>`` blocks in one user turn (V4's
``tool_output_template`` as read by public re-implementations of encoding_dsv4.py).

Unlike the peers' streaming parsers (vLLM issue 48020: a call arriving in one or two deltas is lost;
SGLang issue 35563: a stream split in two chunks loses calls), this one releases each invoke whole when its
closing tag arrives, so any cut of the text gives the same calls.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from inferhal.core.server.tools.scan import BlockParser, Parsed, ToolCall, loads_object

BAR = "\uff5c"
START, END = f"<{BAR}DSML{BAR}tool_calls>", f"</{BAR}DSML{BAR}tool_calls>"
INVOKE_END = f"</{BAR}DSML{BAR}invoke>"
NAME = "dsml"
XGRAMMAR_MODEL = "deepseek_v4"

_INVOKE = re.compile(rf'\s*<{BAR}DSML{BAR}invoke\s+name="([^"]+)"\s*>(.*){re.escape(INVOKE_END)}\s*', re.DOTALL)
_PARAM = re.compile(rf'<{BAR}DSML{BAR}parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)'
                    rf'</{BAR}DSML{BAR}parameter>', re.DOTALL)


def render_call(name: str, arguments: dict) -> str:
    params = []
    for k, v in arguments.items():
        raw, is_str = (v, "true") if isinstance(v, str) else (json.dumps(v, ensure_ascii=False), "false")
        params.append(f'<{BAR}DSML{BAR}parameter name="{k}" string="{is_str}">{raw}</{BAR}DSML{BAR}parameter>\n')
    return f'<{BAR}DSML{BAR}invoke name="{name}">\n{"".join(params)}{INVOKE_END}\n'


def render_calls(calls: list[tuple[str, dict]]) -> str:
    return f"\n\n{START}\n" + "".join(render_call(n, a) for n, a in calls) + END


def system_prompt(functions: list[dict]) -> str:
    schemas = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    example = render_calls([("$FUNCTION_NAME", {"$PARAMETER_NAME": "$VALUE"})]).strip()
    return (f"## Tools\n\nYou can call the functions below by writing a {START} block such as:\n\n{example}\n\n"
            'Write a string parameter as it is, with string="true"; write any other value (a number, a boolean, '
            'an array, an object) as JSON, with string="false".\n\nThe functions, as JSON schemas:\n'
            f"<functions>\n{schemas}\n</functions>")


def render_results(results: list[str]) -> str:
    return "\n".join(f"<tool_result>{r}</tool_result>" for r in results)


def call_of(invoke: str) -> Optional[tuple[str, dict]]:
    """(name, arguments) of one ``<｜DSML｜invoke ...>...</｜DSML｜invoke>``, or None if malformed."""
    m = _INVOKE.fullmatch(invoke)
    if m is None:
        return None
    args: dict[str, Any] = {}
    body, pos = m.group(2), 0
    for p in _PARAM.finditer(body):
        if body[pos:p.start()].strip():
            return None
        name, is_str, raw = p.groups()
        value = loads_object(raw) if is_str == "false" else raw
        args[name] = raw if value is None and raw.strip() != "null" else value
        pos = p.end()
    return (m.group(1), args) if not body[pos:].strip() else None


class DSMLParser(BlockParser):
    """Content and calls from a choice's text, delta by delta (see the module docstring)."""

    START = START

    def opened(self) -> None:
        self.sink.call()

    def step(self, out: Parsed) -> bool:
        j, k = self.buf.find(INVOKE_END), self.buf.find(END)
        if k >= 0 and (j < 0 or k < j):  # the block ends: what is left before its end is not an invoke
            self._invoke(self.buf[:k], out)
            self.buf, self.inside = self.buf[k + len(END):], False
            self.sink.call()
        elif j >= 0:
            self._invoke(self.buf[:j + len(INVOKE_END)], out)
            self.buf = self.buf[j + len(INVOKE_END):]
        else:
            return False
        return True

    def unterminated(self, out: Parsed) -> None:
        self._invoke(self.buf, out)

    def _invoke(self, text: str, out: Parsed) -> None:
        if not text.strip():
            return
        call = call_of(text)
        if call is None:
            out.text(self.sink.text(text))
        else:
            out.call(ToolCall(call[0], call[1], self.new_id()))
        self.sink.call()


Parser = DSMLParser  # the format's parser, by the name every format module gives it
