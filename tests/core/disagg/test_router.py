"""Disaggregation as separate launches: two prefill and two decode instances of the tiny V4, each its own
``inferhal serve parallel.role=prefill|decode`` process, behind a :class:`~inferhal.core.disagg.router.Router`
in this process that loads no weights. Requests are spread by load over every instance and pair, and give
the colocated engine's tokens (greedy and seeded sampling). An instance killed mid-request loses no request
(retried elsewhere, no block left on the survivors), and rejoins when it is launched again on its address;
a router that goes away leaves clean instances for the next one; a mismatched instance or a wrong key is
refused by name."""

from __future__ import annotations

import os
import signal
import time

import pytest
from serve_process import ServeProcess

from inferhal.core.errors import UserError

pytestmark = pytest.mark.slow

KEY = "test-disagg-key"
BASE = ["model=deepseek_v4_tiny", "cache.num_blocks=64", "parallel.timeout_s=5"]
PROMPTS = [[(7 * i + 3 * j) % 190 + 1 for i in range(5 + 9 * j)] for j in range(8)]
MAX_TOKENS = 10


class Instance(ServeProcess):
    """One ``inferhal serve parallel.role=ROLE`` process on a loopback port (``port`` 0: any)."""

    def __init__(self, role: str, *over: str, port: int = 0) -> None:
        env = dict(os.environ, INFERHAL_DISAGG_KEY=KEY, OMP_NUM_THREADS="1")
        super().__init__([*BASE, *over, f"parallel.role={role}", f"disagg.listen=127.0.0.1:{port}"],
                         "waiting for a router on", env)
        self.role, self.port = role, self.port_after("waiting for a router on ")
        self.address = f"127.0.0.1:{self.port}"


def router_over(pre, dec, *over):
    from inferhal.core.cli.main import compose
    from inferhal.core.disagg.router import Router

    cfg = compose([*BASE, "parallel.role=router", f"disagg.authkey={KEY}", "disagg.reconnect_s=0.3",
                   f"disagg.prefill=[{','.join(i.address for i in pre)}]",
                   f"disagg.decode=[{','.join(i.address for i in dec)}]", *over], command="serve")
    return Router(cfg, spawn=False, start_timeout_s=120)


def params():
    from inferhal.core.sampling.params import SamplingParams

    return [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, ignore_eos=True)
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def colocated():
    from inferhal.core.engine.llm import LLM, compose_config

    llm = LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64"]))
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params())]


@pytest.fixture(scope="module")
def fleet():
    insts = {}
    try:
        for name in ("prefill0", "prefill1", "decode0", "decode1"):
            insts[name] = Instance(name[:-1])
        yield insts
    finally:
        for i in insts.values():
            i.stop()


def run(router, tag: str, during=None, timeout: float = 120.0) -> list:
    """Every prompt through ``router`` (ids ``tag``-i) → the tokens each request's stream got, in order;
    ``during(router)`` is called after every step until it returns True."""
    got: dict[str, list] = {}
    for i, (p, sp) in enumerate(zip(PROMPTS, params())):
        router.add(router.make_request(p, sp, request_id=f"{tag}-{i}"))
        got[f"{tag}-{i}"] = []
    done: set = set()
    deadline = time.monotonic() + timeout
    while len(done) < len(got):
        assert time.monotonic() < deadline, f"requests {sorted(set(got) - done)} never finished"
        for o in router.step():
            if o.request_id in got:
                got[o.request_id] = list(o.outputs[0].token_ids)
                if o.finished:
                    assert o.outputs[0].finish_reason == "length", o
                    done.add(o.request_id)
        if during is not None and during(router):
            during = None
    return [got[f"{tag}-{i}"] for i in range(len(PROMPTS))]


def same(router, got, want, tag: str) -> None:
    """``got`` is the colocated tokens, except that a sampled request retried after a death draws from a
    fresh generator from there (a valid sample of the same length; greedy ones stay exact)."""
    for i, (g, w) in enumerate(zip(got, want)):
        if i % 2 and f"{tag}-{i}" in router.retried:
            assert len(g) == len(w) == MAX_TOKENS
        else:
            assert g == w, i


def no_leak(router) -> None:
    for name, inst in router.insts.items():
        if inst.live:
            acc = router.probe(name)
            assert acc["kv_requests"] == [] and not acc["unfinished"] and acc["check"] is None, (name, acc)


def step_until(router, cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        router.step()


def test_two_by_two_instances_spread_the_load_and_give_the_colocated_tokens(fleet, colocated):
    router = router_over([fleet["prefill0"], fleet["prefill1"]], [fleet["decode0"], fleet["decode1"]])
    try:
        assert run(router, "a") == colocated
        assert not hasattr(router, "loaded") and router.front.max_model_len > 0  # no weights in the router
        used = {k for k, n in router.placed.items() if n}
        assert {p for p, _ in used} == {"prefill0", "prefill1"} and {d for _, d in used} == {"decode0", "decode1"}
        assert router.retried == {} and router.failed == {}
        no_leak(router)
    finally:
        router.close()
    assert all(i.p.poll() is None for i in fleet.values())  # a router's close leaves separate instances running


def test_a_new_router_finds_clean_instances_when_the_last_one_went_away_mid_request(fleet, colocated):
    router = router_over([fleet["prefill0"]], [fleet["decode0"]])
    for i, (p, sp) in enumerate(zip(PROMPTS, params())):
        router.add(router.make_request(p, sp.__class__(max_tokens=200, ignore_eos=True), request_id=f"gone-{i}"))
    step_until(router, lambda: any(r.at == "decode" for r in router.requests.values()), "a request decoding")
    router.close()  # the instances abort what it sent them and free its blocks
    second = router_over([fleet["prefill0"]], [fleet["decode0"]])
    try:
        step_until(second, lambda: all(not second.probe(n)["kv_requests"] for n in second.insts), "clean pools")
        no_leak(second)
        assert run(second, "b") == colocated
    finally:
        second.close()


def test_a_killed_decode_instance_loses_no_request_and_rejoins_when_launched_again(fleet, colocated):
    router = router_over([fleet["prefill0"], fleet["prefill1"]], [fleet["decode0"], fleet["decode1"]])
    try:
        def kill_decode1(r):
            if any(rec.where == "decode1" and rec.at == "decode" for rec in r.requests.values()):
                fleet["decode1"].stop()
                return True
            return False

        same(router, run(router, "c", during=kill_decode1), colocated, "c")
        assert "decode1" in router.failed and router.retried
        assert all(router.insts[n].live for n in ("prefill0", "prefill1", "decode0"))
        no_leak(router)
        fleet["decode1"] = Instance("decode", port=fleet["decode1"].port)  # the operator launches it again
        step_until(router, lambda: router.linked(("prefill0", "decode1")) and router.linked(("prefill1", "decode1")),
                   "decode1 to rejoin, linked to both prefill instances")
        before = sum(n for (_, d), n in router.placed.items() if d == "decode1")
        assert run(router, "d") == colocated
        assert sum(n for (_, d), n in router.placed.items() if d == "decode1") > before
        no_leak(router)
    finally:
        router.close()


def test_a_killed_prefill_instance_loses_no_request(fleet, colocated):
    router = router_over([fleet["prefill0"], fleet["prefill1"]], [fleet["decode0"]])
    victim = fleet["prefill1"]
    try:
        os.kill(victim.p.pid, signal.SIGSTOP)  # requests placed on it wait there

        def kill_prefill1(r):
            if any(rec.where == "prefill1" and rec.at == "prefill" for rec in r.requests.values()):
                victim.stop()
                return True
            return False

        same(router, run(router, "e", during=kill_prefill1), colocated, "e")
        assert "prefill1" in router.failed and set(router.retried.values()) <= {"prefill0", "decode0"}
        no_leak(router)
    finally:
        router.close()
        fleet["prefill1"] = Instance("prefill")


def test_a_mismatched_instance_and_a_wrong_key_are_refused_by_name(fleet):
    odd = Instance("decode", "cache.kv_dtype=fp8")
    try:
        with pytest.raises(UserError, match=r"decode0 at 127.0.0.1:\d+ is refused: .*KV group"):
            router_over([fleet["prefill0"]], [odd])
    finally:
        odd.stop()
    with pytest.raises(UserError, match=r"prefill0 at 127.0.0.1:\d+ is a decode instance, listed as disagg.prefill"):
        router_over([fleet["decode1"]], [fleet["decode0"]])
    with pytest.raises(UserError, match="refused the key"):
        router_over([fleet["prefill0"]], [fleet["decode0"]], "disagg.authkey=wrong")
    held = router_over([fleet["prefill0"]], [fleet["decode0"]])
    try:  # an instance serves one router at a time
        with pytest.raises(UserError, match=r"no answer within 3 s from prefill0 .*not serving another router"):
            from inferhal.core.cli.main import compose
            from inferhal.core.disagg.router import Router

            Router(compose([*BASE, "parallel.role=router", f"disagg.authkey={KEY}",
                            f"disagg.prefill=[{fleet['prefill0'].address}]"], command="serve"), spawn=False,
                   start_timeout_s=3)
    finally:
        held.close()
    with pytest.raises(UserError, match=r"no answer within .* from decode0 \(127.0.0.1:1\)"):
        from inferhal.core.cli.main import compose
        from inferhal.core.disagg.router import Router

        Router(compose([*BASE, "parallel.role=router", f"disagg.authkey={KEY}", "disagg.decode=['127.0.0.1:1']"],
                       command="serve"), spawn=False, start_timeout_s=2)


def test_a_silent_instance_is_taken_out_and_rejoins_when_it_answers_again(fleet, colocated):
    """A stopped process (a hung host) keeps its connection open but sends nothing: after parallel.timeout_s
    the router takes it out of service; once it runs again it finds its router gone, and the router's
    reconnect brings it back."""
    router = router_over([fleet["prefill0"]], [fleet["decode0"], fleet["decode1"]])
    hung = fleet["decode1"]
    try:
        os.kill(hung.p.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        step_until(router, lambda: router.insts["decode1"].state == "dead", "decode1 to be taken out", 30)
        assert time.monotonic() - t0 >= 4 and "sent nothing for 5 s" in router.failed["decode1"]
        assert run(router, "f") == colocated  # on the instances left
        os.kill(hung.p.pid, signal.SIGCONT)
        step_until(router, lambda: router.linked(("prefill0", "decode1")), "decode1 to rejoin", 60)
        no_leak(router)
    finally:
        os.kill(hung.p.pid, signal.SIGCONT)
        router.close()


def test_requests_sharing_a_prefix_go_to_the_prefill_instance_that_holds_it(fleet):
    """Placement by prefix: a prompt whose leading blocks went to one prefill instance goes there again (a hit
    in its prefix cache), while a prompt nobody has seen goes to the least loaded instance."""
    from inferhal.core.sampling.params import SamplingParams

    router = router_over([fleet["prefill0"], fleet["prefill1"]], [fleet["decode0"]])
    shared = [(5 * i + 1) % 190 + 1 for i in range(64)]  # four full blocks of 16
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        def one(rid, prompt):
            router.add(router.make_request(prompt, sp, request_id=rid))
            where, cached = router.requests[rid].where, None
            while rid in router.requests:
                for o in router.step():
                    if o.request_id == rid and cached is None:
                        cached = o.num_cached_tokens  # the first output: the prefill instance's
            return where, cached

        router.add(router.make_request([9] * 40, sp.__class__(max_tokens=200, ignore_eos=True), request_id="busy"))
        busy_on = router.requests["busy"].where
        home, cached = one("s0", shared + [7])  # placed while "busy" waits at its prefill instance: the other
        assert cached == 0 and {home, busy_on} == {"prefill0", "prefill1"}
        for k in range(1, 4):
            where, cached = one(f"s{k}", shared + [7 + k])
            assert where == home and cached >= 48, (k, where, cached)
        assert router.prefix_placed == 3
        router.abort(["busy"])
        no_leak(router)
    finally:
        router.close()
