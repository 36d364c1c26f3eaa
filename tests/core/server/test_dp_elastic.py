"""Elastic EP under ``inferhal serve`` (core/server/dp_elastic.py): three DP attention x EP MoE rank processes of
the tiny DeepSeek-V4 (tiny_text.py) with ``eplb.survive_rank_loss`` (8 experts, 18 slots: each expert on two
ranks). A rank killed mid-stream (SIGKILL): the survivors go on without a restart: every stream of the official
``openai`` client ends with the single process's greedy text, ``/health`` answers 200 ``degraded`` naming the lost
rank, a new request is served, no KV is held on a survivor afterwards, ``/metrics`` shows no series of the lost
rank and takes the expert-load balance over the survivors, and the restart counter stays at 0. A second
death, which the 12 slots left cannot cover, restarts the group as without elastic EP, and all three ranks are back.
The front's decision alone, with stand-in ranks: no shrink without an exited rank, a survivor's refusal or
different placements; a shrink keeps each survivor's label and places every open request again."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_dp_serve import MODEL, PROMPTS, complete, get, per_rank, series, serving  # noqa: F401 (MODEL: the client's)
from tiny_text import write_tiny_text_model

SURVIVE = ("parallel.dp=3", "parallel.ep=3", "eplb=default", "eplb.num_redundant_experts=10",
           "eplb.survive_rank_loss=true", "eplb.step_interval=0", "parallel.restarts=1", "parallel.timeout_s=10")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("openai")
    return write_tiny_text_model(str(tmp_path_factory.mktemp("tiny_text")))


def wait_for(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pred()


@pytest.mark.slow
def test_survivors_of_a_covered_rank_death_serve_on_without_a_restart(model_dir):
    from inferhal.core.server.dp_serve import DPGroup

    prompts = PROMPTS[:4]
    with serving(model_dir, dp=False) as (url, _):
        with ThreadPoolExecutor(len(prompts)) as pool:
            want = list(pool.map(lambda p: complete(url, p, max_tokens=60), prompts))
        want_new = complete(url, PROMPTS[4])
    with serving(model_dir, *SURVIVE, dp=True, layout="dep2") as (url, engine):
        group: DPGroup = engine.engine
        assert json.loads(get(url, "/health")[1])["roles"] == {"dp0": "ok", "dp1": "ok", "dp2": "ok"}
        seen = []

        def kill_when_streaming():
            wait_for(lambda: sum(len(r.last.outputs[0].token_ids) if r.last else 0
                                 for r in list(group.requests.values())) >= 20)
            os.kill(group.ranks[1].process.pid, signal.SIGKILL)
            wait_for(lambda: group.shrinks == 1)
            seen.append(get(url, "/health"))

        killer = threading.Thread(target=kill_when_streaming)
        killer.start()
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: complete(url, p, max_tokens=60, stream=True), prompts))
        killer.join()
        assert got == want  # every stream went on where it stopped, nothing repeated or lost
        assert group.shrinks == 1 and group.restarts == 0 and group.dp == 2
        status, body = seen[0]
        health = json.loads(body)
        assert status == 200 and health["status"] == "degraded"
        assert health["roles"]["dp0"] == health["roles"]["dp2"] == "ok"
        assert health["roles"]["dp1"].startswith("lost: DP rank")
        assert complete(url, PROMPTS[4]) == want_new  # the survivors serve a new request
        _, text = get(url, "/metrics")
        kv = per_rank(text, "inferhal_dp_kv_blocks_in_use")
        assert kv[0] == kv[2] == 0.0  # the survivors, under their own labels
        assert 'dp_rank="1"' not in text  # none of the lost rank's series stays at its last value
        load = {0: 0.0, 2: 0.0}  # the survivors' expert load, summed over the layers
        for labels, v in series(text, "inferhal_dp_expert_load").items():
            load[int(re.search(r'dp_rank="(\d+)"', labels).group(1))] += v
        assert set(load) == {0, 2} and sum(load.values()) > 0
        figure = series(text, "inferhal_dp_balance")['{figure="expert_load",model_name="deepseek_v4_tiny"}']
        assert figure == pytest.approx(max(load.values()) / (sum(load.values()) / 2))  # over the survivors
        assert series(text, "inferhal_dp_restarts_total") == {'{model_name="deepseek_v4_tiny"}': 0.0}
        assert all(not group.probe(r)["kv_requests"] for r in range(2))
        # a second death: 12 slots cannot hold every expert on both survivors, so the group restarts, all 3 back
        os.kill(group.ranks[1].process.pid, signal.SIGKILL)
        assert complete(url, PROMPTS[0], max_tokens=60) == want[0]
        assert group.restarts == 1 and group.shrinks == 1 and group.dp == 3
        assert wait_for(lambda: json.loads(get(url, "/health")[1])["roles"] ==
                        {"dp0": "ok", "dp1": "ok", "dp2": "ok"}, 30)


class _Proc:
    def __init__(self, alive):
        self.alive = alive

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        pass


class _Conn:
    """A rank's pipe: what the front sent, and the replies queued for it."""

    def __init__(self, *replies):
        self.sent, self.replies, self.closed = [], list(replies), False

    def send(self, msg):
        self.sent.append(msg)

    def poll(self, timeout=0):
        return bool(self.replies)

    def recv(self):
        return self.replies.pop(0)

    def close(self):
        self.closed = True


def stand_in(alive, replies):
    from types import SimpleNamespace

    from inferhal.core.server.dp_elastic import ElasticGroup

    class Group(ElasticGroup):
        def _again(self, rid):
            self._adds.append(rid)

    g = Group()
    g.dp, g.timeout_s, g._cfg = len(alive), 1.0, {"parallel": {"master_addr": "127.0.0.1"}}
    g.requests, g._adds, g._aborts, g.busy, g.totals = {"a": None, "b": None}, ["x"], ["y"], True, {"drafts": 5}
    g.ranks = [SimpleNamespace(process=_Proc(a), conn=_Conn(*r), gauges={"n": i, "drafts": 10 * i}) for i, (a, r) in
               enumerate(zip(alive, replies))]
    g._full_group()
    return g


def test_the_front_shrinks_only_on_an_exited_rank_and_every_survivor_agreeing(monkeypatch):
    import inferhal.core.server.dp_elastic as el

    monkeypatch.setattr(el, "EXIT_WAIT_S", 0.05)
    ok = ("shrink", {"ok": True, "placement": 7})
    g = stand_in([True, True, True], [[], [], []])
    assert not g._shrink("DP rank 1 failed") and not any(r.conn.sent for r in g.ranks)  # nobody exited
    g = stand_in([True, False, True], [[("error", "peer gone"), ok], [], [("shrink", {"ok": False, "why": "no"})]])
    assert not g._shrink("x") and g.dp == 3 and g.labels == [0, 1, 2] and not g.lost  # a survivor refused
    g = stand_in([True, False, True], [[ok], [], [("shrink", {"ok": True, "placement": 8})]])
    assert not g._shrink("x") and g.shrinks == 0  # the survivors disagree on the placement
    g = stand_in([True, False, True], [[("stepped", None), ok], [], [ok]])
    assert g._shrink("DP rank 1 exited")
    assert [r.conn.sent[0][0] for r in g.ranks] == ["shrink", "shrink"]
    lost, addr, port = g.ranks[0].conn.sent[0][1]
    assert lost == [1] and addr == "127.0.0.1" and port > 0 and g.ranks[1].conn.sent[0][1] == (lost, addr, port)
    assert g.dp == 2 and g.labels == [0, 2] and g.shrinks == 1 and not g.busy and g._aborts == []
    assert g._adds == ["a", "b"]  # every open request placed again; nothing of the torn step is sent
    assert g.labelled([r.gauges for r in g.ranks]) == [{"n": 0, "drafts": 0}, {}, {"n": 2, "drafts": 20}]
    assert g.totals == {"drafts": 15, "preemptions": 0, "accepted": 0}  # the lost rank's counters carried over
    assert list(g.lost_health()) == ["dp1"] and g.lost_health()["dp1"].startswith("lost: DP rank 1 exited")
    g._full_group()  # a restart: every rank back
    assert g.dp == 3 and g.labels == [0, 1, 2] and not g.lost and g.shrinks == 1
