"""Grammars compiled with xgrammar against a tokenizer's vocabulary, and each request's matcher.

:class:`GrammarCompiler` is built once per engine (its tokenizer and the model's vocabulary size) and
compiles a :class:`~inferhal.core.structured.params.StructuredOutputs` into an ``xgrammar.CompiledGrammar``,
cached by the constraint's canonical key (a schema compiles once however many requests use it).
:class:`RequestGrammar` is one request's state: it fills that request's row of the token bitmask,
advances with each accepted token and rolls back rejected speculative drafts.

The vocabulary comes from the tokenizer's ``tokenizers`` backend: the pieces by id, special tokens as empty
strings (xgrammar never allows an empty token, so ``<start_of_turn>`` cannot appear inside a JSON string),
the vocabulary type from the pieces (``<0x0A>`` byte-fallback pieces as SentencePiece writes them, ``Ġ``
byte-level pieces as GPT-2 writes them, else raw), and the model's end-of-sequence ids as stop tokens.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from inferhal.core.errors import UserError
from inferhal.core.structured.params import StructuredOutputs

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


class GrammarError(UserError, ValueError):
    """A constraint that does not compile (invalid schema or regex, an unsupported feature): the request is
    refused with xgrammar's reason; nothing else is disturbed."""


def _xgr():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - installed with the models extra
        raise UserError(f"structured outputs need xgrammar (pip install xgrammar): {exc}") from None
    return xgrammar


def vocabulary(tokenizer: Any, vocab_size: int) -> tuple[list[str], Any]:
    """``(encoded vocab by id, xgrammar VocabType)`` of a tokenizer with a ``tokenizers`` backend, padded with
    empty (never allowed) tokens to the model's ``vocab_size``."""
    xgr = _xgr()
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        raise UserError(f"structured outputs need a tokenizer with a `tokenizers` backend; "
                        f"{type(tokenizer).__name__} has none")
    pieces = [""] * vocab_size
    for piece, i in backend.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab_size:
            pieces[i] = piece
    for i, tok in backend.get_added_tokens_decoder().items():
        if tok.special and 0 <= i < vocab_size:
            pieces[i] = ""
    have = set(pieces)
    if "<0x0A>" in have:
        kind = xgr.VocabType.BYTE_FALLBACK
    elif any(p.startswith("Ġ") for p in pieces[:5000]):
        kind = xgr.VocabType.BYTE_LEVEL
    else:
        kind = xgr.VocabType.RAW
    return pieces, kind


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary size; thread-safe, cached by constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgr = _xgr()
        pieces, kind = vocabulary(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo(pieces, kind, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=2)
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, spec: StructuredOutputs):
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs):
        import json

        _xgr()  # refused with the install line when xgrammar is missing
        kind = spec.kind
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(json.dumps(spec.json), any_whitespace=False)
            if kind == "json_object":  # any JSON object (OpenAI's json_object), not any JSON value
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if kind == "choice":
                alts = " | ".join(json.dumps(c) for c in spec.choice)  # EBNF string literals, JSON-escaped
                return self._compiler.compile_grammar(f"root ::= {alts}")
            return self._compiler.compile_grammar(spec.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors with the reason
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            first = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)  # xgrammar's "[hh:mm:ss] file.cc:line: " prefix
            raise GrammarError(f"structured.{kind}: cannot be compiled: {first}") from None

    def matcher(self, spec: StructuredOutputs, max_rollback: int = 8) -> "RequestGrammar":
        return RequestGrammar(self.compile(spec), self.vocab_size, max_rollback)


class RequestGrammar:
    """One request's grammar state (an ``xgrammar.GrammarMatcher``)."""

    def __init__(self, compiled: Any, vocab_size: int, max_rollback: int = 8) -> None:
        xgr = _xgr()
        self.matcher = xgr.GrammarMatcher(compiled)  # rollback depth is unlimited in xgrammar >= 0.2
        self.vocab_size = vocab_size

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted (nothing more may follow)."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this request's allowed next tokens into ``bitmask[row]`` (int32, one bit per token)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the grammar does not allow it."""
        return bool(self.matcher.accept_token(int(token)))

    def rollback(self, n: int) -> None:
        if n > 0:
            self.matcher.rollback(n)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 ``[rows, ceil(vocab_size / 32)]`` bitmask, all tokens allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
