"""The model runner's reused logits buffer: logits of one step never leak into another's results; greedy
steps without logprobs take their tokens from ``forward_greedy`` (``lm_head.argmax``), the same tokens."""

from __future__ import annotations

import pytest

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


class DeadAfter:
    """A fake grammar: any token for ``n`` tokens, then none (a dead end); records what it was asked."""

    terminated = False

    def __init__(self, n: int) -> None:
        self.n, self.accepted = n, []

    def fill(self, bitmask, row: int) -> None:
        if len(self.accepted) >= self.n:
            bitmask[row] = 0

    def accept(self, token: int) -> bool:
        if len(self.accepted) >= self.n:
            return False
        self.accepted.append(token)
        return True

    def rollback(self, k: int) -> None:
        del self.accepted[len(self.accepted) - k:]


@pytest.mark.parametrize("mode", ["sync", "async", "ngram", "async_ngram"])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_dead_end_ends_the_request_with_its_own_reason(mode, ignore_eos):
    """The dead end lets only the end-of-sequence token through and the request finishes at once with
    ``grammar_dead_end`` (also with ``ignore_eos``, which would otherwise run to ``max_tokens``); its batch
    neighbour runs on untouched."""
    over = {"sync": [], "async": ["scheduler.async_scheduling=true"], "ngram": ["spec=ngram"],
            "async_ngram": ["spec=ngram", "scheduler.async_scheduling=true"]}[mode]
    llm = LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64", *over]))
    eng, eos = llm.engine, 191
    eng.runner.bitmasks.eos_token_ids = (eos,)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=ignore_eos)
    alone = llm.generate([PROMPTS[1]], sp)[0].outputs[0].token_ids
    req = eng.make_request([5, 6, 5, 6, 5, 6, 5, 6], sp)  # a repeating prompt: n-gram drafts to verify
    req.eos_token_ids, req.grammar = (eos,), DeadAfter(2)
    rid = eng.add(req)
    other = eng.add_request(PROMPTS[1], sp)
    outs = {}
    while eng.has_unfinished() or eng.executor.in_flight:
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    got = outs[rid].outputs[0]
    assert got.finish_reason == "grammar_dead_end"
    assert got.token_ids[:2] == req.grammar.accepted and got.token_ids[2:] == [eos]
    if mode.endswith("ngram"):  # the dead end sat at a draft position that verification reached
        assert outs[rid].num_draft_tokens >= 1
    other = outs[other].outputs[0]
    assert other.token_ids == alone and other.finish_reason == "length"
    assert eng.kv_manager.reqs == {}


def test_the_bitmask_is_filled_beside_the_forward_not_after_it():
    """The fill (xgrammar's, here a fake's) starts on its own thread before the forward returns; the step's
    tokens are those of the masked logits all the same."""
    import threading
    import time

    llm = LLM.from_config(compose_config("deepseek_v4_tiny", "reference", overrides=["cache.num_blocks=64"]))
    eng, model, log = llm.engine, llm.engine.loaded.model, []
    real = model.forward

    def forward(*a):
        log.append(("forward", threading.get_ident(), time.perf_counter()))
        time.sleep(0.05)
        out = real(*a)
        log.append(("forward done", threading.get_ident(), time.perf_counter()))
        return out

    class Only(DeadAfter):  # allows token 7 only
        def fill(self, bitmask, row):
            log.append(("fill", threading.get_ident(), time.perf_counter()))
            bitmask[row] = 0
            bitmask[row, 0] = 1 << 7

    model.forward = forward
    req = eng.make_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    req.grammar = Only(99)
    eng.add(req)
    outs = [o for _ in range(3) for o in eng.step()]
    assert outs[-1].outputs[0].token_ids == [7, 7, 7]
    fills = [e for e in log if e[0] == "fill"]
    assert len(fills) == 3 and all(f[1] != threading.get_ident() for f in fills)
    for f in fills:  # each fill began before its step's forward was done
        done = min(e[2] for e in log if e[0] == "forward done" and e[2] > f[2])
        start = max(e[2] for e in log if e[0] == "forward" and e[2] <= done)
        assert f[2] < done and f[2] - start < 0.05
    assert eng.stats["fill_s"] > 0
