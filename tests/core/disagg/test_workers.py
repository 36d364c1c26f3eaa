"""The decode worker's loop (core/disagg/workers.py) in a thread of this process, on the tiny V4: when the
prefill process dies, a request may reach the decode side twice, as its KV payload (sent just before the
death) and as the router's retry from its prompt. Whichever comes first runs it, the other is dropped
before anything is allocated: one output stream, the colocated engine's tokens, no block left behind."""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time

from inferhal import LLM, SamplingParams
from inferhal.core.disagg.workers import _loop
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


def test_a_payload_and_a_retry_of_one_request_run_it_once():
    base = LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64"]))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, sp)]
    e = base.engine
    prefill, decode = (Engine(e.loaded, e.backend, e.scheduler.cfg, None, e.max_model_len, role=r)
                       for r in ("prefill", "decode"))
    for i, p in enumerate(PROMPTS):
        prefill.add_request(p, sp, request_id=f"r{i}")
    payloads, firsts = {}, {}
    while prefill.has_unfinished():
        for o in prefill.step():
            firsts[o.request_id] = list(o.outputs[0].token_ids)
        for pl in prefill.take_handoffs():
            payloads[pl.state["request_id"]] = pl
    assert sorted(payloads) == ["r0", "r1"] and all(len(f) == 1 for f in firsts.values())

    ctl, out, probe, conn = queue.Queue(), Pipe(), queue.Queue(), Payloads()
    worker = threading.Thread(target=_loop, args=("decode", decode, conn, ctl, out, probe, os.getppid()), daemon=True)
    worker.start()
    retry = lambda rid: ("add", (rid, PROMPTS[int(rid[1])] + firsts[rid],
                                 dataclasses.replace(sp, max_tokens=sp.max_tokens - 1), True, False))
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
    ctl.put(("stop", None))
    worker.join(30)
    assert tokens["r0"] == want[0]
    assert firsts["r1"] + tokens["r1"] == want[1] == end.outputs[0].token_ids
    assert acc["kv_requests"] == [] and not acc["unfinished"] and acc["check"] is None
    assert not [m for m in out.seen if m[0] in ("outputs", "failed")]
