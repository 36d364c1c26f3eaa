"""``inferhal serve parallel=dep2``: the OpenAI server in front of two DP attention x EP MoE rank processes
(gloo on 127.0.0.1), against the single-process server, on the tiny random DeepSeek-V4 made servable
(tiny_text.py: its HF checkpoint with a character-level tokenizer and a chat template), n-gram drafts on.

The official ``openai`` client gets the single process's greedy text from every route, streamed and not,
under a JSON schema too, with requests running on both ranks at once; ``/health`` lists the ranks, ``/metrics``
carries each rank's series and the balance figure; a second turn of a conversation lands on the rank holding
its first turn's KV, and two sessions with session keys stay on their ranks where prefix placement would move
them; a bad session key is a 400 naming it; a client that hangs up mid-stream leaves no KV held on any rank. ``parallel=dep4`` gives the
same text, and so does ``eplb=default`` rebalancing every 10 steps, with each rank's expert load per layer in
``/metrics``. ``inferhal serve parallel=dep2`` as a user runs it ends with every rank process on SIGTERM. A rank killed mid-stream (SIGKILL): ``/health`` answers 503 while the group restarts,
every stream ends with the single process's text (its requests placed again from their prompt and the tokens
sent), the new group holds no KV afterwards and serves again; with no restart left, ``/health`` and new
requests get 503. ``deterministic=true`` with MTP drafts: the tokens and logprobs of the single process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from server_fixtures import run_server
from tiny_text import overrides, write_tiny_text_model

sys.path.insert(0, str(Path(__file__).parents[2] / "fixtures"))  # serve_process.py
from serve_process import ServeProcess  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "deepseek_v4_tiny"
PROMPTS = ["The quick brown fox jumps over the lazy dog", "abcabcabcabcabcabcabc", "Hello, world! " * 6,
           "def f(x):\n    return x * 2\n" * 3, "0123456789" * 8, "Once upon a time"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("openai")
    return write_tiny_text_model(str(tmp_path_factory.mktemp("tiny_text")))


@contextlib.contextmanager
def serving(model_dir, *over, dp: bool, layout: str = "dep2"):
    """(base URL, AsyncEngine) of a server on this model: the DP group (``parallel=<layout>``) or one engine."""
    from inferhal.core.cli.main import compose
    from inferhal.core.server.serve import check_dp, make_app, make_dp_app

    if dp:
        cfg = compose([*overrides(model_dir), f"parallel={layout}", "parallel.master_port=0", *over], command="serve")
        check_dp(cfg)
        app, engine = make_dp_app(cfg)
    else:
        from inferhal.core.engine.llm import LLM

        cfg = compose([*overrides(model_dir), *over], command="serve")
        app, engine = make_app(LLM.from_config(cfg), cfg)
    with run_server(app) as url:
        yield url, engine


@pytest.fixture(scope="module")
def single(model_dir):
    with serving(model_dir, "spec=ngram", dp=False) as got:
        yield got


@pytest.fixture(scope="module")
def dep2(model_dir):
    with serving(model_dir, "spec=ngram", dp=True) as got:
        yield got


def client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def complete(url, prompt, stream=False, max_tokens=MAX_TOKENS, **kw):
    c = client(url)
    if not stream:
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                      **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def chat(url, content, stream=False, **kw):
    c = client(url)
    msgs = [{"role": "user", "content": content}]
    if not stream:
        return c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                         **kw).choices[0].message.content
    return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True, **kw) if ch.choices)


def get(url, path):
    try:
        with urllib.request.urlopen(url + path, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def series(text, name):
    """{labels: value} of one metric in Prometheus text."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def per_rank(text, name):
    return {int(re.search(r'dp_rank="(\d+)"', k).group(1)): v for k, v in series(text, name).items()}


def test_greedy_completions_equal_the_single_process_streamed_and_not(single, dep2):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: both ranks run requests in the same steps
        want = list(pool.map(lambda p: complete(single[0], p), PROMPTS))
        got = list(pool.map(lambda p: complete(dep2[0], p), PROMPTS))
        streamed = list(pool.map(lambda p: complete(dep2[0], p, stream=True), PROMPTS))
    assert got == want
    assert streamed == want
    assert all(len(t) > 0 for t, _ in want)
    _, text = get(dep2[0], "/metrics")
    attn = per_rank(text, "inferhal_dp_attention_tokens_total")
    assert set(attn) == {0, 1} and all(v > 0 for v in attn.values()), attn  # both ranks ran requests
    assert sum(per_rank(text, "inferhal_dp_prompt_tokens_total").values()) > 0
    assert sum(series(text, "inferhal_spec_decode_num_draft_tokens_total").values()) > 0  # n-gram drafts ran


def test_chat_and_json_schema_equal_the_single_process(single, dep2):
    for stream in (False, True):
        assert chat(dep2[0], "Say hi", stream=stream) == chat(single[0], "Say hi", stream=stream)
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    want = chat(single[0], "Give a", response_format=schema)
    assert chat(dep2[0], "Give a", response_format=schema) == want
    assert want.startswith("{")


def test_health_lists_the_ranks_and_metrics_carry_each_rank(dep2):
    complete(dep2[0], "Hi", max_tokens=2)  # a step: every rank reports
    status, body = get(dep2[0], "/health")
    assert status == 200 and json.loads(body) == {"status": "ok", "roles": {"dp0": "ok", "dp1": "ok"}}
    _, text = get(dep2[0], "/metrics")
    for name in ("inferhal_dp_requests_running", "inferhal_dp_requests_waiting", "inferhal_dp_kv_cache_usage_ratio",
                 "inferhal_dp_kv_blocks_in_use", "inferhal_dp_load_tokens", "inferhal_dp_prefix_cache_hits_total",
                 "inferhal_dp_generation_tokens_total"):
        assert set(per_rank(text, name)) == {0, 1}, name
    assert 'inferhal_dp_balance{figure="attention_tokens"' in text


def test_the_next_turn_of_a_conversation_lands_on_the_rank_holding_its_prefix(dep2):
    url, _ = dep2
    first = "You are a careful assistant. " * 5  # 145 characters: 9 full blocks of 16
    answer, _ = complete(url, first, max_tokens=8)
    _, text = get(url, "/metrics")
    hits0, placed0 = (per_rank(text, n) for n in ("inferhal_dp_prefix_cache_hits_total", "inferhal_dp_prefix_placed_total"))
    complete(url, first + answer + " And then?", max_tokens=8)
    _, text = get(url, "/metrics")
    hits1, placed1 = (per_rank(text, n) for n in ("inferhal_dp_prefix_cache_hits_total", "inferhal_dp_prefix_placed_total"))
    gained = {r: hits1[r] - hits0.get(r, 0) for r in hits1}
    assert max(gained.values()) >= 9 * 16, gained  # the first turn's blocks, found where it ran
    assert sum(placed1.values()) - sum(placed0.values()) == 1


def served_on(url, send):
    """``send()``'s result and the one rank whose finished prompt tokens grew while it ran (one request at a time)."""
    before = per_rank(get(url, "/metrics")[1], "inferhal_dp_prompt_tokens_total")
    got = send()
    after = per_rank(get(url, "/metrics")[1], "inferhal_dp_prompt_tokens_total")
    grew = [r for r in after if after[r] > before.get(r, 0.0)]
    assert len(grew) == 1, (before, after)
    return got, grew[0]


def test_session_keys_keep_two_sessions_on_their_ranks_where_prefix_placement_would_move_them(dep2):
    """Two sessions start on different ranks (the second arrives while the first runs); their next turns share no
    prefix with their first, and one of them starts with the other session's first prompt, cached on the other
    rank: prefix placement sends it there (the keyless control), its key keeps it home, through
    ``prompt_cache_key`` (named on chat, ``extra_body`` on completions) and the ``X-Session-Id`` header on
    Anthropic's route."""
    anthropic = pytest.importorskip("anthropic")
    url, _ = dep2
    tag = str(time.monotonic_ns())  # keys and prompts of their own (the module's server has served others)
    key = {s: f"session-{s}-{tag}" for s in "ab"}
    first = {"a": f"Alpha {tag}: the first session opens with this prompt. ",
             "b": f"Beta {tag}: the other one, shorter. "}
    c = client(url)
    stream = c.completions.create(model=MODEL, prompt=first["a"], max_tokens=60, temperature=0, stream=True,
                                  extra_body={"prompt_cache_key": key["a"], "ignore_eos": True})
    before = per_rank(get(url, "/metrics")[1], "inferhal_dp_prompt_tokens_total")
    next(iter(stream))  # "a" runs, holding its rank's load, while "b" is placed
    b1 = c.completions.create(model=MODEL, prompt=first["b"], max_tokens=8, temperature=0,
                              extra_body={"prompt_cache_key": key["b"]})
    for _ in stream:
        pass
    after = per_rank(get(url, "/metrics")[1], "inferhal_dp_prompt_tokens_total")
    grew = {r: after[r] - before.get(r, 0.0) for r in after}
    on_b = [r for r, v in grew.items() if v == b1.usage.prompt_tokens]
    assert len(on_b) == 1 and grew[1 - on_b[0]] > 0, grew  # one session on each rank
    home = {"b": on_b[0], "a": 1 - on_b[0]}
    assert home["b"] == 1  # the idle server's choice (the least loaded, then the lowest rank) is 0: "b" is away

    # "b"'s next turn starts with "a"'s first prompt: rank 0's prefix cache holds its leading blocks
    turn2 = first["a"] + f"Beta {tag} again, on another topic."
    by_key0 = per_rank(get(url, "/metrics")[1], "inferhal_dp_session_placed_total")
    _, keyless = served_on(url, lambda: complete(url, turn2, max_tokens=4))
    assert keyless == home["a"]  # the control: by prefix alone it leaves its session's rank
    _, on = served_on(url, lambda: complete(url, turn2, max_tokens=4, extra_body={"prompt_cache_key": key["b"]}))
    assert on == home["b"]
    msgs = [{"role": "user", "content": f"Beta {tag}, a new question."}]
    _, on = served_on(url, lambda: c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                                             prompt_cache_key=key["b"]))
    assert on == home["b"]
    _, on = served_on(url, lambda: complete(url, f"Alpha {tag} goes on.", max_tokens=4,
                                            extra_body={"prompt_cache_key": key["a"]}))
    assert on == home["a"]
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    turn3 = [{"role": "user", "content": first["a"] + "And a third turn for Beta."}]
    _, on = served_on(url, lambda: claude.messages.create(model=MODEL, max_tokens=4, messages=turn3,
                                                          extra_body={"temperature": 0},
                                                          extra_headers={"X-Session-Id": key["b"]}))
    assert on == home["b"]
    by_key = per_rank(get(url, "/metrics")[1], "inferhal_dp_session_placed_total")
    assert {r: by_key[r] - by_key0.get(r, 0.0) for r in by_key} == {home["b"]: 3.0, home["a"]: 1.0}  # keyed turns


def test_a_bad_session_key_is_a_400_naming_it_and_one_engine_accepts_a_good_one(single, dep2):
    import openai

    for url in (single[0], dep2[0]):
        with pytest.raises(openai.BadRequestError) as err:
            complete(url, "Hi", max_tokens=2, extra_body={"prompt_cache_key": "k" * 257})
        assert err.value.body["param"] == "prompt_cache_key" and "at most 256 characters" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            chat(url, "Hi", prompt_cache_key="")
        assert err.value.body["param"] == "prompt_cache_key"
        req = urllib.request.Request(url + "/v1/messages", data=json.dumps({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Hi"}]}).encode(), headers={"Content-Type": "application/json",
                                                                    "X-Session-Id": "s" * 300})
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=60)
        assert http.value.code == 400 and "X-Session-Id" in http.value.read().decode()
    assert chat(single[0], "Say hi", prompt_cache_key="conversation-7") == chat(single[0], "Say hi")
    assert complete(single[0], PROMPTS[0], extra_body={"prompt_cache_key": "k" * 256}) == complete(single[0], PROMPTS[0])


def test_eplb_rebalances_keep_the_text_and_metrics_carry_expert_load_per_rank_and_layer(model_dir, single):
    over = ("spec=ngram", "eplb=default", "eplb.window_size=8", "eplb.step_interval=10", "eplb.layers_per_step=0")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        want = list(pool.map(lambda p: complete(single[0], p), PROMPTS))
        with serving(model_dir, *over, dp=True) as (url, _):
            got = list(pool.map(lambda p: complete(url, p), PROMPTS))  # > 24 steps: rebalanced at 10 and 20
            _, text = get(url, "/metrics")
    assert got == want
    load = {(int(re.search(r'dp_rank="(\d+)"', k).group(1)), int(re.search(r'layer="(\d+)"', k).group(1))): v
            for k, v in series(text, "inferhal_dp_expert_load").items()}
    assert set(load) == {(r, layer) for r in range(2) for layer in range(5)}  # 4 MoE layers and the MTP layer's
    assert all(sum(v for (r, _), v in load.items() if r == rank) > 0 for rank in range(2))
    assert [v for k, v in series(text, "inferhal_dp_balance").items() if 'figure="expert_load"' in k][0] >= 1.0


def test_a_client_that_hangs_up_frees_its_kv_on_its_rank(dep2):
    url, _ = dep2
    stream = client(url).completions.create(model=MODEL, prompt="A long answer, please: ", max_tokens=300,
                                            temperature=0, stream=True)
    next(iter(stream))
    _, text = get(url, "/metrics")
    assert sum(per_rank(text, "inferhal_dp_kv_blocks_in_use").values()) > 0  # it runs, holding blocks
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, text = get(url, "/metrics")
        if set(per_rank(text, "inferhal_dp_kv_blocks_in_use").values()) == {0.0}:
            break
        time.sleep(0.1)
    assert per_rank(text, "inferhal_dp_kv_blocks_in_use") == {0: 0.0, 1: 0.0}
    assert per_rank(text, "inferhal_dp_requests_running") == {0: 0.0, 1: 0.0}


def test_dep4_gives_the_single_process_text(model_dir, single):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        want = list(pool.map(lambda p: complete(single[0], p), PROMPTS))
        with serving(model_dir, "spec=ngram", dp=True, layout="dep4") as (url, _):
            got = list(pool.map(lambda p: complete(url, p, stream=True), PROMPTS))
            _, text = get(url, "/metrics")
    assert got == want
    assert set(per_rank(text, "inferhal_dp_attention_tokens_total")) == {0, 1, 2, 3}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_cli_serves_dep2_and_its_end_ends_every_rank(model_dir, sig):
    """SIGTERM: the server stops its ranks and exits 0. SIGKILL (the parent dies with no chance to clean up): no rank
    outlives it (issue 52's "the parent dying while DP ranks run: no orphan"; the ranks end on their broken pipe
    to the server even without end_with_parent's watch, checked by taking that out)."""
    psutil = pytest.importorskip("psutil")
    sp = ServeProcess([*overrides(model_dir), "parallel=dep2", "parallel.master_port=0", "server.port=0"],
                      "/v1 (OpenAI", dict(os.environ), timeout_s=180)
    try:
        url = f"http://127.0.0.1:{sp.port_after('http://')}"
        tree = psutil.Process(sp.p.pid).children(recursive=True)
        assert len(tree) >= 2  # the two ranks (and multiprocessing's resource tracker)
        assert complete(url, "Hello")[0]
        assert json.loads(get(url, "/health")[1])["roles"] == {"dp0": "ok", "dp1": "ok"}
        sp.p.send_signal(sig)
        assert sp.p.wait(60) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        deadline = time.monotonic() + 15
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        sp.stop()


def streams_with_rank_1_killed(url, group, prompts, max_tokens, after=20):
    """Stream ``prompts`` at once from ``url`` (greedy, ``max_tokens`` each) while DP rank 1 of ``group`` is SIGKILLed
    once ``after`` tokens have been streamed: → (the texts and finish reasons, whether ``/health`` answered 503)."""
    seen_503 = []

    def kill_when_streaming():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(len(r.last.outputs[0].token_ids) if r.last else 0
                                                  for r in list(group.requests.values())) < after:
            time.sleep(0.01)
        os.kill(group.ranks[1].process.pid, signal.SIGKILL)
        while time.monotonic() < deadline:
            if get(url, "/health")[0] == 503:
                seen_503.append(True)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_streaming)
    killer.start()
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(url, p, max_tokens=max_tokens, stream=True), prompts))
    killer.join()
    return got, bool(seen_503)


def test_a_rank_killed_mid_stream_costs_no_stream_its_text_and_the_group_serves_again(model_dir, single):
    from inferhal.core.server.dp_serve import DPGroup

    prompts = PROMPTS[:4]
    with ThreadPoolExecutor(len(prompts)) as pool:
        want = list(pool.map(lambda p: complete(single[0], p, max_tokens=60), prompts))
    with serving(model_dir, "parallel.restarts=1", "parallel.timeout_s=10", dp=True) as (url, engine):
        group: DPGroup = engine.engine
        got, seen_503 = streams_with_rank_1_killed(url, group, prompts, 60)
        assert seen_503 and group.restarts == 1
        assert got == want  # every stream went on where it stopped, nothing repeated or lost
        assert get(url, "/health")[0] == 200
        assert complete(url, PROMPTS[4]) == complete(single[0], PROMPTS[4])  # the new group serves
        _, text = get(url, "/metrics")
        assert per_rank(text, "inferhal_dp_kv_blocks_in_use") == {0: 0.0, 1: 0.0}
        assert series(text, "inferhal_dp_restarts_total") == {'{model_name="deepseek_v4_tiny"}': 1.0}
        assert all(not group.probe(r)["kv_requests"] for r in range(2))  # nothing open: the loop does not step
        os.kill(group.ranks[0].process.pid, signal.SIGKILL)  # no restart left
        deadline = time.monotonic() + 30
        while get(url, "/health")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert get(url, "/health")[0] == 503
        import openai

        with pytest.raises(openai.APIStatusError) as err:
            complete(url, "anything")
        assert err.value.status_code == 503


def test_deterministic_mtp_gives_the_single_process_tokens_and_logprobs(model_dir):
    over = ("deterministic=true", "spec=mtp")

    def run(url):
        c = client(url)
        with ThreadPoolExecutor(3) as pool:
            rs = list(pool.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                                              logprobs=2), PROMPTS[:3]))
        return [(r.choices[0].text, r.choices[0].logprobs.token_logprobs) for r in rs]

    with serving(model_dir, *over, dp=False) as (url, _):
        want = run(url)
    with serving(model_dir, *over, dp=True) as (url, _):
        got = run(url)
        _, text = get(url, "/metrics")
    assert got == want
    assert sum(series(text, "inferhal_spec_decode_num_draft_tokens_total").values()) > 0


def test_aborting_a_request_placed_again_after_a_restart_lists_its_tokens_once():
    """DPGroup's bookkeeping alone (no rank processes): a request placed again from its prompt plus the tokens it
    streamed, then aborted, ends with each token once (the router's abort listed earlier tokens twice)."""
    from types import SimpleNamespace

    from inferhal.core.engine.outputs import CompletionOutput, RequestOutput
    from inferhal.core.sampling.params import SamplingParams
    from inferhal.core.server.dp_serve import DPGroup, _Rec

    def out(tokens, new):
        return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", list(tokens), None, [])],
                             new_token_ids=list(new))

    group = DPGroup.__new__(DPGroup)
    group.requests, group._resumed, group._adds, group._aborts, group._early = {}, {}, [], [], []
    group.state, group.busy, group.metrics, group.ranks = "live", False, None, [SimpleNamespace(gauges={})]
    group.requests["r"] = _Rec([1, 2, 3], SamplingParams(max_tokens=10), "key", last=out([10, 11], [11]))
    group._again("r")  # the new group gets it from its prompt and the two tokens streamed
    assert group._adds == [("r", [1, 2, 3, 10, 11], SamplingParams(max_tokens=8), "key")]
    group._exchange = lambda msg: [([out([12], [12])], {}, True, [])]
    assert [o.outputs[0].token_ids for o in group.step()] == [[10, 11, 12]]
    final, = group.abort(["r"])
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert final.outputs[0].token_ids == [10, 11, 12] and group._aborts == ["r"] and not group._resumed
