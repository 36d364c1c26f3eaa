"""Hyper-parameters of a dense GGUF decoder (:mod:`.decoder`), from GGUF metadata or a plain mapping.

One dataclass holds every setting a family may change; a family is a subclass that sets its defaults, the
label its messages carry and what it reads from a file (class variables):

- ``ARCH``: the ``general.architecture`` of its files, and the prefix of its metadata keys (``gemma3.``).
- ``SLIDING_PATTERN``: without ``layer_types``, every n-th layer attends globally and the rest through the
  sliding window (Gemma 3: 6); 0 = every layer global.
- ``GGUF_KEYS``: the optional metadata keys (after the prefix) it reads, and the field each fills, beside
  :data:`COMMON_KEYS`; an absent key leaves the family's default.
- ``READS_OUTPUT``: an ``output.weight`` in the file is the LM head (else the head is the embedding table).

The keys are those llama.cpp writes. RoPE scaling other than linear is refused, as is RoPE on part of the head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from inferhal.core.errors import UserError

SLIDING, FULL = "sliding_attention", "full_attention"

#: metadata keys (after ``<arch>.``) every family reads → field
COMMON_KEYS = {"attention.head_count_kv": "num_kv_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
               "rope.freq_base": "rope_global_base", "context_length": "max_position_embeddings"}


@dataclass(frozen=True)
class DecoderConfig:
    LABEL: ClassVar[str] = "decoder"
    ARCH: ClassVar[str] = ""
    SLIDING_PATTERN: ClassVar[int] = 0
    GGUF_KEYS: ClassVar[Mapping[str, str]] = {}
    READS_OUTPUT: ClassVar[bool] = True

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_global_base: float = 10_000.0  # RoPE base of the full-attention (global) layers
    rope_local_base: float = 10_000.0  # RoPE base of the sliding-window layers
    rope_global_scaling: float = 1.0  # linear position scaling of global layers (factor; 1 = none)
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()  # SLIDING | FULL per layer; () = the family's pattern
    query_pre_attn_scalar: float = 0.0  # queries scaled by its ** -0.5; 0 = head_dim
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    max_position_embeddings: int = 4096
    activation: str = "silu"  # of the gated FFN: silu (SwiGLU) | gelu_tanh (GeGLU)
    norm_unit_offset: bool = False  # RMSNorm scales by 1 + w (the weights held minus one)
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE
    sandwich_norms: bool = False  # RMSNorm of the attention and FFN outputs before each residual add
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    tie_embeddings: bool = True  # the LM head is the embedding table

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads"):
            if int(getattr(self, name)) <= 0:
                raise UserError(f"{self.LABEL} config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"{self.LABEL} config: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                            f"{self.num_kv_heads}")
        if self.head_dim <= 0:
            if self.hidden_size % self.num_heads:
                raise UserError(f"{self.LABEL} config: hidden_size {self.hidden_size} is not a multiple of num_heads "
                                f"{self.num_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise UserError(f"{self.LABEL} config: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", self.default_layer_types(self.num_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise UserError(f"{self.LABEL} config: {len(self.layer_types)} layer_types for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad:
            raise UserError(f"{self.LABEL} config: unknown layer type(s) {bad}; expected {SLIDING} | {FULL}")
        if SLIDING in self.layer_types and self.sliding_window <= 0:
            raise UserError(f"{self.LABEL} config: sliding layers need sliding_window > 0")
        if self.query_pre_attn_scalar <= 0:
            object.__setattr__(self, "query_pre_attn_scalar", float(self.head_dim))

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @classmethod
    def default_layer_types(cls, n: int) -> tuple[str, ...]:
        """``SLIDING_PATTERN - 1`` sliding-window layers, then one global layer, repeated (all global for 0)."""
        p = cls.SLIDING_PATTERN
        return tuple(FULL if not p or (i + 1) % p == 0 else SLIDING for i in range(n))

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "DecoderConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"{cls.LABEL} config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(d))

    @classmethod
    def from_gguf(cls, md: Mapping[str, Any], where: str = "GGUF", has_output: bool = False) -> "DecoderConfig":
        """The config of a ``general.architecture = ARCH`` file's metadata ``md``; ``has_output``: the file has
        an ``output.weight``."""
        arch = md.get("general.architecture")
        if arch != cls.ARCH:
            raise UserError(f"{where}: general.architecture is {arch!r}, but the {cls.ARCH} loader reads only "
                            f"{cls.ARCH!r} files")
        p = f"{cls.ARCH}."
        stype = str(md.get(p + "rope.scaling.type", "none") or "none")
        if stype not in ("none", "linear"):
            raise UserError(f"{where}: rope scaling type {stype!r} is not supported ({p}rope.scaling.type={stype!r}; "
                            f"supported: none, linear)")

        def need(key: str) -> Any:
            if p + key not in md:
                raise UserError(f"{where}: metadata key {p + key!r} is missing")
            return md[p + key]

        hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
        head_dim = int(md.get(p + "attention.key_length", md.get(p + "rope.dimension_count", hidden // heads)))
        vdim = int(md.get(p + "attention.value_length", head_dim))
        if vdim != head_dim:
            raise UserError(f"{where}: key_length {head_dim} != value_length {vdim}; {cls.LABEL} has one head dim")
        if int(md.get(p + "rope.dimension_count", head_dim)) != head_dim:
            raise UserError(f"{where}: partial RoPE (rope.dimension_count {md[p + 'rope.dimension_count']} of head "
                            f"dim {head_dim}) is not supported")
        tokens = md.get("tokenizer.ggml.tokens")
        kw: dict[str, Any] = dict(
            vocab_size=int(md.get(p + "vocab_size", len(tokens) if tokens is not None else 0)), hidden_size=hidden,
            num_layers=int(need("block_count")), intermediate_size=int(need("feed_forward_length")),
            num_heads=heads, num_kv_heads=heads, head_dim=head_dim, tie_embeddings=not (has_output and cls.READS_OUTPUT))
        if stype == "linear":
            kw["rope_global_scaling"] = float(md.get(p + "rope.scaling.factor", 1.0))
        fields = cls.__dataclass_fields__
        for key, name in {**COMMON_KEYS, **cls.GGUF_KEYS}.items():
            value = md.get(p + key)
            if value is not None:
                kw[name] = {"int": int, "float": float}[fields[name].type](value)
        return cls(**kw)
