"""Gemma 3 text-model hyper-parameters, from GGUF metadata (``gemma3.*``) or a plain mapping.

Defaults are those of Gemma 3 where the GGUF says nothing: local (sliding) layers use RoPE base 10,000
and every 6th layer is global; queries are scaled by ``query_pre_attn_scalar ** -0.5`` with the scalar
equal to the head dim; no soft-capping (Gemma 3 dropped it, but it is honoured when present).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from inferhal.core.errors import UserError

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_global_base: float = 1_000_000.0
    rope_local_base: float = 10_000.0
    rope_global_scaling: float = 1.0  # linear position scaling of global layers (factor; 1 = none)
    sliding_window: int = 512
    layer_types: tuple[str, ...] = field(default=())
    query_pre_attn_scalar: float = 0.0  # 0 = head_dim
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    max_position_embeddings: int = 32768
    activation: str = "gelu_tanh"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads",
                     "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise UserError(f"Gemma 3 config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"Gemma 3 config: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                            f"{self.num_kv_heads}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_layers))
        if len(self.layer_types) != self.num_layers:
            raise UserError(f"Gemma 3 config: {len(self.layer_types)} layer_types for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad:
            raise UserError(f"Gemma 3 config: unknown layer type(s) {bad}; expected {SLIDING} | {FULL}")
        if SLIDING in self.layer_types and self.sliding_window <= 0:
            raise UserError("Gemma 3 config: sliding layers need sliding_window > 0")
        if self.query_pre_attn_scalar <= 0:
            object.__setattr__(self, "query_pre_attn_scalar", float(self.head_dim))

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "Gemma3Config":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"Gemma 3 config: unknown field(s) {unknown}; known: {sorted(known)}")
        d = dict(d)
        if "layer_types" in d:
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)


def default_layer_types(n: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3: five sliding-window layers, then one global layer, repeated."""
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n))


def from_gguf_metadata(md: Mapping[str, Any], where: str = "GGUF") -> Gemma3Config:
    """The config of a ``general.architecture = gemma3`` file (keys as llama.cpp writes them)."""
    arch = md.get("general.architecture")
    if arch != "gemma3":
        raise UserError(f"{where}: general.architecture is {arch!r}, but the gemma3 loader reads only 'gemma3' files")

    def need(key: str) -> Any:
        if f"gemma3.{key}" not in md:
            raise UserError(f"{where}: metadata key 'gemma3.{key}' is missing")
        return md[f"gemma3.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(md.get("gemma3.attention.key_length", hidden // heads))
    vdim = int(md.get("gemma3.attention.value_length", head_dim))
    if vdim != head_dim:
        raise UserError(f"{where}: key_length {head_dim} != value_length {vdim}; Gemma 3 has one head dim")
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(md.get("gemma3.vocab_size", len(tokens) if tokens is not None else 0))
    scaling = 1.0
    stype = md.get("gemma3.rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise UserError(f"{where}: rope scaling type {stype!r} is not supported (supported: linear)")
        scaling = float(md.get("gemma3.rope.scaling.factor", 1.0))
    return Gemma3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(need("block_count")),
        intermediate_size=int(need("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(md.get("gemma3.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(md.get("gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_global_base=float(md.get("gemma3.rope.freq_base", 1_000_000.0)),
        rope_local_base=float(md.get("gemma3.rope.local_freq_base", 10_000.0)),
        rope_global_scaling=scaling,
        sliding_window=int(md.get("gemma3.attention.sliding_window", 512)),
        query_pre_attn_scalar=float(md.get("gemma3.attention.query_pre_attn_scalar", 0.0)),
        attn_softcap=float(md.get("gemma3.attn_logit_softcapping", 0.0) or 0.0),
        final_softcap=float(md.get("gemma3.final_logit_softcapping", 0.0) or 0.0),
        max_position_embeddings=int(md.get("gemma3.context_length", 32768)),
    )
