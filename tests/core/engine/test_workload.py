"""Property tests on random workloads: >= 200 requests with random lengths, shared prefixes, random
arrivals and aborts, and KV pools small enough to force preemption.

For every configuration (prefix caching on/off, chunk size, block size, policy): each request that is
not aborted produces exactly the greedy tokens it produces alone; the ref-count invariants hold after
every step; at the end no block is held.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from inferhal.core.config.schema import CacheConfig, SchedulerConfig
from inferhal.core.engine.engine import Engine
from inferhal.core.sampling.params import SamplingParams

N_REQUESTS = 200
KINDS = ("full", "sliding")  # one layer per group keeps 200-request runs fast; both groups are paged
_alone: dict = {}


@pytest.fixture(scope="module")
def model(backend, toy_module):
    return toy_module.make_toy(backend, kinds=KINDS, window=6, max_model_len=128)


def workload(seed: int) -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt, params, arrival step) per request; prompts share a few prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 64) for _ in range(rng.randrange(0, 24))] for _ in range(4)]
    out = []
    for i in range(N_REQUESTS):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 64) for _ in range(rng.randrange(1, 16))]
        sp = SamplingParams(max_tokens=rng.randrange(1, 9), temperature=0.0, ignore_eos=rng.random() < 0.7,
                            priority=rng.randrange(3))
        out.append((prompt, sp, i // 12))
    return out


def alone(model, backend, prompt, sp) -> list[int]:
    key = (tuple(prompt), sp.max_tokens, sp.ignore_eos)
    if key not in _alone:
        eng = Engine(model, backend, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256),
                     CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False))
        rid = eng.add_request(prompt, sp)
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    _alone[key] = o.token_ids
        assert rid is not None
    return _alone[key]


def run(model, backend, seed, block_size, chunk, caching, policy, num_blocks, abort_p=0.03):
    rng = random.Random(seed + 1)
    eng = Engine(model, backend,
                 SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=chunk, policy=policy),
                 CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching))
    jobs = workload(seed)
    ids, outs, aborted = {}, {}, set()
    step = 0
    while len(ids) < len(jobs) or eng.has_unfinished():
        for i, (prompt, sp, at) in enumerate(jobs):
            if at == step and i not in ids.values():
                ids[eng.add_request(prompt, sp)] = i
        live = [r for r in eng.scheduler.requests]
        if live and rng.random() < abort_p:
            victim = rng.choice(live)
            eng.abort([victim])
            aborted.add(victim)
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        eng.kv_manager.check()  # ref counts == holders, free queue == ref 0, cache map consistent
        step += 1
        assert step < 5000, "the workload does not drain"
    assert not eng.kv_manager.reqs, "a finished or aborted request still holds blocks"
    assert eng.kv_manager.num_free_blocks() == eng.kv_manager.num_blocks, "blocks leaked"
    for rid, i in ids.items():
        if rid in aborted:
            continue
        prompt, sp, _ = jobs[i]
        assert outs[rid].token_ids == alone(model, backend, prompt, sp), f"request {i} differs from its solo run"
    return eng, outs


@pytest.mark.slow
@settings(max_examples=4, deadline=None, phases=(Phase.explicit, Phase.generate),  # shrinking a 200-request run is too slow
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([2, 4, 8]), chunk=st.sampled_from([7, 16, 64]),
       caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]))
def test_random_workload_matches_solo_runs(model, backend, seed, block_size, chunk, caching, policy):
    # room for the largest possible request (23 + 15 prompt + 8 output tokens) and a half: forces preemption
    probe = Engine(model, backend, SchedulerConfig(), CacheConfig(block_size=block_size, num_blocks=1))
    need = max(probe.kv_manager.max_blocks_one_step(46, chunk).values())
    eng, _ = run(model, backend, seed, block_size, chunk, caching, policy, need + need // 2)
    assert eng.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"


def test_caching_and_chunking_do_not_change_outputs(model, backend):
    seed = 1234
    results = []
    for caching, chunk in ((True, 64), (False, 64), (True, 5)):
        eng, outs = run(model, backend, seed, 4, chunk, caching, "fcfs", 40, abort_p=0.0)
        results.append({rid: o.token_ids for rid, o in outs.items()})
        if caching:
            assert sum(o.num_cached_tokens for o in outs.values()) > 0, "shared prefixes never hit the cache"
    assert results[0] == results[1] == results[2]


@pytest.fixture(scope="module")
def tiny_mtp():
    """The tiny DeepSeek-V4 with its fitted MTP head: window, CSA and HCA KV groups beside the drafter's."""
    from inferhal import LLM
    from inferhal.core.engine.llm import compose_config

    return LLM.from_config(compose_config("deepseek_v4_tiny_mtp", "reference", overrides=["cache.num_blocks=256"]))


def hybrid_workload(seed: int, n: int = 30) -> list[tuple[list[int], SamplingParams, int]]:
    """Prompts with shared prefixes and repeated runs (so n-gram drafts hit), random lengths and arrivals."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 180) for _ in range(rng.randrange(0, 40))] for _ in range(3)]
    out = []
    for i in range(n):
        repeat = [rng.randrange(3, 180) for _ in range(rng.randrange(1, 6))] * rng.randrange(1, 5)
        prompt = rng.choice(prefixes) + repeat + [rng.randrange(3, 180) for _ in range(rng.randrange(1, 16))]
        out.append((prompt, SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0, ignore_eos=True), i // 6))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method,k,async_scheduling", [("ngram", 3, False), ("mtp", 3, True), ("none", 0, True)])
def test_hybrid_model_with_drafts_async_and_preemption_matches_solo_runs(tiny_mtp, method, k, async_scheduling):
    """The same property on the tiny V4 (a sliding window beside compressed groups, the drafter's KV group), with
    draft tokens, async scheduling, aborts and a pool small enough to preempt: every request that is not aborted
    gives its solo greedy tokens, and no block is left."""
    from inferhal.core.config.schema import SpecConfig

    e = tiny_mtp.engine
    spec = SpecConfig(method=method, num_speculative_tokens=k, ngram_max=3) if k else SpecConfig()
    eng = Engine(e.loaded, e.backend, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                                      async_scheduling=async_scheduling),
                 CacheConfig(num_blocks=10), e.max_model_len, spec=spec)
    rng, jobs = random.Random(7), hybrid_workload(11)
    ids, outs, aborted, step = {}, {}, set(), 0
    while len(ids) < len(jobs) or eng.has_unfinished():
        for i, (prompt, sp, at) in enumerate(jobs):
            if at == step:
                ids[eng.add_request(prompt, sp)] = i
        live = [r for r in ids if r not in outs and r not in aborted]
        if live and rng.random() < 0.05:
            victim = live[rng.randrange(len(live))]
            eng.abort([victim])
            aborted.add(victim)
        for o in eng.step():
            if o.finished and o.request_id not in aborted:
                outs[o.request_id] = o.outputs[0].token_ids
        step += 1
        assert step < 5000, "the workload does not drain"
    eng.kv_manager.check()
    assert not eng.kv_manager.reqs and eng.scheduler.num_preemptions > 0
    assert len(outs) + len(aborted) == len(jobs) and aborted
    for rid, got in outs.items():
        prompt, sp, _ = jobs[ids[rid]]
        alone = tiny_mtp.generate([prompt], sp)[0].outputs[0].token_ids  # no drafts, no pressure, no neighbours
        assert list(got) == list(alone), f"request {ids[rid]} differs from its solo run"
    if k:
        assert eng.scheduler.num_draft_tokens > 0
