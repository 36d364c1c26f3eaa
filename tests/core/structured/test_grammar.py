"""Structured-output constraints (core/structured): the request field's validation, and xgrammar grammars
compiled against a small character-level vocabulary: the bitmask allows exactly the continuations the
constraint admits, rollback restores the state, invalid constraints are clear errors, grammars are cached."""

from __future__ import annotations

import pytest
import torch

from inferhal.core.structured.grammar import GrammarCompiler, GrammarError, allocate_bitmask
from inferhal.core.structured.params import StructuredOutputs, StructuredOutputsError

CHARS = list('{}[]":,. -0123456789abcdefghijklmnopqrstuvwxyzABC\n')
EOS = len(CHARS)  # id of </s>


class CharTokenizer:
    """One token per character plus an end-of-sequence special token, as a `tokenizers` backend."""

    def __init__(self) -> None:
        from tokenizers import AddedToken, Tokenizer
        from tokenizers.models import WordLevel

        self.backend = Tokenizer(WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="a"))
        self.backend.add_special_tokens([AddedToken("</s>", special=True)])


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(CharTokenizer(), len(CHARS) + 3, [EOS])  # 2 padding ids past the vocabulary


def allowed(m, vocab: int) -> set[str]:
    bm = allocate_bitmask(1, vocab)
    m.fill(bm, 0)
    ids = [i for i in range(vocab) if (int(bm[0, i // 32]) >> (i % 32)) & 1]
    return {CHARS[i] if i < len(CHARS) else ("</s>" if i == EOS else f"#{i}") for i in ids}


def feed(m, text: str) -> None:
    for c in text:
        assert m.accept(CHARS.index(c)), f"{c!r} refused"


def test_exactly_one_constraint_is_set_and_bad_values_name_the_field():
    assert StructuredOutputs(regex="a+").kind == "regex"
    assert StructuredOutputs.coerce({"choice": ["yes", "no"]}).choice == ("yes", "no")
    assert StructuredOutputs(json='{"type": "integer"}').json == {"type": "integer"}
    for bad, msg in [({}, "set exactly one of"), ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
                     ({"choice": []}, "choice must be a non-empty list"), ({"json": "{not json"}, "json is not valid JSON"),
                     ({"regex": ""}, "regex must be a non-empty string"), ({"json_object": "yes"}, "true or false")]:
        with pytest.raises(StructuredOutputsError, match=msg):
            StructuredOutputs(**bad)
    with pytest.raises(StructuredOutputsError, match="unknown field.*'schema'"):
        StructuredOutputs.coerce({"schema": {}})
    a = StructuredOutputs(json={"b": 1, "a": {"type": "string"}})
    assert a.key() == StructuredOutputs(json='{"a": {"type": "string"}, "b": 1}').key()  # canonical: one compile


def test_json_schema_mask_and_rollback(compiler):
    v = compiler.vocab_size
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    m = compiler.matcher(StructuredOutputs(json=schema))
    assert allowed(m, v) == {"{"}
    feed(m, '{"n": ')  # xgrammar's fixed separators: ", " and ": " (as json.dumps writes)
    assert allowed(m, v) >= set("123456789-") and "a" not in allowed(m, v) and "</s>" not in allowed(m, v)
    feed(m, "12")
    m.rollback(2)  # back to just after '": '
    assert "}" not in allowed(m, v)
    feed(m, "42}")
    assert allowed(m, v) == {"</s>"}  # the object is complete: only the end
    assert not m.accept(CHARS.index("a")) and m.accept(EOS) and m.terminated
    assert "#" + str(v - 1) not in allowed(compiler.matcher(StructuredOutputs(json_object=True)), v)  # padding ids never


def test_regex_choice_and_ebnf(compiler):
    v = compiler.vocab_size
    m = compiler.matcher(StructuredOutputs(regex="[0-9]{3}-[a-c]"))
    feed(m, "123")
    assert allowed(m, v) == {"-"}
    c = compiler.matcher(StructuredOutputs(choice=["yes", "no"]))
    assert allowed(c, v) == {"y", "n"}
    g = compiler.matcher(StructuredOutputs(grammar='root ::= "a" ("b" | "c")*'))
    feed(g, "abcb")
    assert allowed(g, v) == {"b", "c", "</s>"}


def test_invalid_constraints_are_clear_errors_and_grammars_are_cached(compiler):
    with pytest.raises(GrammarError, match=r"structured.regex: cannot be compiled"):
        compiler.compile(StructuredOutputs(regex="([a-z"))
    with pytest.raises(GrammarError, match=r"structured.grammar: cannot be compiled"):
        compiler.compile(StructuredOutputs(grammar="root ::= undefined_rule"))
    with pytest.raises(GrammarError, match=r"structured.json: cannot be compiled"):
        compiler.compile(StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))
    spec = StructuredOutputs(json={"type": "array", "items": {"type": "boolean"}, "maxItems": 2})
    before = compiler.hits
    first, again = compiler.compile(spec), compiler.compile(StructuredOutputs(json=dict(spec.json)))
    assert first is again and compiler.hits == before + 1
