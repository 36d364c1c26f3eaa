"""Build the per-group :class:`~inferhal.core.ops.params.AttnBatch` of one step from block tables.

This is the one place that maps token positions to page slots, for every kind of KV group
(see :class:`~inferhal.core.paging.spec.KVGroupSpec`). The model runner and the model tests use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from inferhal.core.ops.params import AttnBatch
from inferhal.core.paging.spec import KVGroupSpec


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a step: ``num_new`` tokens after ``num_computed`` cached ones, and its
    block table per KV group (logical block index → physical block id; -1 where a block was released)."""

    num_computed: int
    num_new: int
    block_ids: Mapping[str, Sequence[int]]


def token_slots(spec: KVGroupSpec, block_size: int, blocks: Sequence[int], positions: Sequence[int]) -> list[int]:
    """Flat slot (``block * slots_per_block + offset``) written by each token position, -1 for none."""
    r = spec.tokens_per_slot
    spb = spec.slots_per_block(block_size)
    out = []
    for p in positions:
        if r > 1 and (p + 1) % r:
            out.append(-1)  # this token does not close a compression window
            continue
        e = (p + 1) // r - 1 if r > 1 else p
        b = e // spb
        if b >= len(blocks) or blocks[b] < 0:
            raise IndexError(f"KV group {spec.name!r}: position {p} needs logical block {b}, which is not allocated")
        out.append(blocks[b] * spb + e % spb)
    return out


def build_attn_batches(
    specs: Sequence[KVGroupSpec], block_size: int, seqs: Sequence[SeqSlice], device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, dict[str, AttnBatch]]:
    """→ (positions[T], query_start_loc[B+1], {group: AttnBatch})."""
    positions: list[int] = []
    qsl = [0]
    for s in seqs:
        positions.extend(range(s.num_computed, s.num_computed + s.num_new))
        qsl.append(qsl[-1] + s.num_new)
    pos_t = torch.tensor(positions, dtype=torch.long, device=device)
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    out: dict[str, AttnBatch] = {}
    for spec in specs:
        r = spec.tokens_per_slot
        width = max((len(s.block_ids[spec.name]) for s in seqs), default=0)
        table = torch.full((len(seqs), max(width, 1)), -1, dtype=torch.int32)
        slots: list[int] = []
        lens = []
        for i, s in enumerate(seqs):
            blocks = list(s.block_ids[spec.name])
            if blocks:
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            slots.extend(token_slots(spec, block_size, blocks, range(s.num_computed, s.num_computed + s.num_new)))
            lens.append((s.num_computed + s.num_new) // r)
        out[spec.name] = AttnBatch(
            query_start_loc=qsl_t,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            positions=pos_t,
            block_table=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            tokens_per_slot=r,
        )
    return pos_t, qsl_t, out
