"""A chat completions request's ``messages`` → the canonical list the prompt renderer takes
(:mod:`.tools.prompt`): ``{"role", "content": str}``, plus ``tool_calls`` (``[{"id", "type": "function",
"function": {"name", "arguments": dict}}]``) on an assistant message that called tools and ``tool_call_id``
on a ``tool`` message. ``developer`` is taken as ``system`` (OpenAI's newer name for it).

Each check is a 400 naming the field: an unknown role, content that is not text, a call whose arguments
are not a JSON object, a ``tool`` message whose ``tool_call_id`` matches no earlier call.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from inferhal.core.server.errors import APIError

ROLES = ("system", "user", "assistant", "tool", "developer")


def _bad(msg: str, param: str) -> APIError:
    return APIError(400, msg, param)


def text_of(c: Any, param: str) -> str:
    """A string, or a list of ``{"type": "text", "text"}`` parts joined."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    raise _bad(f"{param} must be a string or a list of text parts", param)


def call(name: Any, arguments: Any, call_id: Any, param: str) -> dict:
    """One canonical tool call; ``arguments`` a JSON object or its JSON text."""
    if not isinstance(name, str) or not name:
        raise _bad(f"{param}.function.name must be a non-empty string", f"{param}.function.name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise _bad(f"{param}.function.arguments must be a JSON object (or its JSON text)",
                   f"{param}.function.arguments")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{param}.id must be a non-empty string", f"{param}.id")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def openai_messages(msgs: Any) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' is required: a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role is {role!r}; expected one of {', '.join(ROLES[:4])}",
                       f"messages[{i}].role")
        calls = m.get("tool_calls") if role == "assistant" else None
        content = "" if calls and m.get("content") is None else text_of(m.get("content"), f"messages[{i}].content")
        msg: dict = {"role": "system" if role == "developer" else role, "content": content}
        if calls is not None and calls != []:
            if not isinstance(calls, list):
                raise _bad(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                p = f"messages[{i}].tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or c.get("type", "function") != "function":
                    raise _bad(f"{p} must be {{id, type: function, function: {{name, arguments}}}}", p)
                msg["tool_calls"].append(call(fn.get("name"), fn.get("arguments"), c.get("id"), p))
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise _bad(f"messages[{i}].tool_call_id is required on a tool message", f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    check_results(out, lambda i: f"messages[{i}].tool_call_id")
    return out


def check_results(msgs: list[dict], param_of: Callable[[int], str]) -> None:
    """Every ``tool`` message answers a call made earlier in the conversation."""
    made: set[str] = set()
    for i, m in enumerate(msgs):
        made.update(c["id"] for c in m.get("tool_calls", ()))
        if m["role"] == "tool" and m["tool_call_id"] not in made:
            raise _bad(f"{param_of(i)} {m['tool_call_id']!r} answers no tool call of an earlier assistant message",
                       param_of(i))
