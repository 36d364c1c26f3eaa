"""Gemma's SentencePiece-BPE tokenizer, rebuilt from GGUF metadata as a ``tokenizers`` BPE.

A GGUF stores the vocabulary (``tokenizer.ggml.tokens``, ``.token_type``, ``.scores``) but no merges.
SentencePiece BPE merges, at each step, the adjacent pair whose concatenation is the best-ranked piece;
Gemma's file lists pieces in rank order (its scores do not follow that order), so a piece's rank is
its index. We therefore derive one merge per way of splitting a piece into two pieces, ranked by the
piece's index and, among splits of the same piece, longer left part first -- the convention
transformers' GGUF conversion uses, which is our oracle for token-for-token equality.

Text handling (as Gemma's ``tokenizer.model``): no dummy prefix, spaces become ``▁`` before BPE, no
whitespace pre-splitting, byte fallback (``<0xNN>``) for characters outside the vocabulary. Pieces
of two or more spaces are stored with real spaces and respelled as ``▁▁...``. Control pieces
(token type 3: ``<bos>``, ``<start_of_turn>``, ...) and user-defined ones (type 4: ``\\n``, ``\\n\\n``,
``[multimodal]``, ...) are matched whole in the raw text.

Building takes a few seconds for a 262k vocabulary, so the result is cached as ``tokenizer.json``
under ``~/.cache/inferhal/tokenizers/<digest of the vocabulary>``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from inferhal.core.errors import UserError
from inferhal.core.models.gemma3.gguf_file import GGUFFile

log = logging.getLogger("inferhal.models.gemma3")

SPACE = "\u2581"
CONTROL, USER_DEFINED = 3, 4

#: Gemma's turn format. The 270M GGUF is the base model and ships no ``tokenizer.chat_template``;
#: instruction-tuned Gemma 3 checkpoints use exactly this layout (system text is folded into the
#: first user turn, the assistant role is called "model").
GEMMA_TURN_TEMPLATE = "gemma-turns"


def respell(token: str) -> str:
    """Pieces made only of whitespace and containing a space are stored with real spaces."""
    return SPACE * len(token) if " " in token and not token.strip() else token


def derive_merges(pieces: Sequence[str]) -> list[tuple[str, str]]:
    """Merges implied by a rank-ordered BPE vocabulary (see the module docstring)."""
    index = {p: i for i, p in enumerate(pieces)}
    found: list[tuple[int, int, int, str, str]] = []
    for rank, piece in enumerate(pieces):
        if index.get(piece) != rank:  # a duplicate spelling: the last one wins, like a dict
            continue
        n = len(piece)
        for cut in range(1, n):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                # best piece first; among one piece's splits, longer left part first
                found.append((rank, -cut, -(n - cut), left, right))
    found.sort(key=lambda m: (m[0], m[1], m[2]))
    return [(m[3], m[4]) for m in found]


def vocab_digest(tokens: Sequence[str], token_types: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(np.asarray(token_types, dtype=np.int32).tobytes())
    h.update("\x00".join(tokens).encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:24]


def build_backend(tokens: Sequence[str], token_types: np.ndarray, unk: str):
    """A ``tokenizers.Tokenizer`` equivalent to Gemma's SentencePiece model."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    pieces = [respell(t) for t in tokens]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(BPE(vocab=vocab, merges=derive_merges(pieces), unk_token=unk, fuse_unk=True,
                        byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # a no-op after the normalizer
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    types = np.asarray(token_types)
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                            for i in np.flatnonzero(types == CONTROL)])
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                    for i in np.flatnonzero(types == USER_DEFINED) if tokens[i] in vocab])
    return tok


def cache_dir() -> Path:
    return Path(os.environ.get("INFERHAL_CACHE", Path.home() / ".cache" / "inferhal"))


class GemmaTokenizer:
    """The :class:`~inferhal.core.models.base.Tokenizer` of a Gemma GGUF."""

    def __init__(self, backend, bos_token_id: int | None, eos_token_ids: tuple[int, ...], add_bos: bool,
                 chat_template: str | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "GemmaTokenizer":
        model = f.get("tokenizer.ggml.model")
        if model != "llama":
            raise UserError(f"{f.path}: tokenizer.ggml.model is {model!r}; the Gemma loader builds 'llama' "
                            f"(SentencePiece) tokenizers only")
        tokens = f.require("tokenizer.ggml.tokens")
        types = f.get("tokenizer.ggml.token_type")
        types = np.ones(len(tokens), dtype=np.int32) if types is None else np.asarray(types)
        if len(types) != len(tokens):
            raise UserError(f"{f.path}: {len(tokens)} tokens but {len(types)} token types")
        unk_id = int(f.get("tokenizer.ggml.unknown_token_id", 3))
        backend = cls._cached_backend(tokens, types, tokens[unk_id])
        bos = f.get("tokenizer.ggml.bos_token_id")
        eos = int(f.require("tokenizer.ggml.eos_token_id"))
        eos_ids = [eos]
        # instruction-tuned turns end with <end_of_turn>: stop there too when the vocabulary has it
        if "<end_of_turn>" in tokens:
            eos_ids.append(tokens.index("<end_of_turn>"))
        return cls(backend, None if bos is None else int(bos), tuple(eos_ids),
                   bool(f.get("tokenizer.ggml.add_bos_token", True)), f.get("tokenizer.chat_template"))

    @staticmethod
    def _cached_backend(tokens: Sequence[str], types: np.ndarray, unk: str):
        from tokenizers import Tokenizer

        path = cache_dir() / "tokenizers" / vocab_digest(tokens, types) / "tokenizer.json"
        if path.is_file():
            try:
                return Tokenizer.from_file(str(path))
            except Exception as exc:  # a corrupt cache entry: rebuild it
                log.warning("ignoring unreadable tokenizer cache %s: %s", path, exc)
        tok = build_backend(tokens, types, unk)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tok.save(str(tmp))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not cache the tokenizer at %s: %s", path, exc)
        return tok

    # -- the Tokenizer protocol --------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The file's (or ``model.chat_template``'s) Jinja template when there is one, else Gemma's turns."""
        from inferhal.core.models.gemma3.chat import ROLES, render_turns
        from inferhal.core.models.gguf.chat import render

        if self.chat_template:
            return render(messages, self.chat_template, add_generation_prompt, bos_token="<bos>", roles=ROLES)
        return render_turns(messages, add_generation_prompt)

