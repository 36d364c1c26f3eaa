"""A request's tools, checked: the functions (OpenAI's ``tools``, Anthropic's converted to the same shape),
the choice (``auto`` | ``none`` | ``required`` | a function's name) and whether parallel calls are allowed.

Every check raises :class:`~inferhal.core.server.protocol.APIError` (400) naming the field: a function
without a valid name, two functions with one name, a ``parameters`` schema xgrammar cannot compile, a
``tool_choice`` naming a function not in ``tools``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from inferhal.core.server.errors import APIError

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolSpec:
    functions: tuple[dict, ...]  # OpenAI function objects: name, description?, parameters?, strict?
    choice: str = "auto"  # auto | none | required | the name of the function to call
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools are rendered into the prompt and the output is parsed for calls."""
        return bool(self.functions) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The output is constrained to calls (``required`` or a named function)."""
        return self.active and self.choice != "auto"

    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]


def _bad(msg: str, param: str) -> APIError:
    return APIError(400, msg, param)


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming ``param`` unless xgrammar compiles ``schema`` (a JSON schema object)."""
    if not isinstance(schema, (dict, bool)):
        raise _bad(f"'{param}' must be a JSON schema object, got {json.dumps(schema)[:60]}", param)
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except Exception as exc:  # xgrammar's own errors carry the reason on the first line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        first = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)
        raise _bad(f"'{param}' cannot be compiled: {first}", param) from None


def function(name: Any, description: Any, parameters: Any, param: str, strict: Any = None,
             schema_field: str = "parameters") -> dict:
    """One checked function object; ``param`` is where it came from (``tools[2].function``), ``schema_field``
    the name its schema came in (Anthropic's ``input_schema``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"'{param}.name' must be 1 to 64 letters, digits, '_', '-', '.' or ':', got {name!r}",
                   f"{param}.name")
    out: dict = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise _bad(f"'{param}.description' must be a string", f"{param}.description")
        out["description"] = description
    if parameters is not None:
        check_schema(parameters, f"{param}.{schema_field}")
        out["parameters"] = parameters
    if strict is not None:
        if not isinstance(strict, bool):
            raise _bad(f"'{param}.strict' must be a boolean", f"{param}.strict")
        out["strict"] = strict
    return out


def openai_tools(body: dict) -> Optional[ToolSpec]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat completions body (None: no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of {type: function, function: {name, description, parameters}}", "tools")
    fns = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise _bad(f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}",
                       f"tools[{i}]")
        f = fn
        fns.append(function(f.get("name"), f.get("description"), f.get("parameters"), f"tools[{i}].function",
                            f.get("strict")))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("'tool_choice' must be auto, none, required or {type: function, function: {name}}",
                       "tool_choice")
        choice = fn["name"]
        if choice in CHOICES:  # a function named like a mode would be ambiguous
            raise _bad(f"'tool_choice' names a function {choice!r}, which is also a mode; rename it", "tool_choice")
    elif choice not in CHOICES:
        raise _bad(f"'tool_choice' must be auto, none, required or {{type: function, function: {{name}}}}, got "
                   f"{json.dumps(choice)[:40]}", "tool_choice")
    return make(fns, choice, parallel, "tools", "tool_choice")


def make(fns: list[dict], choice: str, parallel: bool, tools_param: str, choice_param: str) -> ToolSpec:
    names = [f["name"] for f in fns]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise _bad(f"'{tools_param}' holds two functions named {dup!r}", tools_param)
    if choice not in CHOICES and choice not in names:
        raise _bad(f"'{choice_param}' names the function {choice!r}, which is not in '{tools_param}' "
                   f"({', '.join(names)})", choice_param)
    return ToolSpec(tuple(fns), choice, parallel)
