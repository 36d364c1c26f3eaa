"""Bad input gets a 4xx in OpenAI's error schema (``{"error": {message, type, param, code}}``) and the
server keeps serving: after each bad request a good one still answers. Also: the API key, the body and
queue limits, a disconnecting client (its request is aborted and its KV freed), /health, /version and
/metrics."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

import pytest

from server_fixtures import API_KEY, MAX_QUEUED, MAX_QUEUED_TOKENS, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def call(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers if headers is not None else AUTH)
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data.decode()


def chat(url: str, **fields):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}
    return call(url, "POST", "/v1/chat/completions", json.dumps(body).encode())


BAD = {
    "malformed JSON": (lambda url: call(url, "POST", "/v1/chat/completions", b'{"model": "x", "messages": ['),
                       400, "invalid_json", None),
    "missing messages": (lambda url: call(url, "POST", "/v1/chat/completions",
                                          json.dumps({"model": MODEL}).encode()), 400, None, "messages"),
    "wrong role": (lambda url: chat(url, messages=[{"role": "wizard", "content": "hi"}]), 400, None,
                   "messages[0].role"),
    "negative max_tokens": (lambda url: chat(url, max_tokens=-3), 400, None, "max_tokens"),
    "prompt longer than the context": (lambda url: chat(url, messages=[{"role": "user", "content": "word " * 700}]),
                                       400, "context_length_exceeded", "messages"),
    "bad key": (lambda url: call(url, "POST", "/v1/chat/completions", b"{}",
                                 {"Authorization": "Bearer wrong", "Content-Type": "application/json"}),
                401, "invalid_api_key", None),
    "no key": (lambda url: call(url, "GET", "/v1/models", headers={}), 401, "invalid_api_key", None),
    "unknown model": (lambda url: chat(url, model="gpt-4o"), 404, "model_not_found", "model"),
    "huge body": (lambda url: call(url, "POST", "/v1/chat/completions", b"x" * 70_000), 413, "request_too_large", None),
    "more choices than the queue holds": (lambda url: chat(url, n=MAX_QUEUED + 1, max_tokens=50), 400, None, "n"),
    "choices' prompt tokens more than the queue holds": (lambda url: chat(url, n=MAX_QUEUED, messages=[
        {"role": "user", "content": "word " * (MAX_QUEUED_TOKENS // MAX_QUEUED + 10)}]), 400, None, "n"),
    "top_logprobs > 20": (lambda url: chat(url, logprobs=True, top_logprobs=21), 400, None, "top_logprobs"),
    "unsupported field": (lambda url: chat(url, presence_penalty=0.5), 400, None, "presence_penalty"),
    "unknown route": (lambda url: call(url, "GET", "/v2/nothing"), 404, None, None),
    "include_usage not a boolean": (lambda url: chat(url, stream=True, stream_options={"include_usage": "x"}), 400,
                                    None, "stream_options"),
    "tool schema that does not compile": (lambda url: chat(url, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "bogus"}}}]), 400, None, "tools[0].function.parameters"),
    "tool_choice naming a function not in tools": (lambda url: chat(url, tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "g"}}), 400, None, "tool_choice"),
    "tool message without a matching call": (lambda url: chat(url, messages=CHAT + [
        {"role": "tool", "tool_call_id": "call_9", "content": "21C"}]), 400, None, "messages[1].tool_call_id"),
    "tool call arguments not an object": (lambda url: chat(url, messages=CHAT + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]), 400, None,
        "messages[1].tool_calls[0].function.arguments"),
    "tools on completions": (lambda url: call(url, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "x", "tools": [TOOL]}).encode()), 400, None, "tools"),
    "response_format with a forced tool": (lambda url: chat(url, tools=[TOOL], tool_choice="required",
                                                            response_format={"type": "json_object"}), 400, None,
                                           "tool_choice"),
    "chat_template_kwargs setting messages": (lambda url: chat(url, chat_template_kwargs={"messages": []}), 400, None,
                                              "chat_template_kwargs"),
    "float token ids": (lambda url: call(url, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": [1.5, 2], "max_tokens": 2}).encode()), 400, None, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_4xx_in_openai_schema_and_the_server_keeps_serving(server, case):
    url, engine = server
    send, status, code, param = BAD[case]
    got, body = send(url)
    assert got == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    if case == "float token ids":
        assert "one list of integer token ids (one prompt per request); got [1.5, 2]" in err["message"]
    ok, good = chat(url)
    assert ok == 200 and good["choices"][0]["message"]["content"] is not None
    deadline = time.monotonic() + 10
    while engine.num_unfinished and time.monotonic() < deadline:  # e.g. the queue-full request's aborted choices
        time.sleep(0.05)
    assert engine.num_unfinished == 0


def test_a_disconnecting_client_aborts_and_frees_its_kv(server):
    url, engine = server
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=AUTH)
    r = conn.getresponse()
    assert r.status == 200
    first = r.read(6)  # the first event: the request is running
    assert first == b"data: "
    assert engine.engine.kv_manager.usage() > 0
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 20
    while (engine.num_unfinished or engine.engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_unfinished == 0 and not engine.engine.has_unfinished()
    assert engine.engine.kv_manager.usage() == 0.0  # every block free again (prefix-cached ones are free too)
    _, m = call(url, "GET", "/metrics", headers={})
    assert 'inferhal_request_success_total{finished_reason="abort",model_name="smollm2_135m_instruct"}' in m


def test_health_version_metrics(server):
    url, _ = server
    assert call(url, "GET", "/health", headers={}) == (200, {"status": "ok"})
    status, v = call(url, "GET", "/version", headers={})
    assert status == 200 and v["version"]
    status, text = call(url, "GET", "/metrics", headers={})
    assert status == 200
    for name in ("inferhal_time_to_first_token_seconds_bucket", "inferhal_inter_token_latency_seconds_bucket",
                 "inferhal_time_per_output_token_seconds_bucket", "inferhal_e2e_request_latency_seconds_bucket",
                 "inferhal_num_requests_running", "inferhal_num_requests_waiting", "inferhal_kv_cache_usage_ratio",
                 "inferhal_prefix_cache_hit_rate", "inferhal_prompt_tokens_total", "inferhal_generation_tokens_total",
                 "inferhal_num_preemptions_total", "inferhal_spec_decode_num_draft_tokens_total",
                 "inferhal_spec_decode_num_accepted_tokens_total", "inferhal_request_success_total"):
        assert name in text, name


def test_a_client_leaving_a_non_stream_request_aborts_it(server):
    url, engine = server
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=AUTH)
    deadline = time.monotonic() + 10
    while not engine.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.engine.has_unfinished()  # it runs
    conn.sock.close()  # the client goes away without reading the answer
    conn.close()
    deadline = time.monotonic() + 5  # far less than 400 tokens take (the server polls every 0.5 s)
    while engine.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.engine.has_unfinished() and engine.engine.kv_manager.usage() == 0.0
