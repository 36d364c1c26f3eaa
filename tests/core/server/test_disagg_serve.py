"""``inferhal serve parallel.role=pd``: this process prefills and routes, a spawned process decodes
(SmolLM2-135M, KV over gloo send/recv). The openai client gets the colocated server's greedy text; when
the decode process is killed mid-stream, every request it held is prefilled again here and its stream
goes on to the same text, with nothing repeated or lost."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from server_fixtures import (API_KEY, FAILOVER_MAX_TOKENS, FAILOVER_PROMPTS, MODEL, OFFLINE_MAX_TOKENS,
                             OFFLINE_PROMPTS, run_server)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pd_server(llm):
    from inferhal.core.cli.main import compose
    from inferhal.core.engine.llm import LLM
    from inferhal.core.server.serve import make_app

    cfg = compose([f"model={MODEL}", f"server.api_key={API_KEY}", "parallel.role=pd", "model.max_model_len=512",
                   "cache.block_size=16", "cache.num_blocks=256"], command="serve")
    front = LLM.from_config(cfg, loaded_model=llm.engine.loaded, active_backend=llm.engine.backend)
    app, engine = make_app(front, cfg)
    with run_server(app) as url:
        yield url, engine


def test_pd_server_streams_the_colocated_greedy_text(pd_server, offline):
    openai = pytest.importorskip("openai")
    url, engine = pd_server
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    for p in OFFLINE_PROMPTS:
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=OFFLINE_MAX_TOKENS, temperature=0)
        assert r.choices[0].text == offline[p].outputs[0].text
        assert r.usage.completion_tokens == OFFLINE_MAX_TOKENS
        parts = [ch.choices[0].text for ch in client.completions.create(
            model=MODEL, prompt=p, max_tokens=OFFLINE_MAX_TOKENS, temperature=0, stream=True) if ch.choices]
        assert "".join(parts) == offline[p].outputs[0].text
    inner = engine.engine
    assert inner.failed_over is None and inner.process.is_alive()
    assert inner.prefill.kv_manager.reqs == {} and not inner._remote


def test_a_killed_decode_process_loses_no_request(pd_server, offline_long):
    openai = pytest.importorskip("openai")

    url, engine = pd_server
    inner = engine.engine
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    prompts, want = FAILOVER_PROMPTS, offline_long  # the colocated engine's texts, from before any server ran
    got: dict[int, str] = {}

    def ask(i):
        parts = [ch.choices[0].text for ch in client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=FAILOVER_MAX_TOKENS, temperature=0, stream=True)
            if ch.choices]
        got[i] = "".join(parts)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not inner._remote and time.monotonic() < deadline:  # wait for requests held by the decode side
        time.sleep(0.01)
    assert inner._remote, "no request reached the decode process"
    os.kill(inner.process.pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(len(prompts))] == want
    assert inner.failed_over and "decode process" in inner.failed_over  # exited, or a send to it failed
    assert inner.prefill.kv_manager.reqs == {} and not inner._remote
    inner.prefill.kv_manager.check()
