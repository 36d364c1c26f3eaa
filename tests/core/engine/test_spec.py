"""n-gram speculative decoding through the engine: greedy output and logprobs as without drafts, limits kept,
sampled requests drafted too, bad spec configs refused before anything loads."""

from __future__ import annotations

import pytest

from inferhal import LLM, SamplingParams
from inferhal.core.engine.llm import compose_config
from inferhal.core.errors import UserError

PROMPTS = [[5, 6, 7, 8] * 4, [1, 2, 3, 4, 5], [9, 10, 9, 10, 9], [42]]
SPEC = ["spec.method=ngram", "spec.num_speculative_tokens=3"]


def llm(*overrides):
    cfg = compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64", *overrides])
    return LLM.from_config(cfg)


@pytest.fixture(scope="module")
def pair():
    return llm(), llm(*SPEC)


def test_greedy_tokens_and_logprobs_match_decoding_without_drafts(pair):
    plain, spec = pair
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    want, got = plain.generate(PROMPTS, sp), spec.generate(PROMPTS, sp)
    st = spec.engine.stats
    assert st["draft_tokens"] > 0 and st["accepted_tokens"] > 0  # drafts were made, and some stood
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and len(b.outputs[0].token_ids) == 24
        assert len(b.outputs[0].logprobs) == 24
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)
    assert spec.engine.kv_manager.reqs == {} and spec.engine.scheduler.running == []


def test_stop_tokens_and_max_tokens_land_where_they_would_without_drafts(pair):
    plain, spec = pair
    free = plain.generate(PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    stop = free.outputs[0].token_ids[9]  # a token the greedy continuation reaches
    for sp in (SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop], ignore_eos=True),
               SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)):
        a, b = plain.generate(PROMPTS, sp), spec.generate(PROMPTS, sp)
        for x, y in zip(a, b):
            got, want = y.outputs[0], x.outputs[0]
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)


def test_sampled_requests_are_drafted_and_reproducible_by_seed(pair):
    _, spec = pair
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=11, ignore_eos=True, logprobs=1)
    before = spec.engine.stats["draft_tokens"]
    one, two = spec.generate(PROMPTS, sp), spec.generate(PROMPTS, sp)
    assert spec.engine.stats["draft_tokens"] > before
    for x, y in zip(one, two):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids and len(x.outputs[0].token_ids) == 16
        assert len(x.outputs[0].logprobs) == 16


def test_max_model_len_is_never_passed_by_a_draft():
    spec = llm(*SPEC, "model.max_model_len=20")
    out = spec.generate([[5, 6, 7, 8] * 4], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 20 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("overrides, words", [
    (["spec.method=eagle"], "spec.method must be one of"),
    (["spec.method=ngram"], "num_speculative_tokens >= 1"),
    (["spec.num_speculative_tokens=2"], "no effect with spec.method=none"),
    (SPEC + ["spec.disable_by_batch_size=-1"], "disable_by_batch_size must be >= 0"),
])
def test_bad_spec_config_is_a_clear_error(overrides, words):
    with pytest.raises(UserError, match=words):
        llm(*overrides)


def test_drafting_pauses_while_the_batch_is_at_disable_by_batch_size(pair):
    plain, _ = pair
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    busy = llm(*SPEC, "spec.disable_by_batch_size=2")
    want = plain.generate(PROMPTS, sp)
    got = busy.generate(PROMPTS, sp)  # 4 running: no drafts at all
    assert busy.engine.stats["draft_tokens"] == 0
    assert busy.generate(PROMPTS[:1], sp)[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert busy.engine.stats["draft_tokens"] > 0  # alone, it drafts
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
