"""Byte-level BPE tokenizers (``tokenizer.ggml.model = gpt2``) rebuilt from GGUF metadata.

The GGUF holds the vocabulary, its merges and token types, so the ``tokenizers`` BPE is built directly:
GPT-2's byte alphabet, GPT-2's split regex, and, for ``tokenizer.ggml.pre = smollm``, digits split one by
one first (llama.cpp's and SmolLM2's own ``tokenizer.json`` pre-tokenizer; transformers' GGUF conversion
leaves that step out, so it writes ``2024`` as fewer pieces). Control tokens (type 3: ``<|im_start|>``,
``<|im_end|>``, ...) are matched whole. Built in well under a second, so nothing is cached.

The chat template is the file's ``tokenizer.chat_template`` (Jinja, as Hugging Face writes them), rendered by
:mod:`inferhal.core.models.gguf.chat` in Jinja's immutable sandbox.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from inferhal.core.errors import UserError
from inferhal.core.models.gemma3.gguf_file import GGUFFile
from inferhal.core.models.gguf.chat import render

CONTROL, USER_DEFINED = 3, 4
#: pre-tokenizer types (``tokenizer.ggml.pre``) that split digits one by one before the GPT-2 regex
DIGIT_SPLIT = ("smollm", "starcoder", "refact")


def build_backend(tokens: Sequence[str], token_types: np.ndarray, merges: Sequence[str], pre: str):
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre in DIGIT_SPLIT else byte_level)
    tok.decoder = decoders.ByteLevel()
    types = np.asarray(token_types)
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                            for i in np.flatnonzero(types == CONTROL)])
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in np.flatnonzero(types == USER_DEFINED)])
    return tok


class ByteBPETokenizer:
    """The :class:`~inferhal.core.models.base.Tokenizer` of a byte-level BPE GGUF."""

    def __init__(self, backend, bos_token_id: int | None, eos_token_ids: tuple[int, ...], add_bos: bool,
                 chat_template: str | None, tokens: Sequence[str]) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.bos_token = tokens[bos_token_id] if bos_token_id is not None else ""
        self.eos_token = tokens[eos_token_ids[0]] if eos_token_ids else ""
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "ByteBPETokenizer":
        model = f.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise UserError(f"{f.path}: tokenizer.ggml.model is {model!r}; the llama loader builds byte-level BPE "
                            f"('gpt2') tokenizers only")
        tokens = list(f.require("tokenizer.ggml.tokens"))
        merges = list(f.require("tokenizer.ggml.merges"))
        types = f.get("tokenizer.ggml.token_type")
        types = np.ones(len(tokens), dtype=np.int32) if types is None else np.asarray(types)
        if len(types) != len(tokens):
            raise UserError(f"{f.path}: {len(tokens)} tokens but {len(types)} token types")
        backend = build_backend(tokens, types, merges, str(f.get("tokenizer.ggml.pre", "")))
        bos = f.get("tokenizer.ggml.bos_token_id")
        eos = int(f.require("tokenizer.ggml.eos_token_id"))
        eos_ids = [eos]
        for extra in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if f.get(extra) is not None and int(f.get(extra)) not in eos_ids:
                eos_ids.append(int(f.get(extra)))
        return cls(backend, None if bos is None else int(bos), tuple(eos_ids),
                   bool(f.get("tokenizer.ggml.add_bos_token", False)), f.get("tokenizer.chat_template"), tokens)

    # -- the Tokenizer protocol --------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        return render(messages, self.chat_template, add_generation_prompt, self.bos_token, self.eos_token)
