"""Applying a placement: move expert weights between EP ranks, layer by layer.

Every rank holds, per MoE layer, tensors with a leading dim of its ``S = R // ep_size`` local slots
(e.g. ``gate_up[S, 2I, D]``, ``down[S, D, I]``, or a QuantWeight's ``data`` and ``scale``). Given the old
and new ``phy2log`` rows of a layer, each rank derives the same transfer plan (no extra exchange): a new
slot whose expert this rank already holds is filled by a local copy; otherwise it is received from one of
the old holders, chosen by ``dest_rank % len(holders)`` to spread the senders. The rows then travel in
one variable-size ``Communicator.all_to_all`` per tensor (batched isend/irecv on gloo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


@dataclass(frozen=True)
class Move:
    src_rank: int
    src_slot: int  # local slot on src_rank (old placement)
    dst_rank: int
    dst_slot: int  # local slot on dst_rank (new placement)


def plan_layer(old_p2l: Sequence[int], new_p2l: Sequence[int], ep_size: int) -> list[Move]:
    """All slot fills of one layer, local copies included (``src_rank == dst_rank``), in slot order."""
    r = len(old_p2l)
    if len(new_p2l) != r or r % ep_size:
        raise ValueError(f"old/new phy2log must both have {r} slots divisible by ep_size={ep_size}")
    s = r // ep_size
    holders: dict[int, list[int]] = {}
    for p, e in enumerate(old_p2l):
        holders.setdefault(int(e), []).append(p)
    moves = []
    for p, e in enumerate(new_p2l):
        dst = p // s
        have = holders.get(int(e))
        if not have:
            raise ValueError(f"expert {int(e)} of the new placement is held by no rank in the old one")
        local = [q for q in have if q // s == dst]
        q = local[0] if local else have[dst % len(have)]
        moves.append(Move(q // s, q % s, dst, p % s))
    return moves


def move_layer(tensors: Mapping[str, torch.Tensor], old_p2l: Sequence[int], new_p2l: Sequence[int],
               comm) -> tuple[dict[str, torch.Tensor], int]:
    """Return this rank's tensors for the new placement and the number of expert slots it received from
    other ranks. ``tensors[name]`` is ``[S, ...]`` in the old local slot order."""
    n, me = comm.layout.world_size, comm.layout.rank
    moves = plan_layer(old_p2l, new_p2l, n)
    sends = [[m for m in moves if m.src_rank == me and m.dst_rank == d] for d in range(n)]
    recvs = [[m for m in moves if m.dst_rank == me and m.src_rank == s] for s in range(n)]
    out = {}
    for name in sorted(tensors):
        t = tensors[name]
        new = torch.empty_like(t)
        chunks = [t[[m.src_slot for m in sends[d]]] if d != me else t[:0] for d in range(n)]
        got = comm.all_to_all(chunks) if n > 1 else [t[:0]]
        for s in range(n):
            if s == me:
                for m in recvs[s]:
                    new[m.dst_slot] = t[m.src_slot]
            elif recvs[s]:
                new[[m.dst_slot for m in recvs[s]]] = got[s]
        out[name] = new
    received = sum(len(recvs[s]) for s in range(n) if s != me)
    return out, received


def apply_placement(layers: Sequence[Mapping[str, torch.Tensor]], old_phy2log: torch.Tensor,
                    new_phy2log: torch.Tensor, comm) -> tuple[list[dict[str, torch.Tensor]], int]:
    """:func:`move_layer` for every layer (one layer's buffers alive at a time); returns the new tensors
    and the total number of slots received from other ranks (all ranks must call it together)."""
    if old_phy2log.shape != new_phy2log.shape or old_phy2log.shape[0] != len(layers):
        raise ValueError(f"phy2log shapes {tuple(old_phy2log.shape)} / {tuple(new_phy2log.shape)} do not match "
                         f"{len(layers)} layers")
    out, total = [], 0
    for l, tensors in enumerate(layers):
        new, got = move_layer(tensors, old_phy2log[l].tolist(), new_phy2log[l].tolist(), comm)
        out.append(new)
        total += got
    return out, total
