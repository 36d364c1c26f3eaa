"""Chat messages → prompt text through a Jinja chat template, as Hugging Face writes them (a GGUF's
``tokenizer.chat_template`` or ``model.chat_template``).

The template runs in Jinja's immutable sandbox: a template that travels with a checkpoint must not run
code. It sees ``messages`` (checked: ``{role, content}`` dicts in ``roles``, with ``tool_calls`` /
``tool_call_id`` where given), ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools`` (None
unless given), any extra variables the caller passes, and ``raise_exception(msg)``, which becomes a
UserError like any failure to render.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from inferhal.core.errors import UserError
from inferhal.core.models.messages import check_messages

ROLES = ("system", "user", "assistant")


def render(messages: Sequence[Mapping[str, str]], template: str | None, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "", roles: Sequence[str] = ROLES,
           tools: Sequence[Mapping] | None = None, **extra) -> str:
    """The prompt text for ``messages`` from the Jinja chat ``template``; ``tools`` (OpenAI's tool objects)
    and ``extra`` (a request's ``chat_template_kwargs``, e.g. ``thinking``) are passed to it as variables."""
    msgs = check_messages(messages, roles)
    if not template:
        raise UserError("this model's GGUF has no chat template: set model.chat_template to a Jinja template")
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 comes with hydra's and transformers' deps
        raise UserError("chat templates need the jinja2 package") from None

    def _raise(msg: str):
        raise UserError(f"chat template: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(template).render(**extra, messages=msgs, add_generation_prompt=add_generation_prompt,
                                                bos_token=bos_token, eos_token=eos_token, tools=tools)
    except TemplateError as exc:
        raise UserError(f"chat template failed to render: {exc}") from None
