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
    write_from: int = 0  # positions below it write only the sliding groups (a bounded replay, paging/replay.py)


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
    """→ (positions[T], query_start_loc[B+1], {group: AttnBatch}).

    Vectorised over tokens: one padded block table per group, slots gathered from it; the result is
    what :func:`token_slots` gives per sequence (an unallocated block still raises IndexError).
    """
    nc = [s.num_computed for s in seqs]
    nn = [s.num_new for s in seqs]
    qsl = [0]
    for n in nn:
        qsl.append(qsl[-1] + n)
    total = qsl[-1]
    nn_t = torch.tensor(nn, dtype=torch.long)
    seq_of = torch.repeat_interleave(torch.arange(len(seqs)), nn_t)  # [T] sequence of each token
    start_t = torch.tensor(qsl[:-1], dtype=torch.long)
    pos = torch.tensor(nc, dtype=torch.long)[seq_of] + torch.arange(total) - start_t[seq_of]  # [T]
    pos_t = pos.to(device)
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    ends = [c + n for c, n in zip(nc, nn)]
    replaying = any(s.write_from > s.num_computed for s in seqs)
    if replaying:  # [T]: a replayed token below its sequence's write_from writes no full/compressed KV
        wf = torch.tensor([s.write_from for s in seqs], dtype=torch.long)[seq_of]
    out: dict[str, AttnBatch] = {}
    for spec in specs:
        r = spec.tokens_per_slot
        spb = spec.slots_per_block(block_size)
        rows = [s.block_ids[spec.name] for s in seqs]
        width = max(max((len(b) for b in rows), default=0), 1)
        table = torch.tensor([list(b) + [-1] * (width - len(b)) for b in rows] or [[-1]], dtype=torch.int32)
        if not rows:
            table = table[:0]
        if r > 1:
            writes = (pos + 1) % r == 0  # the token that closes a compression window writes its entry
            e = (pos + 1) // r - 1
        else:
            writes = torch.ones_like(pos, dtype=torch.bool)
            e = pos
        if replaying and spec.kind != "sliding":
            writes = writes & (pos >= wf)
        blk = e // spb
        inside = blk < width
        phys = torch.full_like(pos, -1)
        ok = writes & inside
        phys[ok] = table[seq_of[ok], blk[ok]].long()
        bad = writes & (phys < 0)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise IndexError(f"KV group {spec.name!r}: position {int(pos[i])} needs logical block {int(blk[i])}, "
                             f"which is not allocated")
        slots = torch.where(writes, phys * spb + e % spb, torch.full_like(pos, -1))
        out[spec.name] = AttnBatch(
            query_start_loc=qsl_t,
            seq_lens=torch.tensor([x // r for x in ends], dtype=torch.int32, device=device),
            positions=pos_t,
            block_table=table.to(device),
            slot_mapping=slots.to(device),
            tokens_per_slot=r,
        )
    return pos_t, qsl_t, out
