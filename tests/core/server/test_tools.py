"""Tool calling and reasoning output through the official ``openai`` client against ``inferhal serve``
(SmolLM2-135M-Instruct, greedy): ``tool_choice=required`` and a named function give calls whose arguments
validate against the function's schema, the same streamed and not; a tool result fed back continues the
conversation; ``auto`` output parses the same streamed and not; the reasoning split follows
``chat_template_kwargs`` and is the same streamed and not."""

from __future__ import annotations

import json

import pytest

from server_fixtures import MODEL

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(client, **kw):
    """(content, reasoning, [(name, arguments)], finish reasons of the chunks with choices) of a stream."""
    content, reasoning, calls, reasons, ids = "", "", {}, [], {}
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            got = calls.setdefault(tc.index, ["", ""])
            got[0] += tc.function.name or ""
            got[1] += tc.function.arguments or ""
            ids[tc.index] = tc.id or ids.get(tc.index)
        reasons.append(ch.choices[0].finish_reason)
    assert all(ids.values()), "every streamed call has an id"
    return content, reasoning, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())], reasons


def check_calls(calls):
    assert calls
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])  # the arguments validate against the function's schema


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_calls_validate_and_stream_equals_non_stream(client, choice):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=96, temperature=0,
              parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    calls = calls_of(c.message)
    check_calls(calls)
    assert len(calls) == 1 and c.finish_reason == "tool_calls" and c.message.content is None
    if choice != "required":
        assert calls[0][0] == "get_time"
    assert c.message.tool_calls[0].id.startswith("call_") and c.message.tool_calls[0].type == "function"
    content, _, s_calls, reasons = streamed(client, **kw)
    assert (content, s_calls) == ("", calls)
    assert reasons[-1] == "tool_calls" and all(x is None for x in reasons[:-1])


def test_required_with_parallel_calls_allowed(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=160, temperature=0)
    c = r.choices[0]
    check_calls(calls_of(c.message))
    assert c.finish_reason in ("tool_calls", "length")


def test_a_tool_result_fed_back_continues_the_conversation(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls  # the model answers after the result
    assert r.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt
    content, _, calls, _ = streamed(client, model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    assert (content, calls) == (c.message.content or "", calls_of(c.message))


@pytest.mark.parametrize("ask", [ASK, [{"role": "user", "content": "Call get_time for zone UTC."}]], ids=["paris", "utc"])
def test_auto_parses_the_same_streamed_and_not(client, ask):
    kw = dict(model=MODEL, messages=ask, tools=TOOLS, max_tokens=48, temperature=0)
    c = client.chat.completions.create(**kw).choices[0]
    content, _, calls, reasons = streamed(client, **kw)
    assert (content, calls) == (c.message.content or "", calls_of(c.message))
    assert reasons[-1] == c.finish_reason
    if calls:
        check_calls(calls)


def test_tool_choice_none_renders_no_tools(client):
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    none = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0, tools=TOOLS,
                                          tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


def _reasoning(msg):
    return getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content")


@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_starts_where_chat_template_kwargs_say(client, thinking):
    kw = dict(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
              extra_body={"chat_template_kwargs": {"thinking": thinking}})
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0).choices[0]
    m = client.chat.completions.create(**kw).choices[0].message
    if thinking:  # SmolLM2 never closes the block: everything is reasoning
        assert _reasoning(m) == plain.message.content and not m.content
    else:
        assert m.content == plain.message.content and _reasoning(m) is None
    content, reasoning, _, _ = streamed(client, **kw)
    assert (content, reasoning) == (m.content or "", _reasoning(m) or "")


def test_a_think_block_the_model_writes_is_split_off(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
              extra_body={"structured_outputs": {"regex": r"<think>[a-z ]{1,20}</think>[A-Z][a-z]{1,12}"}})
    m = client.chat.completions.create(**kw).choices[0].message
    r = _reasoning(m)
    assert r and "<think>" not in r and "</think>" not in (m.content or "") and m.content
    content, reasoning, _, _ = streamed(client, **kw)
    assert (content, reasoning) == (m.content, r)
