"""Requests through the server share the engine's features: the prefix cache serves a repeated prompt
(``inferhal_prefix_cache_hits_total`` grows) and, on a server with ``spec=ngram``, drafts are verified and
accepted (``inferhal_spec_decode_*``) while the greedy text stays that of the plain server."""

from __future__ import annotations

import json

import pytest

from server_fixtures import MODEL, run_server
from test_bad_input import AUTH, call

LONG = "The lighthouse keeper wrote in his log every evening. " * 8


def _metric(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def _complete(url, prompt, headers=AUTH, max_tokens=8):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, r = call(url, "POST", "/v1/completions", json.dumps(body).encode(), headers)
    assert status == 200, r
    return r["choices"][0]["text"]


def test_a_repeated_prompt_hits_the_prefix_cache(server):
    url, _ = server
    before = _metric(call(url, "GET", "/metrics", headers={})[1], "inferhal_prefix_cache_hits_total")
    first = _complete(url, LONG)
    assert _complete(url, LONG) == first
    after = _metric(call(url, "GET", "/metrics", headers={})[1], "inferhal_prefix_cache_hits_total")
    assert after - before >= 64  # the second request found its prompt's full blocks cached


@pytest.mark.slow
def test_spec_decoding_applies_to_served_requests(server, llm):
    from inferhal.core.cli.main import compose
    from inferhal.core.engine.llm import LLM
    from inferhal.core.server.serve import make_app

    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,"
    want = _complete(server[0], prompt, max_tokens=16)
    cfg = compose([f"model={MODEL}", "spec=ngram", "spec.num_speculative_tokens=3", "spec.disable_by_batch_size=0"],
                  command="serve")
    drafting = LLM(loaded_model=llm.engine.loaded, active_backend=llm.engine.backend,  # the session's weights
                   overrides=["spec=ngram", "spec.num_speculative_tokens=3", "spec.disable_by_batch_size=0"])
    app, _ = make_app(drafting, cfg)
    with run_server(app) as url:
        headers = {"Content-Type": "application/json"}
        assert _complete(url, prompt, headers, max_tokens=16) == want
        m = call(url, "GET", "/metrics", headers={})[1]
    assert _metric(m, "inferhal_spec_decode_num_draft_tokens_total") > 0
    assert _metric(m, "inferhal_spec_decode_num_accepted_tokens_total") > 0
