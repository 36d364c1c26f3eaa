"""Llama-family hyper-parameters, from GGUF metadata (``llama.*``) or a plain mapping.

Covers the dense Llama layout llama.cpp writes as ``general.architecture = llama`` (Llama 2/3, SmolLM,
TinyLlama, ...): pre-norm RMSNorm, GQA attention with RoPE on the whole head, SwiGLU MLP, an LM head tied
to the embedding unless the file has ``output.weight``. RoPE scaling other than linear is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from inferhal.core.errors import UserError


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_base: float = 10_000.0
    rope_scaling: float = 1.0  # linear position scaling (factor; 1 = none)
    max_position_embeddings: int = 4096
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads"):
            if int(getattr(self, name)) <= 0:
                raise UserError(f"Llama config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"Llama config: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                            f"{self.num_kv_heads}")
        if self.head_dim <= 0:
            if self.hidden_size % self.num_heads:
                raise UserError(f"Llama config: hidden_size {self.hidden_size} is not a multiple of num_heads "
                                f"{self.num_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise UserError(f"Llama config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def attn_scale(self) -> float:
        return float(self.head_dim) ** -0.5

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(d) - known)
        if bad:
            raise UserError(f"Llama config: unknown field(s) {bad}; known: {sorted(known)}")
        return cls(**dict(d))


def from_gguf_metadata(md: Mapping[str, Any], where: str = "GGUF", has_output: bool = False) -> LlamaConfig:
    arch = md.get("general.architecture")
    if arch != "llama":
        raise UserError(f"{where}: general.architecture is {arch!r}; the llama loader reads 'llama' files")

    def need(key: str):
        if key not in md:
            raise UserError(f"{where}: metadata key {key!r} is missing")
        return md[key]

    scaling_type = str(md.get("llama.rope.scaling.type", "none") or "none")
    if scaling_type not in ("none", "linear"):
        raise UserError(f"{where}: llama.rope.scaling.type={scaling_type!r} is not supported (none | linear)")
    heads = int(need("llama.attention.head_count"))
    hidden = int(need("llama.embedding_length"))
    head_dim = int(md.get("llama.attention.key_length", md.get("llama.rope.dimension_count", hidden // heads)))
    if int(md.get("llama.rope.dimension_count", head_dim)) != head_dim:
        raise UserError(f"{where}: partial RoPE (rope.dimension_count {md['llama.rope.dimension_count']} of head "
                        f"dim {head_dim}) is not supported")
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(md.get("llama.vocab_size", len(tokens) if tokens is not None else 0))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(need("llama.block_count")),
        intermediate_size=int(need("llama.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(md.get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(md.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(md.get("llama.rope.freq_base", 10_000.0)),
        rope_scaling=float(md.get("llama.rope.scaling.factor", 1.0)) if scaling_type == "linear" else 1.0,
        max_position_embeddings=int(md.get("llama.context_length", 4096)),
        tie_embeddings=not has_output,
    )
