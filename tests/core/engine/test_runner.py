"""The model runner's reused logits buffer: logits of one step never leak into another's results; greedy
steps without logprobs take their tokens from ``forward_greedy`` (``lm_head.argmax``), the same tokens."""

from __future__ import annotations

from inferhal import LLM, SamplingParams
from inferhal.core.engine.llm import compose_config

PROMPTS = [[1, 2, 3, 4, 5], [7, 150, 33, 9, 81, 2, 64, 11, 5, 99, 120, 17, 3], [42]]


def test_batched_logprobs_over_steps_equal_each_request_alone():
    llm = LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64"]))
    sp = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True)
    together = llm.generate(PROMPTS, sp)  # the prompts finish prefill on different steps: rows come and go
    runner = llm.engine.runner
    assert runner._logits.shape[0] >= 1 and runner._logits.shape[1] == llm.engine.loaded.model.vocab_size
    for prompt, got in zip(PROMPTS, together):
        alone = llm.generate([prompt], sp)[0]
        assert got.outputs[0].token_ids == alone.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, alone.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_greedy_steps_skip_the_logits_and_give_the_same_tokens():
    llm = LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64"]))
    model, calls = llm.engine.loaded.model, []
    real = model.forward_greedy
    model.forward_greedy = lambda *a: calls.append(1) or real(*a)
    assert llm.engine.runner.greedy_head
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert calls and llm.engine.runner._logits.shape[0] == 0  # no logits buffer was ever needed
    n = len(calls)
    logged = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True))
    assert len(calls) == n  # logprobs need the logits
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in logged]
