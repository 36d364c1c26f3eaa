"""Gemma's built-in chat format: the prompt text of chat messages when neither the GGUF nor
``model.chat_template`` gives a Jinja template (those render through :mod:`inferhal.core.models.gguf.chat`).

The Gemma 3 270M GGUF is the base model and carries none, so messages are laid out in Gemma's turn
format, the one its instruction-tuned siblings are trained on::

    <start_of_turn>user\\n{system}\\n\\n{user text}<end_of_turn>\\n
    <start_of_turn>model\\n{assistant text}<end_of_turn>\\n
    ...
    <start_of_turn>model\\n            <- the generation prompt

Roles: ``system`` (folded into the first user turn, as Gemma has no system role), ``user``,
``assistant`` (written as ``model``; ``model`` is accepted too). The text starts with ``<bos>``, as
Hugging Face chat templates write it: encode it with ``add_bos=False`` (``<bos>`` is a control piece,
matched whole).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from inferhal.core.errors import UserError
from inferhal.core.models.messages import check_messages

ROLES = ("system", "user", "assistant", "model")


def _check(messages: Sequence[Mapping[str, str]]) -> list[tuple[str, str]]:
    """``(role, content)`` pairs in Gemma's roles (assistant → model), or a UserError naming the bad message."""
    return [("model" if m["role"] == "assistant" else m["role"], m["content"]) for m in check_messages(messages, ROLES)]


def render_turns(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                 bos: str = "<bos>") -> str:
    """The prompt text for ``messages`` in Gemma's turn format."""
    msgs = _check(messages)
    system = ""
    if msgs[0][0] == "system":
        system = msgs[0][1].strip() + "\n\n"
        msgs = msgs[1:]
    parts = [bos]
    for i, (role, content) in enumerate(msgs):
        if role == "system":
            raise UserError(f"messages: a system message may only come first (found one at turn {i + 1})")
        text = (system + content.strip()) if i == 0 and role == "user" else content.strip()
        parts.append(f"<start_of_turn>{role}\n{text}<end_of_turn>\n")
    if system and not msgs:
        parts.append(f"<start_of_turn>user\n{system.strip()}<end_of_turn>\n")
    if add_generation_prompt:
        parts.append("<start_of_turn>model\n")
    return "".join(parts)

