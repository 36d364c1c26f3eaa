"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the official
``anthropic`` client, unchanged, against ``inferhal serve`` (SmolLM2-135M-Instruct): it answers (the same
greedy text as chat completions), streams Anthropic's event sequence to the same message, honours
``system`` and ``stop_sequences``, uses tools (``tool_use`` blocks whose input validates, a ``tool_result``
fed back continues), counts tokens, and answers bad input and a bad key in Anthropic's error shape while the
server goes on serving. (This client version has no ``temperature`` argument: greedy goes in ``extra_body``.)"""

from __future__ import annotations

import pytest

from server_fixtures import API_KEY, MODEL

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

GREEDY = {"extra_body": {"temperature": 0}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key=API_KEY, max_retries=0, timeout=120)


def test_messages_answers_as_chat_completions_does(claude, client):
    r = claude.messages.create(model=MODEL, max_tokens=24, messages=ASK, **GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_") and r.model == MODEL
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == chat.choices[0].message.content
    assert "Paris" in r.content[0].text and r.stop_reason == "end_turn" and r.stop_sequence is None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)


def test_stream_sends_the_event_sequence_and_the_same_message(claude):
    kw = dict(model=MODEL, max_tokens=24, messages=ASK, **GREEDY)
    full = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        kinds = [e.type for e in s if e.type != "text"]  # ("text" is the client's own convenience event)
        final = s.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in full.content]
    assert (final.stop_reason, final.usage.output_tokens) == (full.stop_reason, full.usage.output_tokens)


def test_system_and_stop_sequences(claude):
    count = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    r = claude.messages.create(model=MODEL, max_tokens=40, messages=count, stop_sequences=[" 5"], **GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == " 5" and r.content[0].text == "1, 2, 3, 4,"
    plain = claude.messages.create(model=MODEL, max_tokens=8, messages=ASK, **GREEDY)
    told = claude.messages.create(model=MODEL, max_tokens=8, messages=ASK, system="Answer in French.", **GREEDY)
    assert told.usage.input_tokens != plain.usage.input_tokens  # the system prompt replaces the template's own


@pytest.mark.slow
def test_tools_use_and_a_tool_result_continues(claude):
    kw = dict(model=MODEL, max_tokens=64, tools=[WEATHER], messages=[{"role": "user", "content": "Weather in Paris?"}],
              tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY)
    r = claude.messages.create(**kw)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    use = r.content[0]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", use.name, use.input)]
    named = claude.messages.create(**{**kw, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named.content[0].type == "tool_use" and named.content[0].name == "get_weather"
    history = kw["messages"] + [{"role": "assistant", "content": r.content},
                                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                              "content": "21C and sunny"}]}]
    after = claude.messages.create(model=MODEL, max_tokens=32, tools=[WEATHER], messages=history, **GREEDY)
    assert after.content and after.usage.input_tokens > r.usage.input_tokens
    count = claude.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=history)
    assert count.input_tokens == after.usage.input_tokens


BAD = {
    "image block": ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}], {},
                    "messages.0.content.0.type"),
    "unknown block": ([{"role": "user", "content": [{"type": "hologram"}]}], {}, "messages.0.content.0.type"),
    "tool_result without a call": ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                  "content": "x"}]}], {},
                                   "messages.0.content.0.tool_use_id"),
    "tool schema that does not compile": (ASK, {"tools": [{"name": "f", "input_schema": {"type": "bogus"}}]},
                                          "tools.0.input_schema"),
    "tool_choice naming no tool": (ASK, {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "g"}},
                                   "tool_choice.name"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_in_anthropics_shape_and_the_server_keeps_serving(claude, case):
    messages, extra, field = BAD[case]
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=4, messages=messages, **extra)
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"]
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=ASK).content is not None


def test_key_model_and_max_tokens_errors(claude, server):
    bad = anthropic.Anthropic(base_url=server[0], api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert err.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-opus", max_tokens=2, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert "max_tokens" in err.value.body["error"]["message"]
