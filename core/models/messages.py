"""Chat messages as every chat model takes them: a non-empty list of ``{role, content}`` mappings."""

from __future__ import annotations

from typing import Mapping, Sequence

from inferhal.core.errors import UserError


def check_messages(messages: Sequence[Mapping[str, str]], roles: Sequence[str]) -> list[dict]:
    """``messages`` as plain ``{"role", "content"}`` dicts, or a UserError naming the first bad one."""
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
        out.append({"role": str(m["role"]), "content": m["content"]})
    return out
