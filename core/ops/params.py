"""Frozen, hashable params for the ops of :mod:`.vocabulary`, validated at construction.

They are the static part of a call (what a kernel specialises on); tensors are the dynamic part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class RmsNormParams:
    eps: float = 1e-6
    unit_offset: bool = False  # Gemma: scale by (1 + w)

    def __post_init__(self) -> None:
        _require(self.eps > 0, f"RmsNormParams.eps must be > 0, got {self.eps}")


@dataclass(frozen=True)
class RopeParams:
    rotary_dim: int
    style: str = "neox"  # "neox" (rotate halves) | "interleaved" (rotate even/odd pairs)
    placement: str = "head"  # rotary channels at the "head" (first R) or the "tail" (last R) of D
    inverse: bool = False

    def __post_init__(self) -> None:
        _require(self.rotary_dim > 0 and self.rotary_dim % 2 == 0, f"rotary_dim must be even, got {self.rotary_dim}")
        _require(self.style in ("neox", "interleaved"), f"RopeParams.style must be neox|interleaved, got {self.style!r}")
        _require(self.placement in ("head", "tail"), f"RopeParams.placement must be head|tail, got {self.placement!r}")


@dataclass(frozen=True)
class AttnParams:
    scale: float
    num_kv_heads: int = 1
    window: int = 0  # 0 = full causal attention
    softcap: float = 0.0
    shared_kv: bool = False  # one latent tensor serves as K and V (DeepSeek-V4)
    # the caches hold quantised records of this KVFormat (core/paging/formats.py), uint8 [NB, BS, nbytes]:
    # attn.sparse_topk decodes the window and compressed entries it reads; None = the cache holds values
    kv_format: Any = None

    def __post_init__(self) -> None:
        _require(self.num_kv_heads >= 1, "AttnParams.num_kv_heads must be >= 1")
        _require(self.window >= 0, "AttnParams.window must be >= 0")


@dataclass(frozen=True)
class AttnBatch:
    """Where each sequence's tokens sit, for one layer group. Plain tensors, built by the model runner.

    ``query_start_loc[B+1]``: offsets of each sequence's new tokens in the flat batch;
    ``seq_lens[B]``: context length after this step (cached + new); ``positions[T]``: absolute positions;
    ``block_table[B, M]``: physical block ids, -1 padded; ``slot_mapping[T]``: flat slot per new token.
    For a compressed group (``tokens_per_slot`` > 1) lengths and slots count compressed entries.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    tokens_per_slot: int = 1

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(frozen=True)
class RouteParams:
    top_k: int
    scoring: str = "softmax"  # softmax | sigmoid | sqrtsoftplus
    renormalize: bool = True
    routed_scaling: float = 1.0

    def __post_init__(self) -> None:
        _require(self.top_k >= 1, "RouteParams.top_k must be >= 1")
        _require(
            self.scoring in ("softmax", "sigmoid", "sqrtsoftplus"),
            f"RouteParams.scoring must be softmax|sigmoid|sqrtsoftplus, got {self.scoring!r}",
        )


@dataclass(frozen=True)
class ExpertsParams:
    swiglu_limit: float = 0.0  # 0 = no clamp
    activation: str = "silu"

    def __post_init__(self) -> None:
        _require(self.activation == "silu", f"ExpertsParams.activation supports silu only, got {self.activation!r}")


@dataclass(frozen=True)
class ActParams:
    kind: str = "silu"  # silu | gelu_tanh

    def __post_init__(self) -> None:
        _require(self.kind in ("silu", "gelu_tanh"), f"ActParams.kind must be silu|gelu_tanh, got {self.kind!r}")


@dataclass(frozen=True)
class KVWriteParams:
    quant: str = "none"  # none | fp8 (e4m3 cache + one fp32 scale per entry in a separate scale_cache)
    # or: encode each entry as a record of this KVFormat (core/paging/formats.py) into a uint8 cache
    record: Any = None

    def __post_init__(self) -> None:
        _require(self.quant in ("none", "fp8"), f"KVWriteParams.quant must be none|fp8, got {self.quant!r}")
        _require(self.record is None or self.quant == "none", "KVWriteParams: record and quant='fp8' exclude "
                                                              "each other")


@dataclass(frozen=True)
class MhcParams:
    hc_mult: int
    sinkhorn_iters: int = 20
    eps: float = 1e-6
    norm_eps: float = 1e-6


@dataclass(frozen=True)
class CompressParams:
    """attn.compress: windows of ``ratio`` tokens; ``overlap`` = CSA (entry e pools [(e-1)m, (e+1)m) from the
    two feature halves of the state), else HCA (entry e pools [e m, (e+1) m)). ``rope`` rotates the pooled
    entry at position e*m; ``eps`` is its RMSNorm epsilon."""

    ratio: int
    overlap: bool
    rope: RopeParams
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _require(self.ratio >= 2, f"CompressParams.ratio must be >= 2, got {self.ratio}")


@dataclass(frozen=True)
class IndexerParams:
    """indexer.scores: score = sum_h (weights[t,h] * weight_scale) * relu(q[t,h] . k[s]) * scale."""

    scale: float
    weight_scale: float = 1.0
    key_format: Any = None  # the key cache holds records of this KVFormat (uint8); None = values


@dataclass(frozen=True)
class SampleBatch:
    """Per-row sampling settings of one step. ``generators[i]`` is row i's own generator (or None)."""

    temperature: tuple[float, ...]
    top_k: tuple[int, ...]  # 0 or -1 = off
    top_p: tuple[float, ...]  # 1.0 = off
    generators: tuple[Any, ...] = field(default=(), compare=False, hash=False)
    min_p: tuple[float, ...] = ()
    # optional counter-based RNG state for device samplers (the reference ignores both and uses generators):
    # row i draws from the stream (seeds[i], steps[i]); steps[i] = the row's number of tokens sampled so far
    seeds: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.temperature)
        _require(len(self.top_k) == n and len(self.top_p) == n, "SampleBatch fields must have one entry per row")
        _require(not self.generators or len(self.generators) == n, "SampleBatch.generators must be empty or per row")
        _require(not self.seeds or len(self.seeds) == n, "SampleBatch.seeds must be empty or per row")
        _require(not self.steps or len(self.steps) == len(self.seeds), "SampleBatch.steps must be empty or one per seed")


@dataclass(frozen=True)
class EPParams:
    """Expert parallelism for ``moe.dispatch`` / ``moe.combine``: ``num_physical`` expert slots split evenly
    over ``ep_size`` ranks; slot ``p`` lives on rank ``p // (num_physical // ep_size)``."""

    ep_size: int
    num_physical: int

    def __post_init__(self) -> None:
        _require(self.ep_size >= 1, "EPParams.ep_size must be >= 1")
        _require(self.num_physical % self.ep_size == 0,
                 f"EPParams.num_physical={self.num_physical} must be a multiple of ep_size={self.ep_size}")

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size


@dataclass
class DispatchResult:
    """What ``moe.dispatch`` returns: the rows this rank must run (``x[R, D]``, ``local_ids[R]`` = slot on
    this rank) and an opaque ``handle`` that ``moe.combine`` needs to send results back."""

    x: torch.Tensor
    local_ids: torch.Tensor
    handle: Any
