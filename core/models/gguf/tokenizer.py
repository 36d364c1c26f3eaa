"""Tokenizers rebuilt from a GGUF's vocabulary (``tokenizer.ggml.*``) as ``tokenizers`` BPE models, by the
file's ``tokenizer.ggml.model``:

- ``llama``: SentencePiece BPE (Gemma). The file stores the vocabulary (``tokens``, ``token_type``,
  ``scores``) but no merges. SentencePiece BPE merges, at each step, the adjacent pair whose concatenation is
  the best-ranked piece; Gemma's file lists pieces in rank order (its scores do not follow that order), so a
  piece's rank is its index. We therefore derive one merge per way of splitting a piece into two pieces,
  ranked by the piece's index and, among splits of the same piece, longer left part first -- the convention
  transformers' GGUF conversion uses, which is our oracle for token-for-token equality. Text handling (as
  Gemma's ``tokenizer.model``): no dummy prefix, spaces become ``▁`` before BPE, no whitespace pre-splitting,
  byte fallback (``<0xNN>``) for characters outside the vocabulary; pieces of two or more spaces are stored
  with real spaces and respelled as ``▁▁...``. Building takes a few seconds for a 262k vocabulary, so the
  result is cached as ``tokenizer.json`` under ``<cache>/tokenizers/<digest of the vocabulary>``.
- ``gpt2``: byte-level BPE (Llama 3, SmolLM2). The file holds the merges too, so the BPE is built directly:
  GPT-2's byte alphabet and split regex and, for ``tokenizer.ggml.pre`` in :data:`DIGIT_SPLIT`, digits split
  one by one first (llama.cpp's and SmolLM2's own ``tokenizer.json`` pre-tokenizer; transformers' GGUF
  conversion leaves that step out, so it writes ``2024`` as fewer pieces). Built in well under a second.

In both, control pieces (token type 3: ``<bos>``, ``<|im_start|>``, ...) and user-defined ones (type 4) are
matched whole in the raw text.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Callable, Mapping, Sequence

import numpy as np

from inferhal.core.errors import UserError
from inferhal.core.models.gguf import cache_dir, chat
from inferhal.core.models.gguf.reader import GGUFFile

log = logging.getLogger("inferhal.models.gguf")

SPACE = "\u2581"
CONTROL, USER_DEFINED = 3, 4
#: pre-tokenizer types (``tokenizer.ggml.pre``) that split digits one by one before the GPT-2 regex
DIGIT_SPLIT = ("smollm", "starcoder", "refact")
#: ``tokenizer.ggml.add_bos_token`` where a file does not say, by tokenizer model (llama.cpp's defaults)
ADD_BOS = {"llama": True, "gpt2": False}


# -- SentencePiece BPE (tokenizer.ggml.model = llama) ---------------------------------------------------
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


def build_spm(tokens: Sequence[str], token_types: np.ndarray, unk: str):
    """A ``tokenizers.Tokenizer`` equivalent to a SentencePiece BPE model over ``tokens``."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    pieces = [respell(t) for t in tokens]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(BPE(vocab=vocab, merges=derive_merges(pieces), unk_token=unk, fuse_unk=True,
                        byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # a no-op after the normalizer
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return _whole_pieces(tok, tokens, token_types, lambda t: t in vocab)


def _cached_spm(f: GGUFFile, tokens: Sequence[str], types: np.ndarray):
    from tokenizers import Tokenizer

    path = cache_dir() / "tokenizers" / vocab_digest(tokens, types) / "tokenizer.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # a corrupt cache entry: rebuild it
            log.warning("ignoring unreadable tokenizer cache %s: %s", path, exc)
    tok = build_spm(tokens, types, tokens[int(f.get("tokenizer.ggml.unknown_token_id", 3))])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not cache the tokenizer at %s: %s", path, exc)
    return tok


# -- byte-level BPE (tokenizer.ggml.model = gpt2) -------------------------------------------------------
def build_bpe(tokens: Sequence[str], token_types: np.ndarray, merges: Sequence[str], pre: str):
    """A ``tokenizers.Tokenizer`` for a byte-level BPE vocabulary with its ``merges`` (``"left right"``)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges],
                        dropout=None, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre in DIGIT_SPLIT else byte_level)
    tok.decoder = decoders.ByteLevel()
    return _whole_pieces(tok, tokens, token_types, lambda t: True)


def _whole_pieces(tok, tokens: Sequence[str], token_types: np.ndarray, keep: Callable[[str], bool]):
    """Control pieces as special tokens, user-defined ones (those ``keep`` accepts) as added tokens."""
    from tokenizers import AddedToken

    types = np.asarray(token_types)
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                            for i in np.flatnonzero(types == CONTROL)])
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                    for i in np.flatnonzero(types == USER_DEFINED) if keep(tokens[i])])
    return tok


class GGUFTokenizer:
    """The :class:`~inferhal.core.models.base.Tokenizer` of a GGUF file. Chat input renders through the chat
    template (the file's, or one set later: ``model.chat_template``) in ``chat_roles``, else through
    ``builtin_chat`` (a family's own format), else it is a UserError."""

    def __init__(self, backend, bos_token_id: int | None, eos_token_ids: tuple[int, ...], add_bos: bool,
                 chat_template: str | None = None, tokens: Sequence[str] = (),
                 builtin_chat: Callable[[Sequence[Mapping[str, str]], bool], str] | None = None,
                 chat_roles: Sequence[str] = chat.ROLES) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.bos_token = tokens[bos_token_id] if tokens and bos_token_id is not None else ""
        self.eos_token = tokens[eos_token_ids[0]] if tokens and eos_token_ids else ""
        self.builtin_chat, self.chat_roles = builtin_chat, tuple(chat_roles)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf(cls, f: GGUFFile, stop_pieces: Sequence[str] = (), **chat_settings) -> "GGUFTokenizer":
        """The file's tokenizer. It stops at ``tokenizer.ggml.eos_token_id``, the file's end-of-turn and
        end-of-message ids, and each of ``stop_pieces`` the vocabulary has (Gemma: ``<end_of_turn>``)."""
        model = f.get("tokenizer.ggml.model")
        if model not in ADD_BOS:
            raise UserError(f"{f.path}: tokenizer.ggml.model is {model!r}; GGUF tokenizers are rebuilt for "
                            f"'llama' (SentencePiece BPE) and 'gpt2' (byte-level BPE) only")
        tokens = list(f.require("tokenizer.ggml.tokens"))
        types = f.get("tokenizer.ggml.token_type")
        types = np.ones(len(tokens), dtype=np.int32) if types is None else np.asarray(types)
        if len(types) != len(tokens):
            raise UserError(f"{f.path}: {len(tokens)} tokens but {len(types)} token types")
        if model == "llama":
            backend = _cached_spm(f, tokens, types)
        else:
            backend = build_bpe(tokens, types, list(f.require("tokenizer.ggml.merges")),
                                str(f.get("tokenizer.ggml.pre", "")))
        bos = f.get("tokenizer.ggml.bos_token_id")
        eos_ids = [int(f.require("tokenizer.ggml.eos_token_id"))]
        ends = [f.get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
        for i in [int(e) for e in ends if e is not None] + [tokens.index(p) for p in stop_pieces if p in tokens]:
            if i not in eos_ids:
                eos_ids.append(i)
        return cls(backend, None if bos is None else int(bos), tuple(eos_ids),
                   bool(f.get("tokenizer.ggml.add_bos_token", ADD_BOS[model])), f.get("tokenizer.chat_template"),
                   tokens, **chat_settings)

    # -- the Tokenizer protocol --------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat_template or self.builtin_chat is None:
            return chat.render(messages, self.chat_template, add_generation_prompt, self.bos_token, self.eos_token,
                               self.chat_roles)
        return self.builtin_chat(messages, add_generation_prompt)
