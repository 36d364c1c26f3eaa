"""SIGTERM drains ``inferhal serve``. The policy (core/server/drain.py), on a stand-in engine: admission
stops at once; the server stops when nothing is open, or at the deadline after aborting what is. Then in a
process of its own (SmolLM2-135M-Instruct): under load no admitted request is lost (each stream runs to its end), new requests get 503 ``shutting_down`` and ``/health`` 503
``draining`` meanwhile, and the process exits 0; with ``server.shutdown_timeout_s=0`` the open streams are
aborted at once and the process exits within 4 s of the signal (vLLM's shutdown test allows 4.1 s)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import pytest

from serve_process import ServeProcess
from server_fixtures import MODEL



class Open:
    """An AsyncEngine stand-in: ``open`` requests until aborted."""

    def __init__(self, open_: int) -> None:
        self.num_unfinished, self.draining, self.aborted = open_, False, 0

    def drain(self):
        self.draining = True

    def abort_all(self):
        self.aborted, self.num_unfinished = self.num_unfinished, 0


def test_the_drain_waits_for_open_requests_until_its_deadline_then_aborts_them():
    import uvicorn

    from inferhal.core.server.drain import DrainingServer

    eng = Open(2)
    server = DrainingServer(uvicorn.Config(app=None), eng, shutdown_timeout_s=0.3)
    server.start_drain()
    assert eng.draining and not server.should_exit  # requests open, deadline ahead: wait
    server._check()
    assert not server.should_exit and eng.aborted == 0
    time.sleep(0.35)
    server._check()
    assert server.should_exit and eng.aborted == 2  # past the deadline: the rest aborted
    done = Open(1)
    server = DrainingServer(uvicorn.Config(app=None), done, shutdown_timeout_s=60)
    server.start_drain()
    done.num_unfinished = 0  # its last request finished
    server._check()
    assert server.should_exit and done.aborted == 0
    at_once = Open(3)
    server = DrainingServer(uvicorn.Config(app=None), at_once, shutdown_timeout_s=0)
    server.start_drain()
    assert server.should_exit and at_once.aborted == 3


def serve(timeout_s: float) -> tuple[ServeProcess, int]:
    p = ServeProcess([f"model={MODEL}", "server.port=0", "model.max_model_len=512",
                      f"server.shutdown_timeout_s={timeout_s}"], "[serve]", {**os.environ, "INFERHAL_API_KEY": ""})
    return p, p.port_after("http://")


class Stream(threading.Thread):
    """One streaming completion read to its end: ``started`` once its first event came; ``reasons``,
    ``tokens`` (from include_usage) and ``done`` ([DONE] seen) after."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.started = threading.Event()
        self.reasons, self.tokens, self.done, self.error = [], None, False, None

    def run(self) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            body = {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": self.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200, r.read()
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                self.started.set()
                if line == "data: [DONE]":
                    self.done = True
                    break
                chunk = json.loads(line[6:])
                self.reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
                if chunk.get("usage"):
                    self.tokens = chunk["usage"]["completion_tokens"]
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.started.set()


def get(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, json.dumps(body).encode() if body else None, {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read() or b"{}")


def start(port: int, n: int, max_tokens: int) -> list[Stream]:
    streams = [Stream(port, max_tokens) for _ in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120) and s.error is None, s.error
    return streams


@pytest.mark.slow
def test_a_drain_under_load_loses_no_admitted_request():
    p, port = serve(60)
    try:
        streams = start(port, 4, 32)
        p.p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while get(port, "GET", "/health")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get(port, "GET", "/health") == (503, {"status": "draining"})
        status, err = get(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert status == 503 and err["error"]["code"] == "shutting_down"
        for s in streams:
            s.join(120)
            assert s.error is None and s.done and s.reasons == ["length"] and s.tokens == 32
        assert p.p.wait(60) == 0
    finally:
        p.stop()


@pytest.mark.slow
def test_shutdown_timeout_0_aborts_at_once_and_exits_within_4_s():
    p, port = serve(0)
    try:
        streams = start(port, 2, 400)
        t0 = time.monotonic()
        p.p.send_signal(signal.SIGTERM)
        assert p.p.wait(10) == 0
        took = time.monotonic() - t0
        for s in streams:
            s.join(10)
            assert s.error is None and s.done and s.reasons == ["abort"] and s.tokens < 400
        assert took < 4.0, f"exited {took:.2f} s after SIGTERM"
    finally:
        p.stop()
