"""Anthropic Messages request bodies → one validated :class:`~.protocol.Job` (chat, ``n`` = 1).

Supported: ``model``, ``max_tokens`` (required, except for ``count_tokens``), ``messages`` (roles user |
assistant; content a string or blocks: ``text``, ``tool_use`` in assistant turns, ``tool_result`` in user
turns, ``thinking`` / ``redacted_thinking`` in assistant turns, which are not rendered again), ``system``
(a string or text blocks), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``stream``, ``tools``
(``{name, description, input_schema}``), ``tool_choice`` (``auto`` | ``any`` | ``tool`` with ``name`` |
``none``; ``disable_parallel_tool_use``), ``thinking`` (``enabled``: the output starts in reasoning, as
``chat_template_kwargs`` ``thinking: true``; ``budget_tokens`` is checked against ``max_tokens``, which bounds
reasoning and answer together), ``timeout_s`` (this server's per-request deadline), ``metadata`` (not read: it
does not change the output). Any other block type
(an image, a document) is a 400 naming it: ``messages.0.content.1.type``.
"""

from __future__ import annotations

from typing import Any

from inferhal.core.server.chat_messages import call, text_of
from inferhal.core.server.errors import APIError
from inferhal.core.server.protocol import Job, new_job, sampling_fields, timeout_of
from inferhal.core.server.tools import spec as tool_spec

MAX_STOP_SEQUENCES = 16
#: tool_choice.type → the OpenAI-style choice (a ``tool`` choice is the function's name)
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _bad(msg: str, param: str) -> APIError:
    return APIError(400, msg, param)


def _blocks(content: Any, param: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _bad(f"{param} must be a string or a list of content blocks", param)
    return content


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' is required: a non-empty list of {role, content}", "messages")
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = text_of(system, "system") if not isinstance(system, list) else "".join(
            b.get("text", "") for b in _blocks(system, "system") if _text_block(b, "system"))
        if text:
            out.append({"role": "system", "content": text})
    made: set[str] = set()
    for i, m in enumerate(msgs):
        p = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{p}.role must be user or assistant", f"{p}.role")
        texts, calls, results = [], [], []
        for j, b in enumerate(_blocks(m.get("content"), f"{p}.content")):
            q, kind = f"{p}.content.{j}", b.get("type")
            if kind == "text" and _text_block(b, q):
                texts.append(b["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append(call(b.get("name"), b.get("input", {}), b.get("id"), q))
                made.add(b["id"])
            elif kind == "tool_result" and m["role"] == "user":
                rid = b.get("tool_use_id")
                if not isinstance(rid, str) or rid not in made:
                    raise _bad(f"{q}.tool_use_id {rid!r} answers no tool_use block of an earlier assistant message",
                               f"{q}.tool_use_id")
                c = b.get("content", "")
                text = text_of(c, f"{q}.content") if isinstance(c, str) else "".join(
                    x["text"] for x in _blocks(c, f"{q}.content") if _text_block(x, f"{q}.content"))
                results.append({"role": "tool", "tool_call_id": rid,
                                "content": f"Error: {text}" if b.get("is_error") else text})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                pass  # earlier reasoning is not rendered again (as DeepSeek's and Qwen's templates drop it)
            else:
                what = "not supported by this server" if kind in ("image", "document", "search_result") else (
                    f"not allowed in a {m['role']} message" if kind in ("tool_use", "tool_result", "thinking",
                                                                          "redacted_thinking") else "unknown")
                raise _bad(f"{q}.type {kind!r} is {what}", f"{q}.type")
        out.extend(results)
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _text_block(b: dict, param: str) -> bool:
    if b.get("type") != "text" or not isinstance(b.get("text"), str):
        raise _bad(f"{param} must hold text blocks {{type: text, text}}", param)
    return True


def _tools(body: dict):
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice is not None and (not isinstance(choice, dict) or choice.get("type") not in ("auto", "none")):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of {name, description, input_schema}", "tools")
    fns = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            raise _bad(f"tools.{i}: only client tools {{name, description, input_schema}} are supported", f"tools.{i}")
        fns.append(tool_spec.function(t.get("name"), t.get("description"), t.get("input_schema", {"type": "object"}),
                                      f"tools.{i}", schema_field="input_schema"))
    choice = choice if choice is not None else {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*CHOICES, "tool"):
        raise _bad("'tool_choice.type' must be auto, any, tool or none", "tool_choice")
    name = choice.get("name") if kind == "tool" else CHOICES[kind]
    if not isinstance(name, str):
        raise _bad("'tool_choice.name' is required with type tool", "tool_choice.name")
    parallel = not choice.get("disable_parallel_tool_use", False)
    return tool_spec.make(fns, name, parallel, "tools", "tool_choice.name" if kind == "tool" else "tool_choice")


def parse(body: Any, count_only: bool = False) -> Job:
    job = new_job(body, chat=True)
    job.messages = _messages(body)
    job.tools = _tools(body)
    mt = body.get("max_tokens")
    if not count_only:
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise _bad(f"'max_tokens' is required: an integer >= 1, got {mt!r}", "max_tokens")
        job.max_tokens = mt
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise _bad("'thinking.type' must be enabled, disabled or adaptive", "thinking")
        budget = thinking.get("budget_tokens")
        if kind == "enabled" and budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                                                         or budget < 1 or (mt is not None and budget >= mt)):
            raise _bad("'thinking.budget_tokens' must be an integer >= 1 and below max_tokens",
                       "thinking.budget_tokens")
        job.template_kwargs = {"thinking": kind != "disabled"}
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) and s
                                                                                   for s in stop):
            raise _bad(f"'stop_sequences' must be a list of up to {MAX_STOP_SEQUENCES} non-empty strings",
                       "stop_sequences")
        if stop:
            job.sampling["stop"] = list(stop)
    sampling_fields(body, job.sampling, ("temperature", "top_p", "top_k"), temperature_max=1.0)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    job.stream = stream
    job.timeout_s = timeout_of(body)
    return job
