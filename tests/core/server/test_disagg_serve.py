"""``inferhal serve parallel.role=pd``: this process serves HTTP and routes (no weights loaded), a spawned
prefill process prefills, a spawned decode process decodes (SmolLM2-135M, KV over gloo send/recv between
the two). The openai client gets the colocated server's greedy text. Each process is killed with SIGKILL
mid-stream: the requests it held are retried on the other one and every stream goes on to the same text,
with nothing repeated or lost; the survivor's KV pool holds no request afterwards; /health names the dead
role; with both dead (no restarts left), a request fails with 503 and /health answers 503. With restarts
(the default), a killed process is spawned again and takes requests again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from serve_process import ServeProcess
from server_fixtures import (API_KEY, FAILOVER_MAX_TOKENS, FAILOVER_PROMPTS, MODEL, OFFLINE_MAX_TOKENS,
                             OFFLINE_PROMPTS, run_server)

pytestmark = pytest.mark.slow


#: the two processes' group times out a receive after this long, and closes the link for good: the prefill
#: process's heartbeats (every TIMEOUT_S / 4 without a hand-off) keep an idle pair linked
TIMEOUT_S = 3


@contextlib.contextmanager
def pd(restarts: int = 0):
    from inferhal.core.cli.main import compose
    from inferhal.core.server.serve import make_router_app

    cfg = compose([f"model={MODEL}", f"server.api_key={API_KEY}", "parallel.role=pd", "model.max_model_len=512",
                   "cache.block_size=16", "cache.num_blocks=256", f"parallel.timeout_s={TIMEOUT_S}",
                   f"disagg.restarts={restarts}"], command="serve")
    app, engine = make_router_app(cfg)
    with run_server(app) as url:
        yield url, engine


@pytest.fixture(scope="module")
def pd_server(offline, offline_long):
    with pd() as got:
        yield got


def health(url) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def where(router) -> dict[str, str]:
    """request id -> where the router has it (read from the test thread: retried if the dict changes)."""
    for _ in range(100):
        try:
            return {rid: rec.at for rid, rec in list(router.requests.items())}
        except RuntimeError:
            time.sleep(0.001)
    raise AssertionError("could not read the router's requests")


def streamed(router, rid) -> int:
    rec = router.requests.get(rid)
    return len(rec.last.outputs[0].token_ids) if rec is not None and rec.last is not None else 0


def wait_for(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def no_leak(router, role: str) -> None:
    acc = router.probe(role)
    assert acc["kv_requests"] == [] and not acc["unfinished"] and acc["check"] is None, acc


def client_of(url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def streams(client, prompts, idx, got):
    def ask(i):
        parts = [ch.choices[0].text for ch in client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=FAILOVER_MAX_TOKENS, temperature=0, stream=True)
            if ch.choices]
        got[i] = "".join(parts)

    threads = [threading.Thread(target=ask, args=(i,)) for i in idx]
    for t in threads:
        t.start()
    return threads


def test_pd_server_streams_the_colocated_greedy_text(pd_server, offline):
    url, engine = pd_server
    client = client_of(url)
    for i, p in enumerate(OFFLINE_PROMPTS):
        if i == 1:
            time.sleep(1.5 * TIMEOUT_S)  # idle past the group's timeout: still linked
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=OFFLINE_MAX_TOKENS, temperature=0)
        assert r.choices[0].text == offline[p].outputs[0].text
        assert r.usage.completion_tokens == OFFLINE_MAX_TOKENS
        parts = [ch.choices[0].text for ch in client.completions.create(
            model=MODEL, prompt=p, max_tokens=OFFLINE_MAX_TOKENS, temperature=0, stream=True) if ch.choices]
        assert "".join(parts) == offline[p].outputs[0].text
    router = engine.engine
    assert router.failed == {} and not router.requests and router.retried == {}  # all decoded on the decode side
    assert router.insts["prefill"].process.pid != os.getpid() != router.insts["decode"].process.pid
    assert not hasattr(router, "loaded") and router.front.tokenizer is not None  # the router holds no weights
    assert health(url) == (200, {"status": "ok", "roles": {"prefill": "ok", "decode": "ok"}})
    no_leak(router, "prefill")
    no_leak(router, "decode")
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    n = 2 * len(OFFLINE_PROMPTS)  # the tokens and requests of both roles, counted once, in the router
    assert metric(text, "inferhal_generation_tokens_total") == n * OFFLINE_MAX_TOKENS
    assert metric(text, "inferhal_request_success_total", 'finished_reason="length"') == n
    assert metric(text, "inferhal_time_to_first_token_seconds_count") == n
    assert metric(text, "inferhal_num_requests_running") == 0 and metric(text, "inferhal_kv_cache_usage_ratio") == 0


def metric(text: str, name: str, label: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {label} in /metrics")


def test_a_client_that_goes_away_frees_its_blocks_on_both_sides(pd_server):
    url, engine = pd_server
    router = engine.engine
    stream = client_of(url).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    rid = wait_for(lambda: [r for r, at in where(router).items() if at == "decode" and streamed(router, r) >= 3],
                   "the request decoding on the decode process")[0]
    stream.close()
    wait_for(lambda: rid not in router.requests, "the router to abort the request", 30)
    for role in ("prefill", "decode"):
        wait_for(lambda: not router.probe(role)["kv_requests"], f"the {role} process to free the request's blocks", 30)
        no_leak(router, role)
    assert router.failed == {}


def test_a_killed_decode_process_loses_no_request(pd_server, offline_long):
    url, engine = pd_server
    router = engine.engine
    got: dict[int, str] = {}
    threads = streams(client_of(url), FAILOVER_PROMPTS, range(len(FAILOVER_PROMPTS)), got)
    wait_for(lambda: any(at != "prefill" for at in where(router).values()), "a request held by the decode side")
    os.kill(router.insts["decode"].process.pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(FAILOVER_PROMPTS))] == offline_long
    assert set(router.failed) == {"decode"} and "decode process" in router.failed["decode"]
    assert not router.requests and router.retried and set(router.retried.values()) == {"prefill"}
    no_leak(router, "prefill")
    status, body = health(url)
    assert status == 200 and body["status"] == "degraded" and body["roles"]["prefill"] == "ok"
    assert body["roles"]["decode"].startswith("dead: ")


def test_a_killed_prefill_process_loses_no_request(offline, offline_long):
    """Two requests decode on the decode process; the prefill process is stopped, a third request waits for
    it, and it is killed: the third is retried on the decode process, the two stream on from their KV."""
    prompts, want = FAILOVER_PROMPTS, offline_long
    with pd() as (url, engine):
        router = engine.engine
        client = client_of(url)
        got: dict[int, str] = {}
        threads = streams(client, prompts, [0, 1], got)
        early = wait_for(lambda: (lambda w: sorted(w) if len(w) == 2 and all(
            at == "decode" and streamed(router, rid) >= 3 for rid, at in w.items()) else None)(where(router)),
            "two requests streaming from the decode process")
        pre = router.insts["prefill"].process
        os.kill(pre.pid, signal.SIGSTOP)
        threads += streams(client, prompts, [2], got)
        late = wait_for(lambda: [rid for rid, at in where(router).items() if rid not in early and at == "prefill"],
                        "the third request at the stopped prefill process")
        os.kill(pre.pid, signal.SIGKILL)
        wait_for(lambda: "prefill" in router.failed, "the router to notice the dead prefill process", 30)
        for t in threads:
            t.join(120)
        assert [got.get(i) for i in range(len(prompts))] == want
        assert set(router.failed) == {"prefill"} and not router.requests
        assert router.retried == {late[0]: "decode"}  # the two on the decode side went on from their KV
        no_leak(router, "decode")
        status, body = health(url)
        assert status == 200 and body["status"] == "degraded" and body["roles"]["decode"] == "ok"
        assert body["roles"]["prefill"].startswith("dead: the prefill process exited")
        # the decode process runs new requests by itself now
        p = OFFLINE_PROMPTS[0]
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=OFFLINE_MAX_TOKENS, temperature=0)
        assert r.choices[0].text == offline[p].outputs[0].text and router.insts["prefill"].dead
        no_leak(router, "decode")
        # both dead: a request fails with the OpenAI error schema, never hangs, and /health says so
        os.kill(router.insts["decode"].process.pid, signal.SIGKILL)
        openai = pytest.importorskip("openai")
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, temperature=0)
        assert err.value.status_code == 503 and "every engine instance is dead" in str(err.value)
        assert health(url)[0] == 503


def test_a_killed_process_is_spawned_again_and_decodes_again(offline):
    """disagg.restarts=1: the decode process is killed while idle; the router spawns it again, links it to the
    prefill process, and the next request is handed to it as before; a second death is final."""
    with pd(restarts=1) as (url, engine):
        router = engine.engine
        dec = router.insts["decode"]
        first = dec.process.pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: dec.restarts == 1 and dec.live and router.linked(("prefill", "decode")),
                 "the decode process to be spawned again and linked", 180)
        assert dec.process.pid != first and health(url) == (200, {"status": "ok", "roles": {"prefill": "ok",
                                                                                                "decode": "ok"}})
        p = OFFLINE_PROMPTS[0]
        r = client_of(url).completions.create(model=MODEL, prompt=p, max_tokens=OFFLINE_MAX_TOKENS, temperature=0)
        assert r.choices[0].text == offline[p].outputs[0].text
        assert router.placed[("prefill", "decode")] == 1 and router.retried == {}  # handed to the new process
        no_leak(router, "prefill")
        no_leak(router, "decode")
        os.kill(dec.process.pid, signal.SIGKILL)
        wait_for(lambda: dec.state == "dead", "the second death", 30)
        time.sleep(0.5)
        assert dec.state == "dead" and dec.restarts == 1  # no restart left
        assert health(url)[1]["roles"]["decode"].startswith("dead: ")


def test_separate_launches_from_the_cli_serve_the_colocated_text(offline):
    """The user's flow: a prefill and a decode instance launched by `inferhal serve parallel.role=...`, then a
    router launched the same way (no weights), the openai client against the router; SIGTERM stops the
    router cleanly and leaves the instances waiting for the next one."""
    env = dict(os.environ, INFERHAL_DISAGG_KEY="k-separate", OMP_NUM_THREADS="1")
    common = [f"model={MODEL}", "model.max_model_len=512", "cache.num_blocks=256"]
    procs = []
    try:
        for role in ("prefill", "decode"):
            procs.append(ServeProcess([*common, f"parallel.role={role}", "disagg.listen=127.0.0.1:0"],
                                "waiting for a router on", env))
        pre, dec = (f"127.0.0.1:{p.port_after('waiting for a router on ')}" for p in procs)
        router = ServeProcess(["parallel.role=router", "server.port=0", f"server.api_key={API_KEY}",
                         f"disagg.prefill=[{pre}]", f"disagg.decode=[{dec}]"], "(OpenAI and Anthropic APIs", env)
        procs.append(router)
        assert f"[serve] {MODEL} on http://127.0.0.1:" in router.ready
        url = f"http://127.0.0.1:{router.port_after('http://127.0.0.1')}"
        client = client_of(url)
        for p in OFFLINE_PROMPTS:
            r = client.completions.create(model=MODEL, prompt=p, max_tokens=OFFLINE_MAX_TOKENS, temperature=0)
            assert r.choices[0].text == offline[p].outputs[0].text
        assert health(url) == (200, {"status": "ok", "roles": {"prefill0": "ok", "decode0": "ok"}})
        router.p.send_signal(signal.SIGTERM)
        assert router.p.wait(60) == 0
        for inst in procs[:2]:  # each says so and waits for the next router
            wait_for(lambda: any("the router went away" in ln for ln in inst.lines), "the instance to notice", 30)
            assert inst.p.poll() is None
    finally:
        for p in procs:
            p.stop()
