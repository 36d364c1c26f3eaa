"""Asynchronous scheduling (``scheduler.async_scheduling=true``): the host schedules step N+1 while step N
runs and folds step N's tokens in one step late. Outputs equal synchronous mode token for token (greedy and
seeded sampling, logprobs too) under preemption, prefix hits and chunked prefill; a sleep injected into
scheduling is hidden behind the step in flight in async mode and not in sync mode. With a drafter (n-gram,
MTP) the drafts come from the step thread and the outputs still equal synchronous mode's."""

from __future__ import annotations

import time

import pytest

from inferhal import LLM, SamplingParams
from inferhal.core.engine.llm import compose_config

BASE = [(7 * i + 3) % 190 + 1 for i in range(48)]
PROMPTS = [BASE[:5], BASE[:37], BASE[3:20], BASE[:48], [42, 43], BASE[:40] + [9, 9, 9], BASE[:32] + [11] * 10]
SMALL = ["cache.num_blocks=8", "scheduler.max_num_batched_tokens=24", "scheduler.max_num_seqs=5"]


def llm(*overrides):
    return LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=list(overrides)))


def run(mode):
    eng = llm(*SMALL, f"scheduler.async_scheduling={mode}")
    greedy = eng.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    sampled = eng.generate(PROMPTS, [SamplingParams(max_tokens=10, temperature=0.9, seed=i, ignore_eos=True,
                                                    logprobs=2) for i in range(len(PROMPTS))])
    return eng, greedy + sampled


def test_async_outputs_equal_sync_with_preemption_prefix_hits_and_chunking():
    (_, want), (eng, got) = run("false"), run("true")
    assert eng.engine.executor.asynchronous
    for a, b in zip(want, got):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
        assert [p.keys() for p in a.logprobs] == [p.keys() for p in b.logprobs]
        assert all(abs(p[t] - q[t]) < 1e-5 for p, q in zip(a.logprobs, b.logprobs) for t in p)
    assert sum(o.num_preemptions for o in got) > 0 and sum(o.num_cached_tokens for o in got) > 0
    eng.engine.step()  # fold the step still in flight
    assert eng.engine.kv_manager.reqs == {} and not eng.engine.executor.in_flight
    eng.engine.kv_manager.check()


def test_a_host_sleep_in_scheduling_is_hidden_in_async_mode_only():
    """Each step: a 30 ms host sleep in schedule(), a 60 ms "device" sleep in execute (on top of the model)."""
    host, device = 0.03, 0.06
    gaps, walls = {}, {}
    for mode in ("false", "true"):
        eng = llm(f"scheduler.async_scheduling={mode}").engine
        sched, execute = eng.scheduler.schedule, eng.runner.execute

        def slow_schedule(sched=sched):
            time.sleep(host)
            return sched()

        def slow_execute(out, reqs, execute=execute):
            time.sleep(device)
            return execute(out, reqs)

        eng.scheduler.schedule, eng.runner.execute = slow_schedule, slow_execute
        for i in range(4):
            eng.add_request(BASE[i:i + 6], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        walls[mode] = time.perf_counter() - t0
        gaps[mode] = eng.stats["device_gap_s"] / max(1, eng.executor.num_steps - 1)  # per gap between steps
    assert gaps["false"] > 0.9 * host  # sync: the device waits out every sleep
    assert gaps["true"] < 0.25 * host, gaps  # async: the step in flight hides it
    assert walls["true"] < walls["false"] - 12 * 0.5 * host, walls


@pytest.mark.parametrize("model, spec", [
    ("deepseek_v4_tiny", ["spec=ngram", "spec.num_speculative_tokens=3"]),
    ("deepseek_v4_tiny_mtp", ["spec=mtp", "spec.num_speculative_tokens=3"]),  # fit_mtp's head: often accepted
])
def test_async_drafts_give_what_sync_drafts_give(model, spec):
    """The drafter runs on the step thread (placeholders on the host): greedy and seeded sampled outputs,
    logprobs and per-request draft counts equal synchronous mode's, drafts stand often, and nothing leaks."""
    outs, engines = {}, {}
    for mode in ("false", "true"):
        eng = LLM.from_config(compose_config(model, "reference", overrides=[
            *spec, f"scheduler.async_scheduling={mode}"]))
        greedy = eng.generate(PROMPTS, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
        sampled = eng.generate(PROMPTS, [SamplingParams(max_tokens=9 + i % 3, temperature=0.8, seed=i,
                                                        ignore_eos=True, logprobs=1) for i in range(len(PROMPTS))])
        outs[mode], engines[mode] = greedy + sampled, eng.engine
    for a, b in zip(outs["false"], outs["true"]):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
        assert (b.num_draft_tokens, b.num_accepted_tokens) == (a.num_draft_tokens, a.num_accepted_tokens)
        assert all(abs(p[t] - q[t]) < 1e-5 for p, q in zip(a.logprobs, b.logprobs) for t in p)
    eng = engines["true"]
    assert eng.drafting.on_step_thread and eng.executor.asynchronous
    assert 0 < eng.stats["accepted_tokens"] < eng.stats["draft_tokens"]
    eng.step()  # fold the step still in flight
    assert eng.kv_manager.reqs == {} and not eng.executor.in_flight and eng.runner._tokens.keys() <= set()
    eng.kv_manager.check()


def test_async_drafts_under_preemption_prefix_hits_and_chunking_change_no_greedy_token():
    _, want = run("false")
    eng = llm(*SMALL, "spec=ngram", "spec.num_speculative_tokens=4", "scheduler.async_scheduling=true")
    got = eng.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == [o.token_ids for o in want[:len(PROMPTS)]]
    assert sum(o.num_preemptions for o in got) > 0 and sum(o.num_cached_tokens for o in got) > 0
    assert eng.engine.stats["draft_tokens"] > 0
    eng.engine.step()
    assert eng.engine.kv_manager.reqs == {}
    eng.engine.kv_manager.check()
