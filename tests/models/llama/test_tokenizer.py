"""The byte-level BPE tokenizer rebuilt from the SmolLM2 GGUF equals transformers' GGUF tokenizer on text
without digits; digits split one by one (llama.cpp's ``smollm`` pre-tokenizer and SmolLM2's own
tokenizer.json; transformers' GGUF conversion leaves that step out; its answers are stored:
tests/fixtures/transformers_oracle.py). The file's chat template renders,
and bad messages are UserErrors (the sandbox: tests/models/gguf/test_chat.py)."""

from __future__ import annotations

import pytest

from inferhal.core.errors import UserError

TEXTS = ["The capital of France is", "def fibonacci(n):\n    return n", "naïve café Ünïcödé", "Привет, мир",
         "你好，世界", "emoji 🤖🎉", "  two leading spaces", "tabs\tand\n\nnewlines\r\n", "<|im_start|>user\nHi<|im_end|>",
         "it's they're we'll", "a" * 200, ""]


def test_encode_and_decode_equal_transformers(smollm, smollm_path):
    from transformers_oracle import transformers_tokens

    tok = smollm[0].tokenizer
    for text, w in zip(TEXTS, transformers_tokens("smollm2_135m_instruct-tokenizer", smollm_path, TEXTS)):
        ids = tok.encode(text)
        assert ids == w["plain"], f"encode({text!r})"
        assert tok.decode(ids) == text


def test_vocabulary_facts_and_digits(smollm):
    tok = smollm[0].tokenizer
    assert tok.vocab_size == 49152 and tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    assert tok.encode("<|im_start|>user", add_bos=False)[0] == 1  # control tokens stay whole
    ids = tok.encode("in 2024")
    assert [tok.decode([i]) for i in ids] == ["in", " ", "2", "0", "2", "4"]  # one piece per digit
    assert tok.decode(tok.encode("x")) == "x"


def test_chat_template_from_the_file(smollm):
    tok = smollm[0].tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(UserError, match="role"):
        tok.apply_chat_template([{"role": "wizard", "content": "Hi"}])
    with pytest.raises(UserError, match="empty"):
        tok.apply_chat_template([])


def test_chat_through_generate_cli(smollm, capsys):
    from inferhal.core.cli.main import compose
    from inferhal.core.cli.generate import generate
    from inferhal.core.engine.llm import LLM

    cfg = compose(["model=smollm2_135m_instruct", "messages=[{role: user, content: 'What is the capital of France?'}]",
                   "sampling.max_tokens=16", "sampling.temperature=0"], command="generate")
    llm = LLM.from_loaded(*smollm, max_model_len=512)
    assert generate(cfg, llm=llm) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "<|im_end|>" not in out and "finish: stop" in out  # the end-of-turn token is not shown
