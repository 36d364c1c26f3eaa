"""The default job: ``inferhal generate`` with ``prompt=...`` and chat ``messages=[...]`` prints real Gemma 3 text,
the same text the Python API produces for the same prompt (the command as a process, default prompt:
test_default_job_process.py)."""

from __future__ import annotations

import pytest

import io

from inferhal.core.cli.main import compose
from inferhal.core.cli.generate import generate

pytestmark = pytest.mark.slow
SMALL = ["sampling.max_tokens=8", "cache.num_blocks=128", "model.max_model_len=512"]


@pytest.fixture(scope="module")
def llm(gemma):
    from inferhal.core.engine.llm import LLM

    return LLM.from_loaded(*gemma, max_model_len=512, num_blocks=128)


def _greedy(llm, ids):
    from inferhal.core.sampling.params import SamplingParams

    return llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0].text


@pytest.fixture
def _cli(gemma, monkeypatch):
    """What ``inferhal generate OVERRIDES`` writes (the command's own composition and generate path), on the
    model this test run loaded once (the subprocess test below loads it the command's own way)."""
    import inferhal.core.models.registry as models

    monkeypatch.setattr(models, "load_model", lambda cfg, backend: gemma[0])

    def run(*overrides: str) -> str:
        buf = io.StringIO()
        assert generate(compose([*overrides, *SMALL], command="generate"), out=buf) == 0
        return buf.getvalue()

    return run


def test_generate_prompt_prints_the_engine_text(llm, _cli):
    out = _cli("prompt=The capital of France is")
    want = _greedy(llm, llm.tokenizer.encode("The capital of France is"))
    assert want.strip() and out.startswith("The capital of France is" + want)


def test_chat_messages_go_through_the_gemma_turn_format(llm, _cli):
    out = _cli("messages=[{role: user, content: 'Name one colour.'}]")
    tok = llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name one colour."}])
    ids = tok.encode(prompt, add_bos=False)
    assert ids[:3] == [tok.bos_token_id, 105, 2364]  # <bos><start_of_turn>user
    want = _greedy(llm, ids)
    assert want.strip() and want in out
