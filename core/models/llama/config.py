"""Llama-family hyper-parameters: the GGUF decoder's config (:mod:`inferhal.core.models.gguf.config`) with
Llama's settings, from GGUF metadata (``llama.*``) or a plain mapping.

Covers the dense Llama layout llama.cpp writes as ``general.architecture = llama`` (Llama 2/3, SmolLM,
TinyLlama, ...): pre-norm RMSNorm, GQA attention with RoPE on the whole head, SwiGLU MLP, an LM head tied
to the embedding unless the file has ``output.weight``; every layer attends globally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from inferhal.core.models.gguf.config import DecoderConfig


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    LABEL = "Llama"
    ARCH = "llama"


def from_gguf_metadata(md: Mapping[str, Any], where: str = "GGUF", has_output: bool = False) -> LlamaConfig:
    """The config of a ``general.architecture = llama`` file; ``has_output``: it has an ``output.weight``."""
    return LlamaConfig.from_gguf(md, where, has_output)
