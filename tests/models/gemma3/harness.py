"""Drive a CausalLM without the engine: a contiguous block allocator, TorchKVStorage and
build_attn_batches, prefill then greedy decode of a batch of prompts; and how fidelity tests read the transformers
oracle's answers (tests/fixtures/transformers_oracle.py)."""

from __future__ import annotations

from typing import Sequence

import torch

from inferhal.backends.reference.device import TorchKVStorage
from inferhal.core.backend import KVGroupLayout, KVStorageRequest
from inferhal.core.models.base import ForwardBatch
from inferhal.core.paging.batch import SeqSlice, build_attn_batches
from transformers_oracle import decided


class ContiguousKV:
    """Each sequence gets ``blocks_per_seq`` consecutive blocks in every group (nothing is released)."""

    def __init__(self, model, num_seqs: int, max_len: int, block_size: int = 16) -> None:
        self.specs = list(model.kv_groups())
        self.block_size = block_size
        self.per_seq = -(-max_len // block_size)
        n = self.per_seq * num_seqs  # each group has its own pool of block ids
        layouts = tuple(KVGroupLayout(s.name, s.layers, s.slots_per_block(block_size), s.slot_shape, s.dtype)
                        for s in self.specs)
        self.storage = TorchKVStorage(KVStorageRequest(num_blocks=n, block_size=block_size, groups=layouts))
        self.num_seqs = num_seqs

    def blocks(self, seq: int) -> dict[str, list[int]]:
        out = {}
        for s in self.specs:  # block ids are per group: each group's pool gives sequence i the same range
            start = seq * self.per_seq
            out[s.name] = list(range(start, start + self.per_seq))
        return out


def step(model, kv: ContiguousKV, ids_per_seq: Sequence[Sequence[int]], computed: Sequence[int],
         greedy: bool = False) -> torch.Tensor:
    """One forward over ``ids_per_seq[i]`` new tokens after ``computed[i]`` cached ones → logits [B, V]
    of each sequence's last token (``greedy``: ``forward_greedy``'s tokens [B] instead)."""
    seqs = [SeqSlice(c, len(ids), kv.blocks(i)) for i, (ids, c) in enumerate(zip(ids_per_seq, computed))]
    positions, qsl, attn = build_attn_batches(kv.specs, kv.block_size, seqs)
    flat = [t for ids in ids_per_seq for t in ids]
    rows = (qsl[1:] - 1).long()
    batch = ForwardBatch(torch.tensor(flat, dtype=torch.long), positions, qsl, attn, rows)
    return model.forward_greedy(batch, kv.storage) if greedy else model.forward(batch, kv.storage)


def greedy(model, prompts: Sequence[Sequence[int]], max_new: int, block_size: int = 16, each=None):
    """→ (tokens [B][max_new], every step's logits ``[B, V]``). With ``each``, ``each(step, logits)`` sees
    each step's logits instead and the list stays empty (10 prompts x 32 steps of a 262k vocabulary is
    335 MB of fp32 kept for nothing)."""
    kv = ContiguousKV(model, len(prompts), max(len(p) for p in prompts) + max_new + 1, block_size)
    all_logits: list = []
    keep = each if each is not None else (lambda s, lg: all_logits.append(lg))
    logits = step(model, kv, prompts, [0] * len(prompts))
    keep(0, logits)
    out = [[int(t)] for t in logits.argmax(-1)]
    lens = [len(p) for p in prompts]
    for s in range(1, max_new):
        logits = step(model, kv, [[o[-1]] for o in out], lens)
        keep(s, logits)
        lens = [n + 1 for n in lens]
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(int(t))
    return out, all_logits


def agreed(toks: Sequence[int], want: Sequence[int]) -> int:
    """How many leading tokens two greedy runs share."""
    return next((s for s, (a, b) in enumerate(zip(toks, want)) if a != b), min(len(toks), len(want)))


def assert_enough_decided(oracle, tie: float, min_fraction: float) -> None:
    """At least ``min_fraction`` of the oracle's steps come before its prompts' near-ties (else the prompts
    prove little)."""
    n, total = sum(decided(steps, tie) for _, steps in oracle), sum(len(steps) for _, steps in oracle)
    assert n >= min_fraction * total, f"only {n} of {total} greedy steps come before a near-tie (margin < {tie})"
