"""The engine loop's death and the process's end: a step that raises makes /health answer 503 and
requests 503 (the server process stays up), and SIGTERM lets an in-flight stream finish, then exits 0."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from server_fixtures import run_server
from test_bad_input import call

pytest.importorskip("fastapi")


class _Tok:
    eos_token_ids = (0,)

    def encode(self, text, add_bos=True):
        return [1, 2, 3]

    def decode(self, ids, skip_special_tokens=False):
        return "x" * len(ids)


class _BrokenEngine:
    """Accepts requests; its first step raises (a device error, a bug)."""

    tokenizer = _Tok()
    max_model_len = 64

    class model:
        vocab_size = 10

    def __init__(self):
        self.n = 0

    def make_request(self, prompt, params, request_id=None):
        return request_id

    def add(self, req):
        self.n += 1

    def has_unfinished(self):
        return self.n > 0

    def step(self):
        raise RuntimeError("device fell over")

    def abort(self, ids):
        return []


def test_a_dead_engine_loop_makes_health_503():
    from inferhal.core.server.app import ServerSettings, build_app
    from inferhal.core.server.async_engine import AsyncEngine
    from inferhal.core.server.serve import with_lifespan

    engine = AsyncEngine(_BrokenEngine())
    app = with_lifespan(build_app(engine, ServerSettings(model_name="m")), engine)
    with run_server(app) as url:
        assert call(url, "GET", "/health", headers={})[0] == 200
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
        status, err = call(url, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert status == 503 and err["error"]["code"] == "engine_dead"
        status, h = call(url, "GET", "/health", headers={})
        assert status == 503 and "device fell over" in h["reason"]
        status, err = call(url, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert status == 503 and err["error"]["type"] == "service_unavailable"


@pytest.mark.slow
def test_sigterm_finishes_the_in_flight_stream_and_exits_0(llm):
    proc = subprocess.Popen([sys.executable, "-m", "inferhal.core.cli.main", "serve", "model=smollm2_135m_instruct",
                             "server.port=0", "model.max_model_len=256", "server.shutdown_timeout_s=60"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "INFERHAL_API_KEY": ""})
    try:
        port = None
        for line in proc.stderr:
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "the server did not announce its port"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": "smollm2_135m_instruct", "prompt": "Count: 1, 2,", "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.read(6) == b"data: "  # running
        proc.send_signal(signal.SIGTERM)
        rest = r.read().decode()  # the stream runs to its end after SIGTERM
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in rest
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
