"""Scheduler in plain data: token budget, decode-first chunked prefill, prefix hits, preemption, abort, errors."""

from __future__ import annotations

import pytest
import torch

from inferhal.core.config.schema import SchedulerConfig
from inferhal.core.paging.kv_manager import KVCacheManager
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.core.sampling.params import SamplingParams
from inferhal.core.scheduler.request import Request, Status
from inferhal.core.scheduler.scheduler import RequestError, Scheduler

FULL = KVGroupSpec("full", "full", (0,), (4,), torch.float32)


def make(num_blocks=64, **cfg):
    kv = KVCacheManager([FULL], 4, num_blocks)
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len=64)


def req(rid, n, max_tokens=4, priority=0, first=3):
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True, priority=priority))


def fake_step(s: Scheduler):
    out = s.schedule()
    s.update(out, {q.request_id: 7 for q in out.seqs if q.sample})
    s.kv.check()
    return out


def test_budget_chunked_prefill_and_decode_first():
    s = make(max_num_batched_tokens=10)
    s.add_request(req("a", 3))
    s.add_request(req("b", 20))
    out = fake_step(s)
    assert [(q.request_id, q.num_new) for q in out.seqs] == [("a", 3), ("b", 7)]
    out = fake_step(s)
    # a decodes first (1 token), then b's prefill continues with the rest of the budget
    assert [(q.request_id, q.num_computed, q.num_new, q.sample) for q in out.seqs] == [("a", 3, 1, True), ("b", 7, 9, False)]
    assert out.num_scheduled_tokens <= 10


def test_max_num_seqs():
    s = make(max_num_seqs=2)
    for r in "abc":
        s.add_request(req(r, 2))
    assert [q.request_id for q in fake_step(s).seqs] == ["a", "b"]


def test_prefix_hit_skips_compute():
    s = make()
    s.add_request(req("a", 13))
    while s.has_unfinished():
        fake_step(s)
    s.add_request(req("b", 13))
    out = s.schedule()
    assert out.seqs[0].num_computed == 12 and out.seqs[0].num_new == 1
    assert s.requests["b"].num_cached_tokens == 12


@pytest.mark.parametrize("policy,victim", [("fcfs", "b"), ("priority", "a")])
def test_preemption_when_blocks_run_out(policy, victim):
    s = make(num_blocks=6, policy=policy)
    s.add_request(req("a", 8, max_tokens=12, priority=5))  # a: low priority (larger value)
    s.add_request(req("b", 8, max_tokens=12, priority=0, first=20))
    fake_step(s)
    preempted = []
    for _ in range(12):
        preempted += fake_step(s).preempted
    assert preempted and preempted[0] == victim
    assert s.requests[victim].num_preemptions >= 1
    while s.has_unfinished():
        fake_step(s)
    assert set(s.kv.num_free_blocks().values()) == {6}


def test_abort_frees_everything_at_any_moment():
    s = make(max_num_batched_tokens=5)
    s.add_request(req("a", 12))
    s.add_request(req("b", 3))
    fake_step(s)  # a is mid-prefill, b waiting
    s.abort(["a", "b", "missing"])
    assert not s.has_unfinished() and not s.running and not s.waiting
    assert set(s.kv.num_free_blocks().values()) == {64} and not s.kv.reqs


def test_errors_name_the_problem():
    s = make(num_blocks=3)
    with pytest.raises(RequestError, match="max_model_len=64"):
        s.add_request(req("long", 64))
    with pytest.raises(RequestError, match=r"6 blocks of KV group 'full' \(its pool has 3\)"):
        s.add_request(req("big", 20))
    s.add_request(req("ok", 4, max_tokens=2))  # unaffected by the rejected ones
    with pytest.raises(RequestError, match="already in use"):
        s.add_request(req("ok", 4))
    while s.has_unfinished():
        fake_step(s)


def test_length_limit_by_max_model_len():
    s = make()
    r = req("a", 60, max_tokens=50)
    s.add_request(r)
    while s.has_unfinished():
        fake_step(s)
    assert r.finish_reason == "length" and r.num_tokens == 64 and r.num_output_tokens == 4  # 60 + 4 = max_model_len
    assert not s.kv.reqs


# -- speculative (draft) tokens ---------------------------------------------------------------------------

def decoding(s: Scheduler, rid="a", n=4, max_tokens=8, **params):
    r = Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))
    s.add_request(r)
    fake_step(s)  # prefill; now decoding
    return r


def test_drafts_ride_after_the_decode_token_and_rejected_ones_roll_back():
    s = make()
    r = decoding(s)
    r.spec_token_ids = [20, 21, 22]
    out = s.schedule()
    q = out.seqs[0]
    got = (q.num_computed, q.num_new, list(q.token_ids), tuple(q.spec_token_ids), q.sample)
    assert got == (4, 4, [7, 20, 21, 22], (20, 21, 22), True)
    s.update(out, {"a": [20, 21, 9]})  # two drafts accepted, the third replaced by the verifier's 9
    assert r.output_token_ids == [7, 20, 21, 9] and r.num_computed_tokens == 7 and r.spec_token_ids == []
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (3, 2)
    s.kv.check()
    out = s.schedule()  # next step starts at the first position not verified: the last accepted token's KV stands
    assert (out.seqs[0].num_computed, out.seqs[0].num_new, list(out.seqs[0].token_ids)) == (7, 1, [9])


def test_a_stop_among_accepted_drafts_ends_the_request_there():
    s = make()
    r = decoding(s, stop_token_ids=[21])
    r.spec_token_ids = [20, 21, 22]
    out = s.schedule()
    done = s.update(out, {"a": [20, 21, 22, 5]})
    assert done == [r] and r.is_finished and r.finish_reason == "stop" and r.output_token_ids == [7, 20, 21]
    assert "a" not in s.kv.reqs


def test_max_tokens_cuts_accepted_drafts():
    s = make()
    r = decoding(s, max_tokens=3, ignore_eos=True)
    r.spec_token_ids = [20, 21, 22]
    s.update(s.schedule(), {"a": [20, 21, 22, 5]})
    assert r.output_token_ids == [7, 20, 21] and r.finish_reason == "length"


def test_tokens_that_are_not_an_accepted_prefix_are_refused():
    s = make()
    r = decoding(s)
    r.spec_token_ids = [20, 21]
    out = s.schedule()
    with pytest.raises(ValueError, match="not an accepted prefix"):
        s.update(out, {"a": [20, 99, 5]})


def test_drafts_are_cut_to_the_budget_and_dropped_before_preempting():
    s = make(max_num_batched_tokens=3)
    r = decoding(s, n=2)
    r.spec_token_ids = [20, 21, 22, 23]
    q = s.schedule().seqs[0]
    assert (q.num_new, tuple(q.spec_token_ids)) == (3, (20, 21))
    # a pool with no block beyond the request's own: its drafts (which need a new block) go, nobody is preempted
    s = Scheduler(SchedulerConfig(), KVCacheManager([FULL], 4, 3), max_model_len=64)
    a = decoding(s, "a", n=3)  # block 0 holds positions 0-3, so the decode token needs no new block
    b = decoding(s, "b", n=2, max_tokens=2)  # one block; one left free
    a.spec_token_ids = [20, 21, 22, 23, 24]  # positions 4-8: blocks 1 and 2 of a, one more than is free
    out = s.schedule()
    assert {q.request_id: (q.num_new, tuple(q.spec_token_ids)) for q in out.seqs} == {"a": (1, ()), "b": (1, ())}
    assert out.preempted == () and s.num_preemptions == 0


def test_preemption_forgets_drafts():
    s = make()
    r = decoding(s)
    r.spec_token_ids = [20]
    s._preempt(r)
    assert r.spec_token_ids == [] and r.status is Status.PREEMPTED
