"""``inferhal serve parallel=dep2 parallel.launcher=torchrun``: the front (this test process: the HTTP server, no
weights) listens on ``parallel.front``; the two ranks are started by two torchrun agents as two "hosts" on
127.0.0.1 (``--nnodes 2 --node-rank 0|1 --nproc-per-node 1``, static rendezvous, ``--max-restarts 1``) with
the same command line, and connect to it (core/server/dp_link.py). One group serves the whole module, on the
tiny random DeepSeek-V4 made servable (tiny_text.py).

Each agent is pinned to a core of its own (taskset), as a host would own its cores.

The official ``openai`` client gets the single process's greedy text, streamed and not, with both ranks
running requests; a rank that joins with a wrong ``WORLD_SIZE``, an out-of-range or taken ``RANK``, a config
that differs in what it computes, or another key is refused with a message naming it; a rank SIGKILLed under
load: ``/health`` 503 while torchrun restarts the group, every stream ends with the single process's text
(placed again from its prompt and the tokens sent), ``/health`` 200 and the new group serves with no KV held;
killed again with torchrun out of restarts, the front waits ``parallel.start_timeout_s`` and ends the open stream
with an error, ``/health`` and new requests 503, both torchrun agents exit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_fixtures import run_server
from test_dp_serve import MODEL, client, complete, get, per_rank, series, streams_with_rank_1_killed
from tiny_text import overrides, write_tiny_text_model

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox jumps over the lazy dog", "abcabcabcabcabcabcabc", "Hello, world! " * 6,
           "def f(x):\n    return x * 2\n" * 3]
MAX_TOKENS = 16
MAX_TOKENS_KILLED = 40  # the streams a rank dies under
KEY = "test-dp-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("openai")
    return write_tiny_text_model(str(tmp_path_factory.mktemp("tiny_text")))


@pytest.fixture(scope="module")
def single(model_dir):
    from inferhal.core.cli.main import compose
    from inferhal.core.engine.llm import LLM
    from inferhal.core.server.serve import make_app

    cfg = compose(overrides(model_dir), command="serve")
    app, _ = make_app(LLM.from_config(cfg), cfg)
    with run_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def front(model_dir, tmp_path_factory):
    """(base URL, DPGroup, the two torchrun agents, the rank command's overrides) of the torchrun-launched group."""
    from inferhal.core.cli.main import compose
    from inferhal.core.parallel.launch import free_port
    from inferhal.core.server.dp_serve import DPGroup
    from inferhal.core.server.serve import check_dp, make_dp_app

    over = [*overrides(model_dir), "parallel=dep2", "parallel.launcher=torchrun",
            f"parallel.front=127.0.0.1:{free_port()}", "parallel.restarts=2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["INFERHAL_DP_KEY"] = KEY
    bin_dir = os.path.dirname(sys.executable)
    port = free_port()
    # each "host" gets a core of its own where it can (a rank takes the threads of the cores it may run on: two
    # ranks of two threads each on two shared cores ran a step about 15x slower here)
    logs = [open(tmp_path_factory.mktemp("agents") / f"agent{node}.log", "w") for node in (0, 1)]  # for a failure
    cores = sorted(os.sched_getaffinity(0))
    pin = [["taskset", "-c", str(cores[node % len(cores)])] if shutil.which("taskset") else [] for node in (0, 1)]
    agents = [subprocess.Popen(
        [*pin[node], os.path.join(bin_dir, "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "1",
         "--monitor-interval", "0.5",
         os.path.join(bin_dir, "inferhal"), "serve", *over],
        cwd="/tmp", env=env, stdout=subprocess.DEVNULL, stderr=logs[node], text=True) for node in (0, 1)]
    os.environ["INFERHAL_DP_KEY"] = KEY  # the front's
    group = None
    try:
        cfg = compose([*over, "parallel.start_timeout_s=120"], command="serve")  # the front's wait (600 s default)
        assert check_dp(cfg) == 2
        group = DPGroup(cfg)
        app, _ = make_dp_app(cfg, group)
        with run_server(app) as url:
            yield url, group, agents, over
    finally:
        if group is not None:
            group.close()
        os.environ.pop("INFERHAL_DP_KEY", None)
        for a in agents:
            try:
                a.wait(30)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait(10)
        for f in logs:
            f.close()


def test_greedy_completions_equal_the_single_process_streamed_and_not(single, front):
    url = front[0]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: both ranks run requests in the same steps
        want = list(pool.map(lambda p: complete(single, p, max_tokens=MAX_TOKENS), PROMPTS))
        got = list(pool.map(lambda p: complete(url, p, max_tokens=MAX_TOKENS), PROMPTS))
        streamed = list(pool.map(lambda p: complete(url, p, stream=True, max_tokens=MAX_TOKENS), PROMPTS))
    assert got == want and streamed == want
    assert all(len(t) > 0 for t, _ in want)
    attn = per_rank(get(url, "/metrics")[1], "inferhal_dp_attention_tokens_total")
    assert set(attn) == {0, 1} and all(v > 0 for v in attn.values()), attn  # both ranks ran requests
    status, body = get(url, "/health")
    assert status == 200 and json.loads(body)["roles"] == {"dp0": "ok", "dp1": "ok"}


def join_as(front, key=KEY.encode(), **change):
    """Join the live front as a rank would (dp_link.join_front), with the rank's own config and ``change``."""
    from omegaconf import OmegaConf

    from inferhal.core.cli.main import compose
    from inferhal.core.server.dp_link import join_front, numerics

    url, group, _, over = front
    config = numerics(OmegaConf.to_container(compose([*over, *change.pop("over", [])], command="serve"),
                                             resolve=True))
    join = {"rank": 1, "world_size": 2, "config": config, "pid": 0, "host": "test", **change}
    return join_front(group.door.address, key, join, timeout_s=30)


@pytest.mark.parametrize("change, words", [
    (dict(world_size=4), r"refused RANK=1: WORLD_SIZE=4 but the front serves parallel.dp=2 ranks"),
    (dict(rank=2), r"RANK=2 is outside the front's 2 ranks"),
    (dict(rank=0), r"RANK=0 is already connected \(pid \d+ on "),
    (dict(over=["cache.num_blocks=128", "seed=7"]),
     r"its config differs from the front's in what it computes: cache.num_blocks=128 \(the front has 256\); seed=7 "
     r"\(the front has"),
    (dict(key=b"another-key"), r"refused this rank's key: set INFERHAL_DP_KEY to the front's"),
])
def test_a_rank_that_does_not_fit_the_group_is_refused_naming_why(front, change, words):
    from inferhal.core.errors import UserError

    key = change.pop("key", KEY.encode())
    with pytest.raises(UserError, match=words):
        join_as(front, key, **change)
    assert get(front[0], "/health")[0] == 200  # the live group goes on


def test_a_rank_killed_under_load_costs_no_stream_its_text_and_torchrun_restarts_the_group(single, front):
    url, group, agents, _ = front
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        want = list(pool.map(lambda p: complete(single, p, max_tokens=MAX_TOKENS_KILLED), PROMPTS))
    got, seen_503 = streams_with_rank_1_killed(url, group, PROMPTS, MAX_TOKENS_KILLED, after=12)
    assert seen_503 and group.restarts == 1
    assert got == want  # every stream went on where it stopped, nothing repeated or lost
    assert get(url, "/health")[0] == 200
    assert complete(url, "Once upon a time") == complete(single, "Once upon a time")  # the new group serves
    text = get(url, "/metrics")[1]
    assert per_rank(text, "inferhal_dp_kv_blocks_in_use") == {0: 0.0, 1: 0.0}
    assert series(text, "inferhal_dp_restarts_total") == {'{model_name="deepseek_v4_tiny"}': 1.0}
    assert all(a.poll() is None for a in agents)

    # torchrun has no restart left: the front waits parallel.start_timeout_s, then the open stream ends with an error
    import openai

    group.start_timeout_s = 3.0
    stream = client(url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    os.kill(group.ranks[1].process.pid, signal.SIGKILL)
    with pytest.raises(openai.APIError) as ended:
        for _ in stream:
            pass
    assert "the engine stopped" in str(ended.value)
    assert "DP ranks connected to parallel.front within parallel.start_timeout_s=3 s" in str(ended.value.body)
    assert get(url, "/health")[0] == 503
    with pytest.raises(openai.APIStatusError) as err:
        complete(url, "anything")
    assert err.value.status_code == 503
    assert [a.wait(60) != 0 for a in agents] == [True, True]  # both agents out of restarts
