"""Admission control and deadlines on the real server (SmolLM2-135M-Instruct): a flood beyond
``server.max_queued_requests`` or ``server.max_queued_tokens`` gets 429s (OpenAI's error, code
``queue_full``, with ``Retry-After``) while every admitted request finishes whole; a request's ``timeout_s``
ends it with finish reason ``timeout`` and frees its KV."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from server_fixtures import API_KEY, MAX_QUEUED, MAX_QUEUED_TOKENS, MODEL
from test_bad_input import AUTH, call

openai = pytest.importorskip("openai")

TOKENS = 12


async def _flood(url: str, prompts: list[str]) -> list:
    """Every prompt at once through the official client (no retries): its Completions and RateLimitErrors."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    try:
        return await asyncio.gather(*(client.completions.create(
            model=MODEL, prompt=p, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
            for p in prompts), return_exceptions=True)
    finally:
        await client.close()


def _check(rs: list, bound: str) -> tuple[int, int]:
    ok = [r for r in rs if not isinstance(r, BaseException)]
    full = [r for r in rs if isinstance(r, openai.RateLimitError)]
    assert len(ok) + len(full) == len(rs), [r for r in rs if isinstance(r, BaseException) and r not in full]
    for r in ok:  # every admitted request finished whole
        assert r.usage.completion_tokens == TOKENS and r.choices[0].finish_reason == "length"
    for r in full:
        assert r.status_code == 429 and r.body["code"] == "queue_full" and r.body["type"] == "rate_limit_error"
        assert r.response.headers["retry-after"] == "1"
    assert any(bound in r.body["message"] for r in full), "the bound named"
    return len(ok), len(full)


def _idle(engine) -> None:
    deadline = time.monotonic() + 20
    while (engine.num_unfinished or engine.engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_unfinished == 0 and engine.queued_tokens == 0 and engine.engine.kv_manager.usage() == 0.0


def test_a_flood_beyond_max_queued_requests_gets_429s_while_admitted_requests_finish(server):
    url, engine = server
    ok, full = _check(asyncio.run(_flood(url, [f"Fact {i}: the sky" for i in range(3 * MAX_QUEUED)])),
                      "server.max_queued_requests=8")
    assert ok >= MAX_QUEUED and full >= 1
    _idle(engine)


def test_a_flood_beyond_max_queued_tokens_gets_429s_while_admitted_requests_finish(server):
    url, engine = server
    long = " ".join(f"word{i}" for i in range(130))  # ~400 tokens: at most 2 wait for their first token at once
    ok, full = _check(asyncio.run(_flood(url, [f"{i} {long}" for i in range(6)])),
                      f"server.max_queued_tokens={MAX_QUEUED_TOKENS}")
    assert ok >= 2 and full >= 1
    _idle(engine)


def test_a_request_deadline_ends_it_with_timeout_and_frees_its_kv(server):
    url, engine = server
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "timeout_s": 1.0}
    t0 = time.monotonic()
    status, r = call(url, "POST", "/v1/completions", json.dumps(body).encode(), AUTH)
    assert status == 200 and r["choices"][0]["finish_reason"] == "timeout", r
    assert 0 < r["usage"]["completion_tokens"] < 400 and time.monotonic() - t0 < 30
    _idle(engine)
    _, m = call(url, "GET", "/metrics", headers={})
    assert 'inferhal_request_success_total{finished_reason="timeout",model_name="smollm2_135m_instruct"} 1.0' in m
    status, err = call(url, "POST", "/v1/completions", json.dumps({**body, "timeout_s": 0}).encode(), AUTH)
    assert status == 400 and err["error"]["param"] == "timeout_s"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_deadline(server, stream):
    url, _ = server
    body = {"model": MODEL, "max_tokens": 400, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "timeout_s": 0.5, "stream": stream}
    status, r = call(url, "POST", "/v1/messages", json.dumps(body).encode(), AUTH)
    assert status == 200
    if stream:
        assert '"stop_reason": "timeout"' in r and r.rstrip().endswith('data: {"type": "message_stop"}')
    else:
        assert r["stop_reason"] == "timeout" and r["usage"]["output_tokens"] < 400
