"""The decode instance's loop (core/disagg/workers.py: serve_router) in a thread of this process, on the tiny
V4, its KV link a fake: when the prefill instance dies, a request may reach the decode side twice, as its KV
payload (sent just before the death) and as the router's retry from its prompt. Whichever comes first runs
it, the other is dropped before anything is allocated: one output stream, the colocated engine's tokens, no
block left behind. When the router goes away, the instance aborts what it held and frees every block."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

from inferhal import LLM, SamplingParams
from inferhal.core.disagg import workers
from inferhal.core.disagg.handoff import side
from inferhal.core.engine.engine import Engine
from inferhal.core.engine.llm import compose_config

PROMPTS = [[(7 * i + 3) % 190 + 1 for i in range(40)], [5, 6, 7, 8, 9, 10, 11]]


class Pipe:
    """The worker's end of its pipe to the router: what it sends, in order."""

    def __init__(self) -> None:
        self.q: "queue.Queue" = queue.Queue()
        self.seen: list = []  # messages passed over by next()

    def send(self, msg) -> None:
        self.q.put(msg)

    def next(self, kind: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got, arg = self.q.get(timeout=0.1)
            except queue.Empty:
                continue
            if got == kind:
                return arg
            self.seen.append((got, arg))
        raise AssertionError(f"no {kind!r} message from the worker")


class Payloads:
    """The KV connector's receiving end: payloads put here arrive."""

    def __init__(self) -> None:
        self.q: "queue.Queue" = queue.Queue()

    def recv(self, timeout=None):
        return self.q.get()


def test_a_payload_and_a_retry_of_one_request_run_it_once(monkeypatch):
    base = LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64"]))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, sp)]
    e = base.engine
    prefill, decode = (Engine(e.loaded, e.backend, e.scheduler.cfg, None, e.max_model_len, transfer=side(r))
                       for r in ("prefill", "decode"))
    for i, p in enumerate(PROMPTS):
        prefill.add_request(p, sp, request_id=f"r{i}")
    payloads, firsts = {}, {}
    while prefill.has_unfinished():
        for o in prefill.step():
            firsts[o.request_id] = list(o.outputs[0].token_ids)
        for pl in prefill.transfer.take():
            payloads[pl.state["request_id"]] = pl
    assert sorted(payloads) == ["r0", "r1"] and all(len(f) == 1 for f in firsts.values())

    ctl, out, probe, conn = queue.Queue(), Pipe(), queue.Queue(), Payloads()
    monkeypatch.setattr(workers, "make_link", lambda *a: conn)  # the link to "p0" is this fake
    worker = threading.Thread(target=workers.serve_router, args=("decode", decode, None, ctl, out, probe.put),
                              daemon=True)
    worker.start()
    ctl.put(("link", ("p0", "key", "127.0.0.1", 1, 5.0)))
    assert out.next("linked") == ("p0", None)
    retry = lambda rid: ("add", (rid, PROMPTS[int(rid[1])] + firsts[rid],
                                 dataclasses.replace(sp, max_tokens=sp.max_tokens - 1), True, None))
    tokens: dict[str, list] = {"r0": list(firsts["r0"]), "r1": []}

    def collect(rid):
        while True:
            outs, gauges = out.next("outputs")
            for o in outs:
                assert o.request_id == rid
                tokens[rid] += o.new_token_ids
                if o.finished:
                    return o

    # r0: the retry first (taken), then its payload (dropped)
    ctl.put(retry("r0"))
    assert out.next("taken") == "r0"
    conn.q.put(payloads["r0"])
    collect("r0")
    # r1: the payload first (adopted), then the retry (skipped)
    conn.q.put(payloads["r1"])
    end = collect("r1")
    ctl.put(retry("r1"))
    assert out.next("skipped") == "r1"
    ctl.put(("probe", None))
    acc = probe.get(timeout=30)
    # a third request is running when the router goes away: aborted, its blocks freed, the loop ends
    ctl.put(("add", ("r2", PROMPTS[0], dataclasses.replace(sp, max_tokens=200), False, None)))
    out.next("outputs")
    assert decode.kv_manager.reqs
    ctl.put(("router_gone", "EOFError"))
    worker.join(30)
    assert not worker.is_alive() and not decode.kv_manager.reqs and not decode.has_unfinished()
    decode.kv_manager.check()
    assert tokens["r0"] == want[0]
    assert firsts["r1"] + tokens["r1"] == want[1] == end.outputs[0].token_ids
    assert acc["kv_requests"] == [] and not acc["unfinished"] and acc["check"] is None
    assert not [m for m in out.seen if m[0] in ("outputs", "failed")]
