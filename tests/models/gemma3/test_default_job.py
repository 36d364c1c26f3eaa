"""The default job: ``inferhal generate`` (default prompt), ``prompt=...`` and chat ``messages=[...]`` print
real Gemma 3 text, the same text the Python API produces for the same prompt."""

from __future__ import annotations

import pytest

from inferhal.core.cli.main import main

pytestmark = pytest.mark.slow
SMALL = ["sampling.max_tokens=8", "cache.num_blocks=128", "model.max_model_len=512"]


@pytest.fixture(scope="module")
def llm(gemma):
    from inferhal.core.engine.llm import LLM

    return LLM.from_loaded(*gemma, max_model_len=512, num_blocks=128)


def _greedy(llm, ids):
    from inferhal.core.sampling.params import SamplingParams

    return llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0].text


def test_generate_prompt_prints_the_engine_text(llm, capsys):
    assert main(["generate", "prompt=The capital of France is", *SMALL]) == 0
    out = capsys.readouterr().out
    want = _greedy(llm, llm.tokenizer.encode("The capital of France is"))
    assert want.strip() and out.startswith("The capital of France is" + want)


def test_default_generate_prints_text_for_the_default_prompt(llm, capsys):
    from inferhal.core.engine.cli_generate import DEFAULT_PROMPT

    assert main(["generate", *SMALL]) == 0
    out = capsys.readouterr().out
    assert out.startswith(DEFAULT_PROMPT + _greedy(llm, llm.tokenizer.encode(DEFAULT_PROMPT)))


def test_chat_messages_go_through_the_gemma_turn_format(llm, capsys):
    assert main(["generate", "messages=[{role: user, content: 'Name one colour.'}]", *SMALL]) == 0
    out = capsys.readouterr().out
    tok = llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name one colour."}])
    ids = tok.encode(prompt, add_bos=False)
    assert ids[:3] == [tok.bos_token_id, 105, 2364]  # <bos><start_of_turn>user
    want = _greedy(llm, ids)
    assert want.strip() and want in out
