"""The tiny random DeepSeek-V4 as a served model: its HF checkpoint directory with a character-level tokenizer
and a chat template (core/models/deepseek_v4/make_checkpoint.py ``--tokenizer chars``), so ``inferhal serve``
(text in, text out) can serve it."""

from __future__ import annotations

import os


def write_tiny_text_model(out_dir: str, config: str = "tiny") -> str:
    """Write the checkpoint and tokenizer under ``out_dir`` (once); returns it."""
    from inferhal.core.models.deepseek_v4.make_checkpoint import main

    if not os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        assert main([out_dir, "--config", config, "--tokenizer", "chars"]) == 0
    return out_dir


def overrides(path: str) -> list[str]:
    """The config overrides that serve this model from ``path``."""
    return ["model=deepseek_v4_tiny", "model.format=hf", f"model.path={path}", "cache.block_size=16",
            "cache.num_blocks=256"]
