"""The contract between the engine (model runner) and a model family. Plain data in, logits out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

from inferhal.core.ops.params import AttnBatch
from inferhal.core.paging.spec import KVGroupSpec


@dataclass(frozen=True)
class ForwardBatch:
    """One step's tokens, flattened over sequences.

    ``input_ids[T]`` and ``positions[T]``; ``attn[group]`` is the :class:`AttnBatch` of each KV group the
    model declared (same ``query_start_loc``; lengths, block tables and slot mappings per group);
    ``logits_indices[B']`` are the rows of the flat batch whose next-token logits are wanted (usually the
    last scheduled token of each sequence that is done with its prompt).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    attn: Mapping[str, AttnBatch]
    logits_indices: torch.Tensor
    extras: Mapping[str, Any] = field(default_factory=dict)
    #: a caller's fp32 ``[len(logits_indices), vocab]`` buffer for the logits (the runner lends one it
    #: reuses every step); None = the model allocates them. The caller owns it: forward returns it filled.
    logits_out: torch.Tensor | None = None


#: vocabulary rows per LM-head product in :func:`lm_head`
LM_HEAD_CHUNK = 32768


def lm_head(ops: Any, x: torch.Tensor, weight: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits ``[B', V] = linear(x [B', hidden], weight [V, hidden])``, written into ``out`` when given.

    A plain weight runs in vocabulary chunks of :data:`LM_HEAD_CHUNK` rows, each widened into its
    columns of the fp32 result while it is still in cache: no full-size logits in the model dtype, and no
    second pass to widen them. At a 262,144-token vocabulary and 32 rows that full-size pass and its fresh
    pages cost as much as a third of the bf16 product itself (measured on one CPU thread). A quantised
    weight (not sliceable by rows) runs as one product."""
    v = weight.shape[0]
    if out is None:
        out = torch.empty(x.shape[0], v, dtype=torch.float32, device=x.device)
    elif tuple(out.shape) != (x.shape[0], v) or out.dtype != torch.float32:
        raise ValueError(f"lm_head: logits buffer is {out.dtype} {tuple(out.shape)}, needs float32 {(x.shape[0], v)}")
    if not isinstance(weight, torch.Tensor):
        return out.copy_(ops["linear"](x, weight))
    for s in range(0, v, LM_HEAD_CHUNK):
        out[:, s : s + LM_HEAD_CHUNK] = ops["linear"](x, weight[s : s + LM_HEAD_CHUNK])
    return out


@runtime_checkable
class KVCache(Protocol):
    def layer_cache(self, group: str, layer: int) -> torch.Tensor: ...


@runtime_checkable
class CausalLM(Protocol):
    """A loaded model bound to one backend's op table."""

    vocab_size: int
    max_model_len: int

    def kv_groups(self) -> Sequence[KVGroupSpec]:
        """The paged KV layer groups this model reads and writes."""

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Write this step's KV into ``kv`` and return fp32 logits ``[len(batch.logits_indices), vocab]``
        (in ``batch.logits_out`` when the caller lends a buffer; :func:`lm_head` does both)."""


@runtime_checkable
class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str: ...


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer | None
    name: str
    family: str
    info: Mapping[str, Any] = field(default_factory=dict)
