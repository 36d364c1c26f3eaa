"""The tokenizer rebuilt from GGUF metadata equals transformers' GGUF tokenizer (encode and decode; transformers'
answers are stored: tests/fixtures/transformers_oracle.py), and the chat format lays turns out as Gemma does."""

from __future__ import annotations

import pytest

from inferhal.core.errors import UserError
from inferhal.core.models.gemma3.chat import render_turns
from prompts import PROMPTS, long_prompt

TEXTS = PROMPTS + [
    long_prompt(),
    "Hello, world!", "", " ", "  two leading spaces", "trailing spaces   ", "tabs\tand\t\ttabs",
    "many\n\n\n\nnewlines\n", "x\r\ny\r\n", "mixed   \n  \t whitespace runs     end",
    "naïve café façade Ünïcödé", "Привет, мир", "مرحبا بالعالم", "你好，世界", "한국어 텍스트", "emoji 🤖🎉👩‍👩‍👧",
    "\u00a0non-breaking\u2009thin\u200bzero-width", "combining e\u0301 vs \u00e9", "<bos>inline special<eos>",
    "<start_of_turn>model\nhi<end_of_turn>", "<unused5> and [multimodal]", "math: ∑_{i=1}^{n} i² = n(n+1)/2",
    "code:\n    for i in range(10):\n        print(i)  # comment\n", "\x00\x01 control bytes \x7f", "a" * 300,
]


def test_encode_and_decode_equal_transformers(gemma_tokenizer, gemma_path):
    from transformers_oracle import transformers_tokens

    tok = gemma_tokenizer
    want = transformers_tokens("gemma3_270m-tokenizer", gemma_path, TEXTS + ["hi"])
    for text, w in zip(TEXTS, want):
        ids = tok.encode(text)
        assert ids == w["ids"], f"encode({text!r})"
        assert tok.decode(ids) == w["decoded"], f"decode of {text!r}"
        assert tok.decode(ids[1:]) == w["decoded_tail"]
    assert tok.encode("hi", add_bos=False) == want[-1]["plain"]


def test_vocabulary_facts(gemma_tokenizer):
    tok = gemma_tokenizer
    assert tok.bos_token_id == 2 and tok.eos_token_ids[0] == 1 and tok.vocab_size == 262144
    assert tok.encode("<start_of_turn>user\n", add_bos=False)[0] == 105  # control pieces stay whole
    assert tok.decode(tok.encode("ünïcode  \n\n x")[1:]) == "ünïcode  \n\n x"
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_bos=False)
    assert chat[:3] == [2, 105, 2364] and chat.count(2) == 1  # one <bos>, then <start_of_turn>user


def test_chat_turns_follow_gemma_format():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}]
    assert render_turns(msgs) == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
                                  "Hello!<end_of_turn>\n<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n")
    assert render_turns([{"role": "user", "content": "x"}], add_generation_prompt=False) == \
        "<bos><start_of_turn>user\nx<end_of_turn>\n"


def test_a_chat_template_replaces_the_turns_with_gemmas_roles(gemma_tokenizer):
    import copy

    tok = copy.copy(gemma_tokenizer)
    tok.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "model", "content": "y"}]) == \
        "<bos>[user]x[model]y>"


@pytest.mark.parametrize("bad,match", [([], "messages is empty"), ([{"role": "bot", "content": "x"}], "role is 'bot'"),
                                       ([{"content": "x"}], "must be a mapping with 'role' and 'content'"),
                                       ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
                                        "system message may only come first")])
def test_bad_chat_messages_are_named(bad, match):
    with pytest.raises(UserError, match=match):
        render_turns(bad)
