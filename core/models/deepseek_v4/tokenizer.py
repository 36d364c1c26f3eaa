"""The tokenizer of a DeepSeek-V4 checkpoint directory: ``tokenizer.json`` through the ``tokenizers``
library, the chat template from ``model.chat_template`` or ``tokenizer_config.json`` (rendered with
jinja2). A directory without ``tokenizer.json`` (tiny random checkpoints) has no tokenizer: the engine
then takes token-id prompts."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from inferhal.core.errors import UserError


class HFTokenizer:
    def __init__(self, tok: Any, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self._tok = tok
        self.bos_token_id, self.eos_token_ids = bos_token_id, eos_token_ids
        self.chat_template, self.bos_token, self.eos_token = chat_template, bos_token, eos_token

    @property
    def backend(self) -> Any:
        """The ``tokenizers`` tokenizer (structured outputs read its vocabulary: core/structured/grammar.py)."""
        return self._tok

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise UserError("this DeepSeek-V4 checkpoint has no chat template; set model.chat_template")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=list(messages), bos_token=self.bos_token,
                                                          eos_token=self.eos_token,
                                                          add_generation_prompt=add_generation_prompt)


def load_tokenizer(path: str | None, cfg: Any, chat_template: str | None = None) -> HFTokenizer | None:
    if not path or not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tc: dict = {}
    tc_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc_path):
        with open(tc_path) as f:
            tc = json.load(f)

    def text(v: Any) -> str:
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    return HFTokenizer(tok, cfg.bos_token_id, cfg.eos_token_ids, chat_template or tc.get("chat_template"),
                       text(tc.get("bos_token")), text(tc.get("eos_token")))
