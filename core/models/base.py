"""The contract between the engine (model runner) and a model family. Plain data in, logits out."""

from __future__ import annotations

import dataclasses
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
    #: the step's plan on the host: one :class:`~inferhal.core.paging.batch.SeqSlice` per sequence, in order
    #: (what ``build_attn_batches`` built the tensors from). A model takes sizes from it (the largest position,
    #: how many compressed entries the step closes) instead of reading device tensors on the host, which
    #: would synchronise. None (a captured graph, whose sizes must hold for every replay): the model uses
    #: fixed upper bounds (``max_model_len``) with masking on the device, or reads what it must.
    seqs: Sequence[Any] | None = None

    def max_position(self, bound: int) -> int:
        """The step's largest position from :attr:`seqs` (-1 for an empty step); ``bound`` without them."""
        if self.seqs is None:
            return bound
        return max((s.num_computed + s.num_new for s in self.seqs), default=0) - 1


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
        (in ``batch.logits_out`` when the caller lends a buffer; the ``lm_head`` op does both).

        A model may also have ``forward_greedy(batch, kv) -> tokens [len(batch.logits_indices)] int64``:
        the same step, returning the token ``sample``'s greedy rows would take from those logits (through
        the ``lm_head.argmax`` op). The runner calls it for a step whose every row is greedy and none wants
        logprobs or verifies drafts."""


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
    #: the context the model was trained for, as its checkpoint declares it (a GGUF's context_length, a config's
    #: max_position_embeddings); None: not declared. A longer model.max_model_len is refused against it unless
    #: model.allow_long_context (core/config/context.py)
    max_context: int | None = None


def slice_batch(batch: Any, s0: int, s1: int) -> Any:
    """Sequences ``s0 .. s1 - 1`` of a :class:`~inferhal.core.models.base.ForwardBatch` as a batch of their
    own (the one the runner would build for them alone, block tables keeping the step's width); no
    logits rows (the step's head runs on the joined streams)."""
    qsl = batch.query_start_loc
    if batch.seqs is not None:  # the token offsets from the host's plan (no device read)
        t0 = sum(s.num_new for s in batch.seqs[:s0])
        t1 = t0 + sum(s.num_new for s in batch.seqs[s0:s1])
    else:
        t0, t1 = int(qsl[s0]), int(qsl[s1])
    attn = {g: dataclasses.replace(a, query_start_loc=a.query_start_loc[s0:s1 + 1] - a.query_start_loc[s0],
                                   seq_lens=a.seq_lens[s0:s1], positions=a.positions[t0:t1],
                                   block_table=a.block_table[s0:s1], slot_mapping=a.slot_mapping[t0:t1])
            for g, a in batch.attn.items()}
    return dataclasses.replace(batch, input_ids=batch.input_ids[t0:t1], positions=batch.positions[t0:t1],
                               query_start_loc=qsl[s0:s1 + 1] - qsl[s0], attn=attn,
                               logits_indices=batch.logits_indices[:0], extras={}, logits_out=None,
                               seqs=None if batch.seqs is None else tuple(batch.seqs[s0:s1]))


def split_batch(batch: Any, micro_batches: Sequence[int]) -> list[Any]:
    """A batch cut into consecutive micro-batches of ``micro_batches[i]`` sequences each."""
    out, s = [], 0
    for n in micro_batches:
        out.append(slice_batch(batch, s, s + int(n)))
        s += int(n)
    if s != int(batch.query_start_loc.shape[0]) - 1:
        raise ValueError(f"micro-batches {tuple(micro_batches)} do not cover the step's {s} sequences")
    return out
