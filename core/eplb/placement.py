"""A placement plan as plain data, and the maps derived from it.

``phy2log[L, R]``: the logical expert in each physical slot; slot ``p`` lives on GPU (EP rank)
``p // (R // num_gpus)``. ``log2phy[L, E, M]``: the slots of each logical expert in ascending order,
padded with -1 (``M`` = max replicas, ``R - E + 1`` for plans from the policy). ``logcnt[L, E]``: the
number of replicas of each expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def build_log2phy(phy2log: torch.Tensor, num_logical: int, max_replicas: int | None = None) -> torch.Tensor:
    """``[L, E, M]`` slots per expert ascending, -1 padded; replica ``r`` of ``e`` is its r-th lowest slot."""
    L, R = phy2log.shape
    m = R - num_logical + 1 if max_replicas is None else max_replicas
    p2l = phy2log.long()
    order = (p2l * R + torch.arange(R)).argsort(dim=1)  # slots sorted by (expert, slot)
    sorted_e = p2l.gather(1, order)
    first = torch.searchsorted(sorted_e, torch.arange(num_logical).expand(L, num_logical).contiguous())
    rank = torch.arange(R).expand(L, R) - first.gather(1, sorted_e)  # replica index of each sorted slot
    out = torch.full((L, num_logical * m + 1), -1, dtype=torch.long)  # last column: overflow bin
    flat = torch.where(rank < m, sorted_e * m + rank, torch.full_like(rank, num_logical * m))
    out.scatter_(1, flat, order)
    return out[:, :-1].reshape(L, num_logical, m)


def replica_counts(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    p2l = phy2log.long()
    return torch.zeros(p2l.shape[0], num_logical, dtype=torch.long).scatter_add_(1, p2l, torch.ones_like(p2l))


@dataclass(frozen=True)
class Placement:
    """One validated-on-demand plan; :meth:`identity` is the no-redundancy default (expert ``e`` in slot ``e``)."""

    phy2log: torch.Tensor  # [L, R] int64
    log2phy: torch.Tensor  # [L, E, M] int64, -1 padded
    logcnt: torch.Tensor  # [L, E] int64

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logcnt.shape[1])

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_logical: int, max_replicas: int | None = None) -> "Placement":
        p2l = phy2log.long()
        return cls(p2l, build_log2phy(p2l, num_logical, max_replicas), replica_counts(p2l, num_logical))

    @classmethod
    def identity(cls, num_layers: int, num_logical: int, num_physical: int | None = None) -> "Placement":
        """Slot ``p`` holds expert ``p % E`` (redundant slots repeat the first experts)."""
        r = num_logical if num_physical is None else num_physical
        p2l = (torch.arange(r) % num_logical).expand(num_layers, r).clone()
        return cls.from_phy2log(p2l, num_logical)

    def slots_per_rank(self, ep_size: int) -> int:
        return self.num_physical // ep_size

    def local_slots(self, rank: int, ep_size: int) -> range:
        s = self.slots_per_rank(ep_size)
        return range(rank * s, (rank + 1) * s)
