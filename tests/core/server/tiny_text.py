"""The tiny random DeepSeek-V4 as a served model: its HF checkpoint directory (core/models/deepseek_v4/
make_checkpoint.py) with a character-level ``tokenizer.json`` (``tokenizers``: a BPE with no merges over the
printable ASCII characters, ``<s>`` = 0, ``</s>`` = 1 as the config's bos/eos, the rest of the 192 ids as
``<tNNN>`` pieces) and a plain chat template, so ``inferhal serve`` (text in, text out) can serve it."""

from __future__ import annotations

import json
import os
import string

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def write_tiny_text_model(out_dir: str, config: str = "tiny") -> str:
    """Write the checkpoint and tokenizer under ``out_dir`` (once); returns it."""
    from tokenizers import Tokenizer, decoders, models

    from inferhal.core.models.deepseek_v4.make_checkpoint import _arch_of, write_checkpoint

    if os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        return out_dir
    arch = _arch_of(config)
    write_checkpoint(out_dir, arch, seed=0)
    vocab = {"<s>": 0, "</s>": 1}
    for c in string.printable:
        if c not in "\x0b\x0c\r":
            vocab[c] = len(vocab)
    while len(vocab) < int(arch["vocab_size"]):
        vocab[f"<t{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, f)
    return out_dir


def overrides(path: str) -> list[str]:
    """The config overrides that serve this model from ``path``."""
    return ["model=deepseek_v4_tiny", "model.format=hf", f"model.path={path}", "cache.block_size=16",
            "cache.num_blocks=256"]
