"""Hostile bodies against every route of the real server (SmolLM2-135M-Instruct, the package's server):
property-based request bodies (Hypothesis) built from each route's fields, each given a valid value, a value
of the wrong kind, out of range, NaN or infinite, or arbitrary JSON, plus raw bytes and deep nesting. For
every body: never a 500, never a connection without an answer (a 60 s socket timeout; a stream is read to its
end), the engine loop alive after; every 400 names the field in OpenAI's shape (``error.param``) or in
Anthropic's (the field in ``error.message``), every 4xx and 429 is the route's error shape, every 200 the
route's reply shape. Then the server holds no request and no KV block.

Schemathesis is not used: the app serves no OpenAPI schema (``openapi_url=None``) and its routes read the body
themselves (``Request``), so FastAPI's schema would describe no field. ``INFERHAL_FUZZ_EXAMPLES`` scales the
examples per route (the default, 150, keeps this module to seconds past the model load; a campaign after the
fixes in core/server ran 4,000 a route, clean, in 7.8 min)."""

from __future__ import annotations

import http.client
import json
import os
import re
import time
from urllib.parse import urlparse

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from server_fixtures import API_KEY, MODEL

pytest.importorskip("fastapi")

EXAMPLES = int(os.environ.get("INFERHAL_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="INFERHAL_FUZZ_EXAMPLES" not in os.environ,
                database=None,  # (a campaign, INFERHAL_FUZZ_EXAMPLES set, draws afresh each run)
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
TIMEOUT_S = 60.0

# -- values -----------------------------------------------------------------------------------------------
SCALARS = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.sampled_from([0, -1, 1, 2 ** 63, -2 ** 63 - 1])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["", "auto", "none", "required", "text", "json_object", "json_schema", "user", "tool"]))
ANY = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3),
                   max_leaves=8)
#: what a field may get: mostly anything; the output-length fields a valid value only where it is small (a valid
#: body generates: keep each example to a few tokens)
SMALL = st.integers(1, 4)
LENGTH = SMALL | st.sampled_from([0, -1, 10 ** 6, 2 ** 64, 1.5, "4", None, True, float("nan")])
TEXT = st.text(max_size=40) | st.sampled_from(["Hi", "The capital of France is", "\u0000\ud7ff\ufffd", "<think>"])


def content() -> st.SearchStrategy:
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "tool_use", "x"]) | ANY,
                                  "text": TEXT | ANY})
    return TEXT | st.lists(part, max_size=3) | ANY


def openai_message() -> st.SearchStrategy:
    call = st.fixed_dictionaries({"id": st.text(max_size=6) | ANY, "type": st.just("function") | ANY,
                                  "function": st.fixed_dictionaries({"name": st.sampled_from(["f", ""]) | ANY,
                                                                     "arguments": st.sampled_from(["{}", "[1]", "{"])
                                                                     | ANY}) | ANY})
    return st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]) | ANY,
         "content": content()},
        optional={"tool_calls": st.lists(call, max_size=2) | ANY, "tool_call_id": st.text(max_size=6) | ANY}) | ANY


def anthropic_message() -> st.SearchStrategy:
    block = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "x"]) | ANY},
        optional={"text": TEXT | ANY, "id": st.text(max_size=6) | ANY, "name": st.sampled_from(["f", ""]) | ANY,
                  "input": ANY, "tool_use_id": st.text(max_size=6) | ANY, "content": content(), "is_error": ANY})
    return st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | ANY,
                                  "content": TEXT | st.lists(block, max_size=3) | ANY}) | ANY


SCHEMA = st.sampled_from([{"type": "object"}, {"type": "bogus"}, {"type": "string", "maxLength": 3}, {"$ref": "#/x"},
                          {"enum": []}, True, {"type": "object", "properties": {"a": {"type": "integer"}}}]) | ANY
TOOL = st.fixed_dictionaries({"type": st.just("function") | ANY, "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "", "a b"]) | ANY}, optional={"parameters": SCHEMA, "strict": ANY}) | ANY})
ATOOL = st.fixed_dictionaries({"name": st.sampled_from(["f", "", "a b"]) | ANY}, optional={"input_schema": SCHEMA,
                                                                                         "type": ANY})
SAMPLING = {"temperature": st.floats(0, 2) | ANY, "top_p": st.floats(0, 1) | ANY, "top_k": st.integers(-2, 50) | ANY,
            "min_p": st.floats(0, 1) | ANY, "seed": st.integers(-2 ** 64, 2 ** 64) | ANY,
            "timeout_s": st.floats(0, 30) | st.sampled_from([0.001, 1e-300, 1e30]) | ANY}
OPENAI = {**SAMPLING, "model": st.just(MODEL) | ANY, "max_tokens": LENGTH, "n": st.integers(-1, 3) | ANY,
          "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=6) | ANY,
          "logprobs": st.booleans() | st.integers(-1, 25) | ANY, "top_logprobs": st.integers(-1, 25) | ANY,
          "stream": st.booleans() | ANY, "stream_options": st.fixed_dictionaries({"include_usage": ANY}) | ANY,
          "ignore_eos": st.booleans() | ANY,
          "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])
                                                    | ANY}, optional={"json_schema": st.fixed_dictionaries(
                                                        {"schema": SCHEMA}) | ANY}) | ANY,
          "structured_outputs": st.fixed_dictionaries({}, optional={
              "json": SCHEMA, "regex": st.sampled_from(["[a-z]{1,3}", "(", "a*"]) | ANY,
              "choice": st.lists(st.text(max_size=3), max_size=3) | ANY, "grammar": st.text(max_size=20) | ANY,
              "json_object": ANY}) | ANY,
          "presence_penalty": ANY, "logit_bias": ANY, "echo": ANY, "best_of": ANY, "user": ANY, "x_unknown": ANY}
CHAT = {**OPENAI, "messages": st.lists(openai_message(), max_size=4) | ANY, "max_completion_tokens": LENGTH,
        "tools": st.lists(TOOL, max_size=2) | ANY, "parallel_tool_calls": ANY,
        "tool_choice": st.sampled_from(["auto", "none", "required", "x"])
        | st.fixed_dictionaries({"type": st.just("function") | ANY, "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g"]) | ANY}) | ANY}) | ANY,
        "chat_template_kwargs": st.dictionaries(st.sampled_from(["thinking", "messages", "x y", "enable_thinking"]),
                                                ANY, max_size=2) | ANY}
COMPLETION = {**OPENAI, "prompt": TEXT | st.lists(st.integers(-5, 60_000), max_size=6) | ANY,
              "tools": ANY, "suffix": ANY}
MESSAGES = {**{k: SAMPLING[k] for k in ("temperature", "top_p", "top_k", "timeout_s")},
            "model": st.just(MODEL) | ANY, "max_tokens": LENGTH,
            "messages": st.lists(anthropic_message(), max_size=4) | ANY,
            "system": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text") | ANY, "text": TEXT | ANY}),
                                      max_size=2) | ANY,
            "stop_sequences": st.lists(st.text(max_size=4), max_size=3) | ANY, "stream": st.booleans() | ANY,
            "tools": st.lists(ATOOL, max_size=2) | ANY,
            "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"]) | ANY},
                                                 optional={"name": ANY, "disable_parallel_tool_use": ANY}) | ANY,
            "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"]) | ANY},
                                              optional={"budget_tokens": ANY}) | ANY,
            "metadata": ANY, "x_unknown": ANY}
#: a valid body per route, which the drawn fields replace, add to or delete from
BASE = {"/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}}
FIELDS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/v1/messages": MESSAGES,
          "/v1/messages/count_tokens": MESSAGES}
#: fields that must stay bounded where they would make a valid body generate long (never deleted from chat: the
#: default is up to the context limit)
KEEP = ("max_tokens", "max_completion_tokens")


@st.composite
def bodies(draw, route: str):
    fields = FIELDS[route]
    body = dict(BASE[route])
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        if key not in KEEP and key in body and draw(st.integers(0, 5)) == 0:
            del body[key]
        else:
            body[key] = draw(fields[key])
    if route != "/v1/chat/completions" or "max_completion_tokens" not in body:
        return body
    if not (isinstance(body["max_completion_tokens"], int) and body["max_completion_tokens"] <= 4):
        body["max_tokens"] = 2  # an invalid max_completion_tokens is refused before max_tokens is read
    return body


# -- one request ------------------------------------------------------------------------------------------
def send(url: str, method: str, path: str, data: bytes | None, headers: dict | None = None) -> tuple[int, bytes]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=data, headers=AUTH if headers is None else headers)
        r = conn.getresponse()
        return r.status, r.read()  # a stream is read to its end: a hung one times out here
    except (TimeoutError, OSError) as exc:
        raise AssertionError(f"{method} {path}: no answer within {TIMEOUT_S:g} s ({exc!r}): {data[:300]!r}") from None
    finally:
        conn.close()


def root(param: str) -> str:
    return re.split(r"[.\[]", param, maxsplit=1)[0]


def check_error(path: str, status: int, raw: bytes, sent) -> None:
    body = json.loads(raw)
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        msg = body["error"]["message"]
        assert isinstance(msg, str) and msg, body
        if status == 400 and isinstance(sent, dict):  # the field, or the body as a whole
            assert any(re.search(rf"\b{re.escape(k)}\b", msg) for k in [*FIELDS[path], "body"]), body
        return
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), body
    if status == 400 and isinstance(sent, dict) and err["code"] != "invalid_json":
        assert isinstance(err["param"], str) and root(err["param"]) in FIELDS[path], body  # the field it names


def check_reply(path: str, raw: bytes, sent: dict) -> None:
    stream = sent.get("stream") is True
    if path == "/v1/messages/count_tokens":
        assert isinstance(json.loads(raw)["input_tokens"], int)
    elif stream and path == "/v1/messages":
        events = [line[7:] for line in raw.decode().splitlines() if line.startswith("event: ")]
        assert events[0] == "message_start" and events[-1] == "message_stop", events
    elif stream:
        lines = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            assert "choices" in chunk and "error" not in chunk, chunk
    else:
        reply = json.loads(raw)
        assert reply["content" if path == "/v1/messages" else "choices"] is not None, reply


def post(server, path: str, sent, data: bytes | None = None) -> None:
    url, engine = server
    status, raw = send(url, "POST", path, json.dumps(sent).encode() if data is None else data)
    assert status < 500, (status, raw[:500], sent)
    assert engine.alive, f"the engine loop died on {sent!r}: {engine.dead!r}"
    assert status in (200, 400, 404, 413, 429), (status, raw[:500], sent)
    if status == 200:
        check_reply(path, raw, sent)
    else:
        check_error(path, status, raw, sent)


def settle(engine, timeout: float = 30.0) -> None:
    """Every request ended (aborted choices reach the loop a turn later), no KV block held."""
    deadline = time.monotonic() + timeout
    while (engine.num_unfinished or engine.engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.num_unfinished == 0 and not engine.engine.has_unfinished()
    assert not engine.engine.kv_manager.reqs and engine.engine.kv_manager.usage() == 0.0


# -- the properties ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", list(BASE))
def test_fuzzed_bodies_get_an_answer_never_a_500(server, path):
    @FUZZ
    @given(body=bodies(path))
    @example(body={**BASE[path], "temperature": float("nan")})
    @example(body={**BASE[path], "top_p": float("nan")})
    @example(body={**BASE[path], "seed": 2 ** 64} if "/messages" not in path else {**BASE[path], "top_k": 2 ** 64})
    @example(body={**BASE[path], "timeout_s": float("nan")})
    @example(body={**BASE[path], "temperature": 5e-324})  # (logits / it overflowed: NaN probabilities killed the loop)
    @example(body={**BASE[path], "n": 2, "seed": 2 ** 64 - 1} if "/messages" not in path else BASE[path])
    @example(body={**BASE[path], "model": MODEL, "max_tokens": 1, "timeout_s": 1e-300})
    def run(body):
        post(server, path, body)

    run()
    settle(server[1])


@pytest.mark.parametrize("path", list(BASE))
def test_raw_bytes_and_deep_nesting_are_4xx(server, path):
    @FUZZ
    @given(data=st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
    @example(data=b"[" * 50_000)  # json.loads recurses: past the interpreter's limit
    @example(data=b'{"model": ' + b"[" * 20_000 + b"]" * 20_000 + b"}")
    @example(data=b'{"model": "x", "max_tokens": 1e400}')
    @example(data=b"\xff\xfe\x00")
    @example(data=b"")
    def run(data):
        try:
            sent = json.loads(data)
        except (ValueError, RecursionError):
            sent = None
        post(server, path, sent, data)

    run()
    settle(server[1])


def test_get_routes_and_wrong_methods_answer(server):
    url, engine = server
    for method, path, want in (("GET", "/v1/models", 200), ("GET", "/health", 200), ("GET", "/version", 200),
                               ("GET", "/metrics", 200), ("GET", "/v1/completions", 405), ("PUT", "/v1/messages", 405),
                               ("DELETE", "/health", 405), ("POST", "/v1/models", 405), ("GET", "/v1/nothing", 404)):
        status, raw = send(url, method, path, None)
        assert status == want, (method, path, status, raw[:200])
    for headers in ({"Content-Type": "application/json"}, {**AUTH, "Content-Length": "99999999999999999999"},
                    {**AUTH, "Content-Type": "text/plain"}, {"x-api-key": "\u00e9".encode().decode("latin-1")}):
        status, raw = send(url, "POST", "/v1/messages", b"{}", headers)
        assert status < 500, (headers, status, raw[:200])
    assert engine.alive
