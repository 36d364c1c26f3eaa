"""A chat request's prompt: canonical messages (:mod:`..chat_messages`), its tools and its
``chat_template_kwargs`` through the model's chat template.

- A Jinja template that renders tools itself (it mentions ``tools``) gets them as they are: ``tools``
  (OpenAI tool objects), messages with ``tool_calls`` (arguments as objects, as transformers passes
  them) and ``tool`` messages.
- Any other template (SmolLM2's, Gemma's, ...) gets plain system/user/assistant messages in the model
  family's call format (:mod:`.hermes` or :mod:`.dsml`): the functions appended to the system message
  (one is added first if there is none), an assistant's calls written after its text as the model would
  write them, and each run of tool results one user message of ``<tool_response>`` (Hermes) or
  ``<tool_result>`` (DSML) blocks, in order.
- ``chat_template_kwargs`` become template variables; a model without a Jinja template (Gemma 3's
  built-in turns) refuses them.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Optional

from inferhal.core.errors import UserError
from inferhal.core.server.errors import APIError
from inferhal.core.server.tools.spec import ToolSpec

_MENTIONS_TOOLS = re.compile(r"\btools\b")


def renders_tools(template: Optional[str]) -> bool:
    return bool(template) and bool(_MENTIONS_TOOLS.search(template))


def fold(messages: list[dict], fmt: ModuleType, functions: Optional[list[dict]]) -> list[dict]:
    """``messages`` as plain ``{role, content}`` ones, tools and calls written in ``fmt`` (see above)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = fmt.render_results([m["content"]])
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
            continue
        content = m["content"]
        if m.get("tool_calls"):
            calls = fmt.render_calls([(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]])
            content = f"{content}\n{calls}" if content and not calls.startswith("\n") else content + calls
        out.append({"role": m["role"], "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if functions:
        tools = fmt.system_prompt(functions)
        if out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{tools}" if out[0]["content"] else tools
        else:
            out.insert(0, {"role": "system", "content": tools})
    return out


def render(tok, messages: list[dict], fmt: ModuleType, spec: Optional[ToolSpec], template_kwargs: dict) -> str:
    """The prompt text (UserErrors of the template become 400s naming ``messages``)."""
    from inferhal.core.models.gguf import chat

    functions = list(spec.functions) if spec is not None and spec.active else None
    template = getattr(tok, "chat_template", None)
    bos, eos = str(getattr(tok, "bos_token", "") or ""), str(getattr(tok, "eos_token", "") or "")
    roles = tuple(getattr(tok, "chat_roles", ("system", "user", "assistant")))
    try:
        if isinstance(template, str) and renders_tools(template):
            tools = [{"type": "function", "function": f} for f in functions] if functions else None
            return chat.render(messages, template, True, bos, eos, (*roles, "tool"), tools, **template_kwargs)
        plain = fold(messages, fmt, functions)
        if isinstance(template, str) and template:
            return chat.render(plain, template, True, bos, eos, roles, **template_kwargs)
        if template_kwargs:
            raise APIError(400, "this model has no Jinja chat template to pass 'chat_template_kwargs' to",
                           "chat_template_kwargs")
        return tok.apply_chat_template(plain, add_generation_prompt=True)
    except UserError as exc:
        raise APIError(400, str(exc), "messages") from None
