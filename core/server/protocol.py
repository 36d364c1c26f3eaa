"""OpenAI request bodies → one validated :class:`Job`.

Each check raises :class:`APIError` with the status, the offending ``param`` and a message; the server
answers it as ``{"error": {"message", "type", "param", "code"}}``. Supported: ``model``, ``prompt`` (a
string or one list of token ids) or ``messages`` (roles system | user | assistant | tool; content a string
or text parts; :mod:`.chat_messages`), ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
(:mod:`.tools.spec`), ``chat_template_kwargs`` (extra variables for the chat template, e.g.
``{"thinking": true}``, which also sets where reasoning output starts), ``max_tokens`` /
``max_completion_tokens`` (left out: 16 for completions, as OpenAI and vLLM default; up to the context
limit for chat), ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop`` (up to 4 strings),
``n``, ``logprobs`` / ``top_logprobs`` (at most 20), ``stream``, ``stream_options.include_usage``,
``ignore_eos``, ``timeout_s`` (this request's deadline in seconds from its arrival; past it the request
ends with finish reason ``timeout``), ``prompt_cache_key`` (OpenAI's field: a session key, at most
:data:`MAX_SESSION_KEY` characters; with DP ranks the server keeps a session's requests on one rank, else it
changes nothing; clients that cannot set the body send the ``X-Session-Id`` header, which the body's field
overrides), and structured outputs: ``response_format`` (``text``,
``json_object``, ``json_schema`` with ``json_schema.schema``) or vLLM's ``structured_outputs`` (one of
``json``, ``json_object``, ``regex``, ``choice``, ``grammar``); an invalid schema or regex is a 400.
A field that would change the output but is not implemented (penalties, ``logit_bias``, the deprecated
``functions``, ``echo``, ``suffix``, ``best_of``; ``tools`` on completions) is a 400 rather than silently
ignored; other unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from inferhal.core.sampling.params import SEED_MAX, SEED_MIN
from inferhal.core.server.chat_messages import openai_messages
from inferhal.core.server.errors import APIError
from inferhal.core.server.tools.spec import openai_tools

MAX_LOGPROBS = 20
MAX_STOP = 4
MAX_N = 16
#: the longest session key (``prompt_cache_key``, ``X-Session-Id``), in characters: our bound (one public OpenAI
#: client, elph-ai's openai_prompt_cache.rs, clamps keys to 64 characters, which this admits)
MAX_SESSION_KEY = 256
SESSION_HEADER = "X-Session-Id"
#: fields whose non-default value is refused: field → the value that means "off"
_UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
                "functions": None, "function_call": None, "echo": False, "suffix": None, "best_of": 1}


#: ``max_tokens`` of a completions request that leaves it out (OpenAI's legacy default; vLLM's too)
COMPLETIONS_MAX_TOKENS = 16


@dataclass
class Job:
    """One request, validated: the prompt (text or ids, or chat messages) and its sampling fields."""

    chat: bool
    model: str
    prompt: Any = None  # str | list[int] (completions)
    messages: Optional[list[dict]] = None  # chat
    max_tokens: Optional[int] = None  # None (chat only) = up to the context limit
    sampling: dict = field(default_factory=dict)  # SamplingParams fields
    n: int = 1
    logprobs: Optional[int] = None  # top-k per position; None = none asked
    stream: bool = False
    include_usage: bool = False
    structured_field: Optional[str] = None  # the field its constraint came from (a compile error names it)
    tools: Optional[Any] = None  # a tools.spec.ToolSpec (chat)
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs
    thinking: Optional[bool] = None  # chat: whether the output starts in reasoning (set with the prompt)
    timeout_s: Optional[float] = None  # the request's deadline, from its arrival (None: the server's default)
    session: Optional[str] = None  # the client's session key (prompt_cache_key, else the X-Session-Id header)


def _bad(msg: str, param: str) -> APIError:
    return APIError(400, msg, param)


def _int(body: dict, key: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{key}' must be an integer, got {v!r}", key)
    if v < lo or (hi is not None and v > hi):
        raise _bad(f"'{key}' must be {'>= ' + str(lo) if hi is None else f'in [{lo}, {hi}]'}, got {v}", key)
    return v


def _num(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"'{key}' must be a number, got {v!r}", key)
    if not lo <= v <= hi or (lo_open and v == lo):  # (NaN too: JSON bodies may carry it, Python reads it)
        raise _bad(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


#: names a chat template already has: chat_template_kwargs cannot replace them
RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception")


def template_kwargs(kw: Any) -> dict:
    if kw is None:
        return {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kw):
        raise _bad("'chat_template_kwargs' must be an object whose keys are names", "chat_template_kwargs")
    taken = [k for k in kw if k in RESERVED]
    if taken:
        raise _bad(f"'chat_template_kwargs' cannot set {', '.join(taken)} (the server sets them)",
                   "chat_template_kwargs")
    return dict(kw)


def structured_field(body: dict) -> str:
    """The field a request's constraint comes in: vLLM's ``structured_outputs`` if given, else ``response_format``."""
    return "structured_outputs" if body.get("structured_outputs") is not None else "response_format"


def _structured(body: dict) -> Optional[Any]:
    """``response_format`` / ``structured_outputs`` → a StructuredOutputs (None for none or plain text)."""
    from inferhal.core.structured.params import StructuredOutputs, StructuredOutputsError

    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf is not None and so is not None:
        raise _bad("set 'response_format' or 'structured_outputs', not both", "response_format")
    try:
        if so is not None:
            return StructuredOutputs.coerce(so)
        if rf is None:
            return None
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputs(json_object=True)
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise _bad("'response_format.json_schema.schema' is required: a JSON schema object",
                           "response_format")
            return StructuredOutputs(json=js["schema"])
    except StructuredOutputsError as exc:
        raise _bad(str(exc), structured_field(body)) from None
    raise _bad("'response_format.type' must be one of text, json_object, json_schema", "response_format")


def session_key(value: Any, param: str) -> Optional[str]:
    """A session key as sent in ``param`` (``prompt_cache_key``, ``X-Session-Id``): None, or a non-empty string of
    at most :data:`MAX_SESSION_KEY` characters (anything else is a 400 naming ``param``)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_SESSION_KEY:
        raise _bad(f"'{param}' must be a non-empty string of at most {MAX_SESSION_KEY} characters", param)
    return value


def session_of(job: Job, headers: Any) -> None:
    """``job.session``: the body's key if it sent one, else the ``X-Session-Id`` header's (``headers``: the
    request's, case-insensitive)."""
    if job.session is None:
        job.session = session_key(headers.get(SESSION_HEADER), SESSION_HEADER)


def timeout_of(body: dict) -> Optional[float]:
    """The request's ``timeout_s`` (seconds > 0): past it the request ends with finish reason ``timeout``."""
    return _num(body, "timeout_s", 0.0, 1e9, lo_open=True)


def sampling_fields(body: dict, s: dict, keys: tuple[str, ...], temperature_max: float = 2.0) -> None:
    """The sampling fields ``keys`` of ``body``, checked, into ``s`` (SamplingParams' names)."""
    check = {"temperature": lambda: _num(body, "temperature", 0.0, temperature_max),
             "top_p": lambda: _num(body, "top_p", 0.0, 1.0, lo_open=True),
             "min_p": lambda: _num(body, "min_p", 0.0, 1.0),
             "top_k": lambda: _int(body, "top_k", -1), "seed": lambda: _int(body, "seed", SEED_MIN, SEED_MAX)}
    for key in keys:
        val = check[key]()
        if val is not None:
            s[key] = val


def new_job(body: Any, chat: bool) -> Job:
    """A Job for ``body`` (a JSON object naming its ``model``), its fields yet to be read."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required (a string)", "model")
    return Job(chat=chat, model=model)


def parse(body: Any, chat: bool) -> Job:
    job = new_job(body, chat)
    if chat:
        job.messages = openai_messages(body.get("messages"))
        job.tools = openai_tools(body)
        job.template_kwargs = template_kwargs(body.get("chat_template_kwargs"))
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise _bad("'prompt' is empty", "prompt")
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            pass
        else:
            what = "is required" if p is None else f"got {json.dumps(p)[:80]}"
            raise _bad(f"'prompt' must be a non-empty string or one list of integer token ids (one prompt per "
                       f"request); {what}", "prompt")
        job.prompt = p
    for key, off in (_UNSUPPORTED if chat else {**_UNSUPPORTED, "tools": None, "tool_choice": None}).items():
        v = body.get(key)
        if v is not None and v != off and v != {} and v != []:
            raise _bad(f"'{key}' is not supported by this server", key)
    mt = _int(body, "max_completion_tokens", 1) if chat else None
    job.max_tokens = mt if mt is not None else _int(body, "max_tokens", 1)
    if job.max_tokens is None and not chat:
        job.max_tokens = COMPLETIONS_MAX_TOKENS  # chat: None, up to the context limit
    s = job.sampling
    sampling_fields(body, s, ("temperature", "top_p", "min_p", "top_k", "seed"))
    if body.get("ignore_eos") is not None:
        s["ignore_eos"] = bool(body["ignore_eos"])
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop) or len(stop) > MAX_STOP:
            raise _bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
        s["stop"] = list(stop)
    structured = _structured(body)
    if structured is not None and job.tools is not None and job.tools.forced:
        raise _bad(f"'{structured_field(body)}' cannot be combined with tool_choice={job.tools.choice!r} (that "
                   f"constrains the output to tool calls)", "tool_choice")
    if structured is not None:
        s["structured"] = structured
        job.structured_field = structured_field(body)
    job.n = _int(body, "n", 1, MAX_N) or 1
    job.timeout_s = timeout_of(body)
    job.session = session_key(body.get("prompt_cache_key"), "prompt_cache_key")
    if chat:
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise _bad("'logprobs' must be a boolean for chat completions", "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not lp:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        job.logprobs = (top or 0) if lp else None
    else:
        job.logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    job.stream = stream
    so = body.get("stream_options")
    if so is not None:
        if not stream:
            raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(so, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        usage = so.get("include_usage", False)
        if not isinstance(usage, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
        job.include_usage = usage
    return job
