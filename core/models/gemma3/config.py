"""Gemma 3 text-model hyper-parameters: the GGUF decoder's config (:mod:`inferhal.core.models.gguf.config`) with
Gemma 3's settings, from GGUF metadata (``gemma3.*``) or a plain mapping (``model.arch``).

Gemma 3 is the decoder with (1 + w) RMSNorms (the weights held minus one), per-head QK norms, norms on the
attention and FFN outputs (sandwich), embeddings scaled by sqrt(hidden), GeGLU (gelu_tanh) and an LM head tied
to the embedding. Where the GGUF says nothing: local (sliding) layers use RoPE base 10,000 and every 6th layer
is global; queries are scaled by ``query_pre_attn_scalar ** -0.5`` with the scalar equal to the head dim; no
soft-capping (Gemma 3 dropped it, but it is honoured when present).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from inferhal.core.models.gguf.config import FULL, SLIDING, DecoderConfig

__all__ = ["FULL", "SLIDING", "Gemma3Config", "from_gguf_metadata"]


@dataclass(frozen=True)
class Gemma3Config(DecoderConfig):
    LABEL = "Gemma 3"
    ARCH = "gemma3"
    SLIDING_PATTERN = 6
    GGUF_KEYS = {"rope.local_freq_base": "rope_local_base", "attention.sliding_window": "sliding_window",
                 "attention.query_pre_attn_scalar": "query_pre_attn_scalar", "attn_logit_softcapping": "attn_softcap",
                 "final_logit_softcapping": "final_softcap"}
    READS_OUTPUT = False  # Gemma 3 ties its LM head to the embedding

    rms_norm_eps: float = 1e-6
    rope_global_base: float = 1_000_000.0
    sliding_window: int = 512
    max_position_embeddings: int = 32768
    activation: str = "gelu_tanh"
    norm_unit_offset: bool = True
    qk_norm: bool = True
    sandwich_norms: bool = True
    scale_embeddings: bool = True


def from_gguf_metadata(md: Mapping[str, Any], where: str = "GGUF") -> Gemma3Config:
    """The config of a ``general.architecture = gemma3`` file (keys as llama.cpp writes them)."""
    return Gemma3Config.from_gguf(md, where)
