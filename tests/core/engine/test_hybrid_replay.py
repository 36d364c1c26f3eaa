"""Bounded window replay for a hybrid model (the tiny DeepSeek-V4: a window group beside CSA/HCA groups):
a prefix hit whose compressed blocks are cached but whose window blocks were evicted recomputes only the
replay span, writing only the window groups below the hit, and gives exactly the cold run's outputs."""

from __future__ import annotations

import random

import pytest

from inferhal.core.engine.llm import LLM
from inferhal.core.paging.replay import replay_span
from inferhal.core.sampling.params import SamplingParams

OV = ["backend.batch_invariant=true", "model.max_model_len=1280", "model.arch.max_position_embeddings=2048",
      "cache.block_size=16", "cache.num_blocks=200"]
SP = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 190) for _ in range(n)]


def _evict_windows(llm) -> None:
    kv = llm.engine.kv_manager
    for s in kv.specs:
        if s.kind == "sliding":
            kv.pools[s.name].reset_prefix_cache()


@pytest.fixture(scope="module")
def prefix():
    return _prompt(1024, 0)


def test_replay_equals_cold_run_and_recomputes_only_the_span(prefix):
    llm = LLM("deepseek_v4_tiny", backend="reference", overrides=OV)
    span = replay_span(llm.engine.kv_manager.specs)
    assert 0 < span < 200  # the tiny model's windows: (16-1) x 5 + (8-1) x 2 x 2 + (16-1) x 1
    first = llm.generate([prefix + [7]], SP)[0]
    assert first.num_cached_tokens == 0
    _evict_windows(llm)
    second = llm.generate([prefix + [9, 11]], SP)[0]
    c = 1024  # the cached full blocks of the prefix (64 of 16 tokens)
    assert second.num_cached_tokens == c - span and second.num_replayed_tokens == span
    cold = LLM("deepseek_v4_tiny", backend="reference", overrides=OV + ["cache.enable_prefix_caching=false"])
    want = cold.generate([prefix + [9, 11]], SP)[0]
    # exact: bit for bit (batch-invariant products, so chunking the prompt otherwise changes nothing)
    assert second.token_ids == want.token_ids and second.logprobs == want.logprobs
    llm.engine.kv_manager.check()
    # the window blocks rebuilt below the hit are never cached; the hit's compressed blocks stay shared
    third = llm.generate([prefix + [9, 11]], SP)[0]
    assert third.token_ids == want.token_ids


def test_resume_after_preemption_replays_the_windows(prefix):
    """Preempted while decoding, its window blocks evicted: the request resumes from its cached compressed
    blocks, recomputes the replay span, and ends exactly as a run that was never preempted."""
    sp = SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, ignore_eos=True)
    llm = LLM("deepseek_v4_tiny", backend="reference", overrides=OV)
    eng = llm.engine
    span = replay_span(eng.kv_manager.specs)
    rid = eng.add_request(prefix[:700], sp)
    done = None
    for _ in range(400):
        req = eng.scheduler.requests.get(rid)
        if req is not None and req.num_output_tokens == 9 and not req.num_preemptions:
            at = req.num_computed_tokens
            eng.scheduler._preempt(req)  # as a full pool would
            _evict_windows(llm)
        for o in eng.step():
            if o.finished:
                done = o
        if done:
            break
    c = at // 16 * 16  # the full blocks cached at the preemption
    assert done.num_preemptions == 1 and done.num_replayed_tokens == span and c - span > 0
    cold = LLM("deepseek_v4_tiny", backend="reference", overrides=OV + ["cache.enable_prefix_caching=false"])
    want = cold.generate([prefix[:700]], sp)[0]
    assert done.token_ids == want.token_ids
    # not bit for bit: the resumed step recomputes generated tokens in one multi-token step where the
    # uninterrupted run decoded them one at a time, and the reference's attention rounds a row differently
    # in another chunk (a preemption recomputed in full, with no replay, differs from it by the same 1e-6)
    worst = max(abs(a[k] - b[k]) for a, b in zip(done.logprobs, want.logprobs) for k in a if k in b)
    assert worst < 1e-5


def test_cached_windows_need_no_replay(prefix):
    llm = LLM("deepseek_v4_tiny", backend="reference", overrides=OV)
    llm.generate([prefix + [7]], SP)
    out = llm.generate([prefix + [9, 11]], SP)[0]
    assert out.num_cached_tokens == 1024 and out.num_replayed_tokens == 0


def test_replay_off_recomputes_everything(prefix):
    llm = LLM("deepseek_v4_tiny", backend="reference", overrides=OV + ["scheduler.sliding_replay=off"])
    llm.generate([prefix + [7]], SP)
    _evict_windows(llm)
    out = llm.generate([prefix + [9, 11]], SP)[0]
    assert out.num_cached_tokens == 0 and out.num_replayed_tokens == 0
