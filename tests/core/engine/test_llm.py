"""The offline API over the toy model: generation, batch independence, logprobs, streaming, bad input."""

from __future__ import annotations

import pytest

from inferhal import LLM, SamplingParams
from inferhal.core.errors import UserError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(backend, toy_module):
    return LLM(loaded_model=toy_module.make_toy(backend), active_backend=backend, num_blocks=96, block_size=4)


def test_batched_greedy_equals_alone(llm):
    prompts = ["hello world", "abc", list(range(3, 30))]
    batched = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, batched):
        assert out.token_ids == llm.generate([p], GREEDY)[0].token_ids
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert llm.engine.kv_manager.num_free_blocks() == llm.engine.kv_manager.num_blocks


def test_seeded_sampling_is_batch_independent(llm):
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    alone = llm.generate(["seeded"], sp)[0].token_ids
    mixed = llm.generate(["other one", "seeded", "third"], [GREEDY, sp, SamplingParams(temperature=1.0, seed=1)])
    assert mixed[1].token_ids == alone
    assert llm.generate(["seeded"], SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=8,
                                                  ignore_eos=True))[0].token_ids != alone


def test_logprobs_top_k_and_chosen(llm):
    out = llm.generate(["log probs"], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert len(lp) == 3 and tok in lp
        assert max(lp, key=lp.get) == tok  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values())


def test_stream_matches_generate(llm):
    full = llm.generate(["streamed"], GREEDY)[0]
    got, text = [], ""
    for o in llm.stream(["streamed"], GREEDY):
        got += o.new_token_ids
        text += o.new_text
    assert got == full.token_ids and text == full.text and o.finished


def test_stop_token_and_stop_string(llm):
    base = llm.generate(["stops"], GREEDY)[0]
    tok = base.token_ids[3]
    out = llm.generate(["stops"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
    if len(base.text) >= 2:
        s = base.text[1:3]
        out = llm.generate(["stops"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[s]))[0]
        assert out.finish_reason == "stop" and s not in out.text and base.text.startswith(out.text)


def test_bad_input_errors_name_the_problem(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="unknown sampling field.*'temprature'.*temperature"):
        SamplingParams(temprature=0.5)
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):
        llm.generate(["ok", "x" * 600], GREEDY)
    assert not llm.engine.has_unfinished()  # nothing ran
    with pytest.raises(UserError, match="unknown option 'max_num_seq'"):
        LLM(loaded_model=llm.engine.loaded, active_backend=llm.engine.backend, max_num_seq=3)


def test_bad_request_leaves_others_untouched(llm):
    eng = llm.engine
    good = eng.add_request("fine prompt", GREEDY)
    with pytest.raises(ValueError, match="blocks of KV group"):
        eng.add_request("x" * 300, SamplingParams(max_tokens=200, temperature=0.0))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs[good].token_ids == llm.generate(["fine prompt"], GREEDY)[0].token_ids


def test_llm_refuses_a_parallel_layout_it_would_run_in_one_process():
    import pytest

    from inferhal import LLM
    from inferhal.core.errors import UserError

    with pytest.raises(UserError, match=r"parallel.ep=2, parallel.dp=2 are refused by LLM\(\.\.\.\), which reads no "
                                        r"parallel field .*; LLM\(\.\.\.\) is one process: `inferhal generate parallel=\.\.\.`"):
        LLM("deepseek_v4_tiny", overrides=["parallel=dep2"])
