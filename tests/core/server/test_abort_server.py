"""Clients that go away at every point of a request's life, through the server: on a scripted engine, a
submit cancelled while its request is being added (a grammar compiling on the loop thread) and a request
whose checks raise an unexpected error; on the real server (SmolLM2-135M-Instruct), a client leaving during
a grammar's compile, during a long prefill, mid-stream with ``n`` > 1, every open stream at once (the
clients, and the server's own ``abort_all`` as the drain calls it), and the same body aborted and sent again.
After each: no request open, no KV block held, ``/health`` ok, and the next greedy request gives the offline
engine's text (SGLang's test_abort.py: abort-all, abort and resend, a leak check)."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from urllib.parse import urlparse

import pytest

from server_fixtures import API_KEY, MODEL, OFFLINE_MAX_TOKENS, OFFLINE_PROMPTS
from test_async_engine import Scripted, drain_queue, run

pytest.importorskip("fastapi")

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


# -- the loop thread, on a scripted engine ----------------------------------------------------------------
class SlowAdd(Scripted):
    """Adding a request takes ``delay`` seconds (a grammar compiling), or raises ``error``."""

    def __init__(self, delay: float = 0.0, error: Exception | None = None) -> None:
        super().__init__(n=1000)
        self.delay, self.error, self.added = delay, error, []

    def make_request(self, prompt, params, request_id=None):
        time.sleep(self.delay)
        if self.error is not None and params == "bad":
            raise self.error
        return request_id

    def add(self, rid):
        self.added.append(rid)
        super().add(rid)


def test_a_submit_cancelled_while_its_request_is_added_aborts_it():
    """The handler awaiting the add is cancelled (its task ends) while the loop thread still adds the request:
    the request must not run on unseen (it held KV and a batch slot until its max_tokens)."""
    eng = SlowAdd(delay=0.3)

    async def body(ae):
        eng.go.set()
        task = asyncio.create_task(ae.submit([1, 2, 3], None))
        await asyncio.sleep(0.1)  # the loop thread is in make_request
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 5
        while (eng.reqs or not eng.added) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return ae.alive, ae.num_unfinished, dict(eng.reqs), list(eng.aborted)  # (before stop() aborts the rest)

    alive, open_, running, aborted = run(body, eng)
    assert alive, "the engine loop died"
    assert open_ == 0 and eng.added and not running and aborted == eng.added


def test_a_request_whose_checks_raise_fails_alone_and_the_loop_goes_on():
    eng = SlowAdd(error=RuntimeError("a bug in a check"))

    async def body(ae):
        eng.go.set()
        with pytest.raises(RuntimeError, match="a bug in a check"):
            await ae.submit([1], "bad")
        _, q = await ae.submit([1], None)
        first = (await asyncio.wait_for(q.get(), 10)).token_ids
        return ae.alive, first

    alive, first = run(body, eng)
    assert alive and first == [7]


# -- the real server ------------------------------------------------------------------------------------------
def conn_of(url: str) -> http.client.HTTPConnection:
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=120)


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    c = conn_of(url)
    try:
        c.request("POST", path, json.dumps(body).encode(), AUTH)
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def open_stream(url: str, path: str, body: dict, read: int = 0):
    """A request sent on a connection left open for the caller to drop; ``read`` > 0: its answer's first
    ``read`` bytes read → (connection, response), else the connection."""
    c = conn_of(url)
    c.request("POST", path, json.dumps(body).encode(), AUTH)
    if not read:
        return c
    r = c.getresponse()
    assert r.status == 200
    assert r.read(read)
    return c, r


def drop(c: http.client.HTTPConnection) -> None:
    c.sock.close()
    c.close()


def settled(server, timeout: float = 30.0) -> None:
    """Nothing open in the server or its engine, no KV block held, /health ok, and the offline greedy text."""
    url, engine = server
    deadline = time.monotonic() + timeout
    while (engine.num_unfinished or engine.engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.02)
    eng = engine.engine
    assert engine.num_unfinished == 0 and not eng.has_unfinished() and engine.alive
    assert not eng.kv_manager.reqs and eng.kv_manager.usage() == 0.0


def gauges(url: str) -> dict:
    """The server's KV and running gauges, from /metrics."""
    c = conn_of(url)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    names = ("kv_requests", "kv_blocks_in_use", "num_requests_running")
    return {n: float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(f"inferhal_{n}{{")))
            for n in names}


def same_as_offline(server, offline) -> None:
    url, _ = server
    p = OFFLINE_PROMPTS[0]
    status, r = post(url, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": OFFLINE_MAX_TOKENS,
                                               "temperature": 0})
    assert status == 200 and r["choices"][0]["text"] == offline[p].outputs[0].text
    settled(server)


def test_a_client_leaving_during_a_grammar_compile(server, offline, monkeypatch):
    """The compile runs on the engine loop thread (made to take 1 s here); the client leaves meanwhile, before
    any answer: once the compile ends the request is aborted, streamed or not."""
    url, engine = server
    grammars = engine.engine.intake.grammars()
    compile_ = grammars.matcher
    compiling = threading.Event()

    def slow(constraint):
        compiling.set()
        time.sleep(1.0)
        return compile_(constraint)

    monkeypatch.setattr(grammars, "matcher", slow)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for stream in (True, False):
        compiling.clear()
        c = open_stream(url, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "A city?"}], "max_tokens": 400,
            "stream": stream, "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
        assert compiling.wait(30)
        drop(c)
        settled(server)
    monkeypatch.undo()
    same_as_offline(server, offline)


def test_a_client_leaving_during_a_long_prefill(server, offline):
    url, engine = server
    prompt = "Tell me a story about a lighthouse. " * 55  # ~440 tokens: one long prefill step
    c = open_stream(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 40, "stream": True})
    deadline = time.monotonic() + 30
    while not engine.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.engine.has_unfinished()
    drop(c)  # before the first token
    settled(server)
    same_as_offline(server, offline)


def test_every_stream_dropped_at_once_then_aborted_by_the_server(server, offline):
    url, engine = server
    body = {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True, "n": 2}
    conns = [open_stream(url, "/v1/completions", body, read=6) for _ in range(3)]  # 6 requests running
    assert len(engine.engine.scheduler.requests) == 6
    time.sleep(0.3)  # a loop turn or two: the gauges follow the engine
    assert gauges(url)["kv_requests"] == 6 and gauges(url)["kv_blocks_in_use"] > 0
    for c, _ in conns:
        drop(c)
    settled(server)
    deadline = time.monotonic() + 10
    while any(gauges(url).values()) and time.monotonic() < deadline:  # (written after the loop's next turn)
        time.sleep(0.05)
    assert gauges(url) == {"kv_requests": 0.0, "kv_blocks_in_use": 0.0, "num_requests_running": 0.0}
    # the server's own abort_all (what a drain past server.shutdown_timeout_s calls), with streams open
    conns = [open_stream(url, "/v1/completions", body, read=6) for _ in range(2)]
    engine._loop.call_soon_threadsafe(engine.abort_all)
    for c, r in conns:
        events = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]  # ends by itself
        reasons = [ch["finish_reason"] for e in events[:-1] for ch in json.loads(e[6:])["choices"]]
        assert events[-1] == "data: [DONE]" and [x for x in reasons if x] == ["abort", "abort"]
        c.close()
    settled(server)
    same_as_offline(server, offline)


def test_the_same_body_aborted_and_sent_again(server, offline):
    """A client that gives up and retries the same request at once, several times, then reads one to its end."""
    url, _ = server
    p = OFFLINE_PROMPTS[0]
    body = {"model": MODEL, "prompt": p, "max_tokens": OFFLINE_MAX_TOKENS, "temperature": 0, "stream": True}
    for i in range(5):
        c = open_stream(url, "/v1/completions", body, read=1 + 40 * i)  # at and past the first tokens
        drop(c[0])
    c = open_stream(url, "/v1/completions", body)
    r = c.getresponse()
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.read().decode().splitlines()
                   if line.startswith("data: {"))
    c.close()
    assert text == offline[p].outputs[0].text
    settled(server)
