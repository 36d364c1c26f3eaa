"""Chat messages as every chat model takes them: a non-empty list of ``{role, content}`` mappings; for tool
calling an assistant message may carry ``tool_calls`` (a list) and a ``tool`` message ``tool_call_id``."""

from __future__ import annotations

from typing import Mapping, Sequence

from inferhal.core.errors import UserError

_TOOL_KEYS = {"tool_calls": list, "tool_call_id": str}


def check_messages(messages: Sequence[Mapping[str, str]], roles: Sequence[str]) -> list[dict]:
    """``messages`` as plain ``{"role", "content"}`` dicts (with their ``tool_calls`` / ``tool_call_id``), or a
    UserError naming the first bad one."""
    if not messages:
        raise UserError("messages is empty: give at least one {role: user, content: ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise UserError(f"messages[{i}] must be a mapping with 'role' and 'content', got {m!r}")
        if str(m["role"]) not in roles:
            raise UserError(f"messages[{i}].role is {m['role']!r}; expected one of {', '.join(roles)}")
        if not isinstance(m["content"], str):
            raise UserError(f"messages[{i}].content must be a string, got {type(m['content']).__name__}")
        msg = {"role": str(m["role"]), "content": m["content"]}
        for key, kind in _TOOL_KEYS.items():  # tool calling: an assistant's calls, the call a tool result answers
            if key in m:
                if not isinstance(m[key], kind):
                    raise UserError(f"messages[{i}].{key} must be a {kind.__name__}, got {type(m[key]).__name__}")
                msg[key] = m[key]
        out.append(msg)
    return out
