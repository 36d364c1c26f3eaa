"""Aborts at every awkward point of a request's life, on the toy model (a full and a sliding KV group): while it
waits preempted and while it is recomputed, between two chunks of its prefill (its blocks half in the prefix
cache), between the step that drafted for it and the step that verifies the drafts (and with asynchronous
scheduling while that step is in flight), at each point of a prefill/decode hand-off, under a duplicate or
reused request id, and every request at once. After each: no request holds a block (``kv_manager.reqs``
empty), the pool's invariants hold (``kv_manager.check()``), and the next request's greedy tokens, and every
request that was not aborted, equal a solo run's on a fresh engine (SGLang's test_abort.py and vLLM's abort
tests ask the same of a server)."""

from __future__ import annotations

import pytest

from inferhal.core.config.schema import CacheConfig, SchedulerConfig, SpecConfig
from inferhal.core.engine.engine import Engine
from inferhal.core.sampling.params import SamplingParams
from inferhal.core.scheduler.scheduler import RequestError

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
#: prompts sharing prefixes, one long (chunked), two with repeats (n-gram drafts hit)
P = [list(range(3, 40)), list(range(3, 20)) + [50, 51], [5, 6, 7, 8] * 5, [9, 10, 11] * 4 + [12], [40, 41, 42]]
#: prompts holding every token the toy model samples: n-gram drafts come at every step
D = [list(range(3, 64)), list(range(63, 2, -1))]
PROBE = list(range(3, 30)) + [60]  # shares the long prompt's first blocks: a prefix hit on what aborts left
_solo: dict = {}


@pytest.fixture(scope="module")
def toy(backend, toy_module):
    return toy_module.make_toy(backend, kinds=("full", "sliding"), window=6, max_model_len=96)


def engine(toy, backend, blocks=64, chunk=64, seqs=8, asynchronous=False, spec=None, transfer=None):
    return Engine(toy, backend, SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=chunk,
                                                async_scheduling=asynchronous),
                  CacheConfig(block_size=4, num_blocks=blocks, enable_prefix_caching=True), spec=spec,
                  transfer=transfer)


def solo(toy, backend, prompt, sp=GREEDY) -> list[int]:
    key = (tuple(prompt), sp.max_tokens)
    if key not in _solo:
        eng = engine(toy, backend, seqs=1)
        rid = eng.add_request(prompt, sp)
        _solo[key] = drain(eng)[rid]
    return _solo[key]


def drain(eng, limit: int = 2000) -> dict:
    """Step until nothing is left (a step in flight folded in); → request id → its tokens, of those that
    finished by a stop or their length (not the aborted)."""
    return step_until(eng, lambda: not eng.has_unfinished() and not eng.executor.in_flight, limit)


def step_until(eng, cond, limit: int = 500) -> dict:
    outs = {}
    for _ in range(limit):
        if cond():
            return outs
        for o in eng.step():
            if o.finished and o.finish_reason not in ("abort", "transferred"):
                outs[o.request_id] = list(o.token_ids)
    raise AssertionError("the condition never held")


def clean(eng) -> None:
    assert not eng.kv_manager.reqs, f"requests still hold blocks: {list(eng.kv_manager.reqs)}"
    eng.kv_manager.check()
    assert not eng.scheduler.requests and not eng.scheduler.running and not eng.scheduler.waiting


def clean_then_probe(toy, backend, eng) -> None:
    """No block held, the pool consistent, and a new request (a prefix hit on the aborted ones' blocks) gives its
    solo tokens."""
    clean(eng)
    rid = eng.add_request(PROBE, GREEDY)
    assert drain(eng)[rid] == solo(toy, backend, PROBE)
    clean(eng)


def survivors_match(toy, backend, done: dict, prompts: dict) -> None:
    for rid, toks in done.items():
        assert toks == solo(toy, backend, prompts[rid]), f"{rid} differs from its solo run"


# -- preemption and recompute --------------------------------------------------------------------------------
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("when", ["preempted", "recomputing"])
def test_abort_while_preempted_or_while_recomputed(toy, backend, asynchronous, when):
    eng = engine(toy, backend, blocks=16, chunk=8, asynchronous=asynchronous)
    prompts = {eng.add_request(p, GREEDY): p for p in P}
    s = eng.scheduler

    def victim():
        for r in list(s.requests.values()):
            if r.num_preemptions and (when == "preempted" and r in s.waiting
                                      or when == "recomputing" and r in s.running
                                      and 0 < r.num_computed_tokens < r.num_tokens - 1):
                return r.request_id
        return None

    done = step_until(eng, lambda: victim() is not None)
    rid = victim()
    outs = eng.abort([rid])
    assert [o.finish_reason for o in outs] == ["abort"] and rid not in eng.kv_manager.reqs
    done.update(drain(eng))
    assert rid not in done and len(done) == len(P) - 1
    survivors_match(toy, backend, done, prompts)
    clean_then_probe(toy, backend, eng)


# -- a prefill chunk ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_abort_between_prefill_chunks_leaves_a_prefix_cache_the_probe_can_trust(toy, backend, asynchronous):
    eng = engine(toy, backend, chunk=6, asynchronous=asynchronous)
    rid = eng.add_request(P[0], GREEDY)  # 37 tokens in chunks of 6
    other = eng.add_request(P[4], GREEDY)
    req = eng.scheduler.requests[rid]
    done = step_until(eng, lambda: 12 <= req.num_computed_tokens < len(P[0]) - 6)
    eng.abort([rid])
    done.update(drain(eng))
    assert done == {other: solo(toy, backend, P[4])}
    clean_then_probe(toy, backend, eng)  # PROBE shares the aborted prompt's first 27 tokens


# -- drafts -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_abort_between_drafting_and_verification(toy, backend, asynchronous):
    spec = SpecConfig(method="ngram", num_speculative_tokens=3, ngram_max=3)
    eng = engine(toy, backend, asynchronous=asynchronous, spec=spec)
    prompts = {eng.add_request(p, GREEDY): p for p in D}
    a, b = list(prompts)
    s = eng.scheduler
    if asynchronous:  # the step in flight carries a's draft placeholders (the step thread fills them in)
        cond = lambda: s.requests[a].num_pending_drafts > 0  # noqa: E731
    else:  # drafts proposed for a's next step, not yet verified
        cond = lambda: bool(s.requests[a].spec_token_ids)  # noqa: E731
    done = step_until(eng, cond)
    eng.abort([a])
    done.update(drain(eng))
    assert done == {b: solo(toy, backend, prompts[b])} and s.num_draft_tokens > 0
    clean_then_probe(toy, backend, eng)


# -- duplicate and reused ids ---------------------------------------------------------------------------------
def test_a_duplicate_id_is_refused_and_changes_nothing(toy, backend):
    eng = engine(toy, backend)
    eng.add_request(P[0], GREEDY, request_id="x")
    eng.step()
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request(P[1], GREEDY, request_id="x")
    assert drain(eng)["x"] == solo(toy, backend, P[0])
    clean_then_probe(toy, backend, eng)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("drafts", [False, True], ids=["plain", "ngram"])
def test_an_id_aborted_and_sent_again_runs_afresh(toy, backend, asynchronous, drafts):
    """A client's retry reuses its request id right after the abort; with asynchronous scheduling the old
    request's step is still in flight then: its tokens must not land in the new request."""
    spec = SpecConfig(method="ngram", num_speculative_tokens=3, ngram_max=3) if drafts else None
    eng = engine(toy, backend, asynchronous=asynchronous, spec=spec)
    eng.add_request(D[0], GREEDY, request_id="r")
    other = eng.add_request(D[1], GREEDY)
    step_until(eng, lambda: len(eng.scheduler.requests["r"].output_token_ids) >= 3
               and (not asynchronous or bool(eng.executor.in_flight)))
    eng.abort(["r"])
    eng.add_request(D[0], GREEDY, request_id="r")  # the same id, the same body, at once
    done = drain(eng)
    assert done == {"r": solo(toy, backend, D[0]), other: solo(toy, backend, D[1])}
    assert not drafts or eng.scheduler.num_draft_tokens > 0
    clean_then_probe(toy, backend, eng)


def test_an_id_finished_and_sent_again_while_its_last_step_is_in_flight(toy, backend):
    """Asynchronous scheduling schedules a request's next step before its end is known: when it ends, that step is
    still in flight, and a new request with its id must not get its tokens."""
    eng = engine(toy, backend, asynchronous=True)
    eng.add_request(D[0], GREEDY, request_id="r")
    step_until(eng, lambda: "r" not in eng.scheduler.requests)
    assert "r" in eng.executor.pending_ids()  # its last (scheduled) step is in flight
    eng.add_request(D[0], GREEDY, request_id="r")
    assert drain(eng) == {"r": solo(toy, backend, D[0])}
    clean_then_probe(toy, backend, eng)


# -- everything at once ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_every_request_aborted_at_once(toy, backend, asynchronous):
    spec = SpecConfig(method="ngram", num_speculative_tokens=3, ngram_max=3)
    eng = engine(toy, backend, blocks=20, chunk=12, asynchronous=asynchronous, spec=spec)
    for i in range(3):
        for p in P:
            eng.add_request(p, GREEDY, request_id=f"{i}-{p[0]}-{len(p)}")
    step_until(eng, lambda: eng.scheduler.num_preemptions > 0 and len(eng.scheduler.running) > 1)
    outs = eng.abort(list(eng.scheduler.requests))
    assert len(outs) >= 2 and all(o.finished and o.finish_reason == "abort" for o in outs)
    assert not eng.kv_manager.reqs and not eng.scheduler.has_unfinished()
    drain(eng)  # a step in flight (asynchronous) folds in to nothing
    clean_then_probe(toy, backend, eng)


# -- a disaggregated hand-off ---------------------------------------------------------------------------------
def pair(toy, backend, decode_seqs=8):
    from inferhal.core.disagg import local
    from inferhal.core.disagg.handoff import DecodeSide, PrefillSide

    pre = engine(toy, backend, chunk=8, transfer=PrefillSide())
    dec = engine(toy, backend, seqs=decode_seqs, transfer=DecodeSide())
    send, recv = local.connect(pre, dec)
    return pre, dec, send, recv


@pytest.mark.parametrize("where", ["prefill_chunk", "exported_not_sent", "sent_waiting_for_room", "decoding"])
def test_abort_at_each_point_of_a_hand_off(toy, backend, where):
    """A prefill and a decode engine (PrefillSide / DecodeSide over the loopback connector, as core/disagg/local.py
    drives them): the request is aborted mid-prefill, after its export but before its payload is sent (the
    prefill side must not send it), while it waits for room on the decode side, and while it decodes there."""
    from inferhal.core.disagg import local
    from inferhal.core.disagg.handoff import DecodeSide, PrefillSide

    pre = engine(toy, backend, chunk=8, transfer=PrefillSide())
    dec = engine(toy, backend, seqs=1 if where == "sent_waiting_for_room" else 8, transfer=DecodeSide())
    send, recv = local.connect(pre, dec)
    first = pre.add_request(P[1], GREEDY)  # in sent_waiting_for_room it holds the decode engine's one slot
    rid = pre.add_request(P[0], GREEDY)  # the one aborted: 37 tokens, prefilled in chunks of 8
    finals, exported = {}, set()

    def run(stop=lambda: False) -> bool:
        """Hand-offs, prefill steps and decode steps until ``stop()`` (→ True) or the end (→ False)."""
        while True:
            moved = False
            for payload in pre.transfer.take():
                send.send(payload)
                dec.transfer.add(recv.recv(timeout=30.0))
                moved = True
            if not (moved or pre.has_unfinished() or dec.has_unfinished()):
                return False
            for o in pre.step() if pre.has_unfinished() else ():
                if o.finished:
                    (exported.add if o.finish_reason == "transferred" else lambda r: finals.setdefault(r, o))(
                        o.request_id)
            if stop():
                return True
            for o in dec.step() if dec.has_unfinished() else ():
                if o.finished:
                    finals[o.request_id] = o
            if stop():
                return True

    if where == "prefill_chunk":
        req = pre.scheduler.requests[rid]
        assert run(lambda: 8 <= req.num_computed_tokens < len(P[0]))
        pre.abort([rid])
    elif where == "exported_not_sent":
        assert run(lambda: rid in exported) and rid not in pre.scheduler.requests  # its KV freed there
        pre.abort([rid])  # the client left between the export and the send
    elif where == "sent_waiting_for_room":
        assert run(lambda: rid in dec.transfer.pending())
        dec.abort([rid])
    else:
        assert run(lambda: rid in dec.scheduler.requests and dec.scheduler.requests[rid].num_output_tokens >= 3)
        dec.abort([rid])
    assert not run()
    assert rid not in finals, f"the aborted request ran to its end: {finals.get(rid)}"
    assert finals[first].outputs[0].token_ids == solo(toy, backend, P[1])
    for eng in (pre, dec):
        clean(eng)
        assert not eng.transfer.pending() and not pre.transfer.take()
    got, _ = local.generate(pre, dec, [PROBE], GREEDY)
    assert got[0].outputs[0].token_ids == solo(toy, backend, PROBE)
    clean(pre)
    clean(dec)
