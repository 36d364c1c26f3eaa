"""Bad input to ``inferhal generate`` and ``LLM.generate``: an empty prompt is an error, not the default
prompt or an empty generation; a refused prompt is never echoed; an error mid-stream starts on a line of
its own; ``sampling.logprobs`` reaches a batch job's rows."""

from __future__ import annotations

import io
import json

import pytest

from inferhal import LLM, SamplingParams
from inferhal.core.cli.main import compose
from inferhal.core.cli.generate import generate
from inferhal.core.errors import UserError


@pytest.fixture(scope="module")
def llm(backend, toy_module):
    return LLM(loaded_model=toy_module.make_toy(backend), active_backend=backend, num_blocks=64, block_size=4)


def test_an_empty_prompt_is_an_error_in_the_python_api(llm):
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        llm.generate(["hi", ""], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.engine.add_request([], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()  # the good prompt did not start either
    with pytest.raises(UserError, match="the prompt is empty"):
        next(iter(llm.stream([""])))


@pytest.mark.parametrize("prompts,needle", [
    (None, "prompts must be a string, a list of token ids, or a list of those; got NoneType"),
    (5, "got int"), ({"a": 1}, "got dict"),
    ([[1.5, 2]], "prompt 0: a prompt must be a string or a list of integer token ids, got a list holding float"),
    ([[1, "2"]], "got a list holding str"),
])
def test_prompts_that_are_not_text_or_token_ids_are_named(llm, prompts, needle):
    with pytest.raises(UserError, match=needle):
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_more_logprobs_than_the_vocabulary_has_tokens_are_refused(llm):
    v = llm.engine.model.vocab_size
    with pytest.raises(UserError, match=rf"prompt 0: SamplingParams.logprobs={v + 1} asks for more log-probabilities "
                                        rf"than the vocabulary has tokens \({v}\)"):
        llm.generate(["hi"], SamplingParams(max_tokens=1, logprobs=v + 1))
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=1, logprobs=v))[0].outputs[0].logprobs[0].keys() == set(range(v))


@pytest.mark.parametrize("arg,needle", [("prompt=", "prompt is empty"), ("prompt_ids=[]", "prompt_ids is empty"),
                                        ("messages=[]", "messages is empty")])
def test_an_empty_prompt_is_an_error_in_the_cli(llm, arg, needle):
    out = io.StringIO()
    with pytest.raises(UserError, match=needle):
        generate(compose([arg], "generate"), llm, out)
    assert out.getvalue() == ""


def test_a_prompt_too_long_is_not_echoed(llm):
    out = io.StringIO()
    with pytest.raises(UserError, match="does not fit max_model_len"):
        generate(compose(["prompt=" + "x" * 600, "sampling.max_tokens=3"], "generate"), llm, out)
    assert out.getvalue() == ""  # was: the whole prompt, then the error glued to its last word


def test_an_error_mid_stream_starts_on_a_line_of_its_own(llm):
    def fail(engine):
        raise RuntimeError("step failed")

    llm.engine.step_hooks.append(fail)
    out = io.StringIO()
    try:
        with pytest.raises(RuntimeError, match="step failed"):
            generate(compose(["prompt=hello", "sampling.max_tokens=4"], "generate"), llm, out)
    finally:
        llm.engine.step_hooks.remove(fail)
    assert out.getvalue().startswith("hello") and out.getvalue().endswith("\n")
    assert not llm.engine.has_unfinished()


def test_logprobs_reach_the_rows_of_a_batch_job(llm, tmp_path):
    jobs = tmp_path / "p.jsonl"
    jobs.write_text('{"prompt": "abc"}\n{"prompt": "hi", "logprobs": 0}\n')
    res = tmp_path / "out.jsonl"
    cfg = compose([f"prompts_file={jobs}", f"output={res}", "sampling.max_tokens=3", "sampling.logprobs=2"], "generate")
    assert generate(cfg, llm, io.StringIO()) == 0
    rows = [json.loads(x) for x in res.read_text().splitlines()]
    assert len(rows[0]["logprobs"]) == len(rows[0]["token_ids"])
    assert all(str(t) in pos for t, pos in zip(rows[0]["token_ids"], rows[0]["logprobs"]))  # the chosen token
    assert "logprobs" not in rows[1]  # that line asked for none
