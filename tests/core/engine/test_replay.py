"""Bounded sliding-window replay (the rule is in inferhal.core.paging.replay), on an all-sliding toy model:
a request preempted after C tokens resumes at max(0, C - span), and in exact mode its output is the
output it has alone."""

from __future__ import annotations

import pytest

from inferhal.core.config.schema import CacheConfig, SchedulerConfig
from inferhal.core.engine.engine import Engine
from inferhal.core.paging.replay import replay_span, replay_start
from inferhal.core.sampling.params import SamplingParams

SP = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[3 + (7 * i + j) % 60 for j in range(5 + 4 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def model(backend, toy_module):
    return toy_module.make_toy(backend, kinds=("sliding", "sliding"), window=4, max_model_len=128)


def solo(model, backend, prompt):
    eng = Engine(model, backend, SchedulerConfig(), CacheConfig(block_size=2, num_blocks=64))
    eng.add_request(prompt, SP)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                return o.token_ids


@pytest.mark.parametrize("mode", ["exact", "window", "off"])
def test_resume_recomputes_only_what_the_window_needs(model, backend, mode):
    eng = Engine(model, backend, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, sliding_replay=mode),
                 CacheConfig(block_size=2, num_blocks=40, enable_prefix_caching=False))
    span = replay_span(eng.specs, mode)
    assert span == {"exact": 2 * 3, "window": 4, "off": None}[mode]  # 2 layers x (window - 1) | window | all
    ids = [eng.add_request(p, SP) for p in PROMPTS]
    first_seq = {}  # request id -> num_computed of its first scheduled chunk after the preemption
    done, preempted = {}, []
    for step in range(200):
        if step in (8, 14):  # preempt a decoding request by recompute (as a full pool would)
            victim = eng.scheduler.running[0]
            preempted.append((victim.request_id, victim.num_computed_tokens))
            first_seq.pop(victim.request_id, None)
            eng.scheduler._preempt(victim)
        out = eng.scheduler.schedule()
        for q in out.seqs:
            if any(rid == q.request_id for rid, _ in preempted):
                first_seq.setdefault(q.request_id, q.num_computed)
        res = eng.runner.execute(out, eng.scheduler.requests)
        for r in eng.scheduler.update(out, res.tokens):
            if r.is_finished:
                done[r.request_id] = r.output_token_ids
        eng.kv_manager.check()
        if not eng.has_unfinished():
            break
    assert set(eng.kv_manager.num_free_blocks().values()) == {40} and len(preempted) == 2
    for rid, at in preempted:
        assert at > 6  # preempted while decoding, past the replay span
        assert first_seq[rid] == replay_start(at, span)  # resumes at max(0, C - span): 0 when off
    if mode != "window":  # exact replay (and full recompute) reproduce the solo output
        for p, rid in zip(PROMPTS, ids):
            assert done[rid] == solo(model, backend, p)
