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
    assert s.kv.pool.num_free_blocks() == 6


def test_abort_frees_everything_at_any_moment():
    s = make(max_num_batched_tokens=5)
    s.add_request(req("a", 12))
    s.add_request(req("b", 3))
    fake_step(s)  # a is mid-prefill, b waiting
    s.abort(["a", "b", "missing"])
    assert not s.has_unfinished() and not s.running and not s.waiting
    assert s.kv.pool.num_free_blocks() == 64 and not s.kv.reqs


def test_errors_name_the_problem():
    s = make(num_blocks=3)
    with pytest.raises(RequestError, match="max_model_len=64"):
        s.add_request(req("long", 64))
    with pytest.raises(RequestError, match="KV blocks but the pool has only 3"):
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
