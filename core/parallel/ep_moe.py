"""The routed-expert part of a MoE layer under expert parallelism, through HAL ops only.

Per layer call (every EP rank calls it with the same full batch; attention is replicated):

1. this rank takes its contiguous shard of the ``T`` tokens, padded to ``ceil(T / ranks)`` rows that go nowhere
   (physical id -1) where it is shorter, so every rank dispatches as many rows: under a captured decode step
   (``backend.graphs=true``, every rank at the same bucket) the padded exchange's capacity, rows x top_k, is
   the same on every rank;
2. logical expert ids -> physical slots through the placement's ``log2phy``: token ``t`` (global index)
   uses replica ``t % logcnt[e]`` of expert ``e``, which spreads each expert's tokens evenly and
   deterministically over its replicas;
3. the recorder (if any) counts the physical ids;
4. ``moe.dispatch`` sends each (token, choice) to the rank owning the slot; ``moe.experts`` runs this
   rank's ``S`` local slots; ``moe.combine`` brings results back and sums them weighted, k in order;
5. the shards are all-gathered so every rank continues with the full ``[T, D]``.

:meth:`EPExperts.rebalance` installs a new validated placement and moves the weights
(:mod:`inferhal.core.eplb.transfer`); :meth:`EPExperts.move_layers` moves some layers only, leaving the others
on the old placement (a live rebalance, :mod:`.rebalance`). With ``world_size == 1`` the same code runs locally.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from inferhal.core.eplb.placement import Placement
from inferhal.core.eplb.transfer import move_layer
from inferhal.core.ops.params import EPParams, ExpertsParams
from inferhal.core.ops.quant import QuantWeight


def to_physical(logical: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor,
                token_index: torch.Tensor) -> torch.Tensor:
    """``logical[T, K]`` -> physical slots ``[T, K]``: replica ``token_index[t] % logcnt[e]`` of expert ``e``."""
    lg = logical.long()
    replica = token_index.long()[:, None] % logcnt[lg]
    return log2phy[lg, replica]


def select_experts(w: torch.Tensor | QuantWeight, experts: torch.Tensor) -> torch.Tensor | QuantWeight:
    """Rows ``experts`` of an ``[E, ...]`` expert weight (plain or quantised) -> ``[S, ...]``."""
    if isinstance(w, QuantWeight):
        return QuantWeight(w.data[experts], w.scale[experts], w.format, (len(experts), *w.shape[1:]), w.block)
    return w[experts].clone()


def _flat(w: torch.Tensor | QuantWeight, name: str) -> dict[str, torch.Tensor]:
    return {f"{name}.data": w.data, f"{name}.scale": w.scale} if isinstance(w, QuantWeight) else {name: w}


def _unflat(tensors: dict[str, torch.Tensor], like: torch.Tensor | QuantWeight, name: str):
    if isinstance(like, QuantWeight):
        return QuantWeight(tensors[f"{name}.data"], tensors[f"{name}.scale"], like.format, like.shape, like.block)
    return tensors[name]


class EPExperts:
    """One rank's routed experts for all MoE layers.

    :param ops: the backend's OpTable (``moe.dispatch``, ``moe.experts``, ``moe.combine``).
    :param comm: the backend's Communicator (``world_size`` = EP size).
    :param placement: the placement in use (``Placement.identity`` when EPLB is off).
    :param full_weights: per MoE layer ``(gate_up[E, 2I, D], down[E, D, I])``; this rank keeps only the rows
        of its slots (the caller may drop the full tensors afterwards).
    :param recorder: optional ``record(layer, physical_ids[T, K])`` sink.
    """

    def __init__(self, ops: Any, comm: Any, placement: Placement,
                 full_weights: Sequence[tuple[Any, Any]], experts_p: ExpertsParams, recorder: Optional[Any] = None):
        self.ops, self.comm, self.experts_p, self.recorder = ops, comm, experts_p, recorder
        n, me = comm.layout.world_size, comm.layout.rank
        self.ep_p = EPParams(ep_size=n, num_physical=placement.num_physical)
        self.placement = placement
        self.local: list[tuple[Any, Any]] = []
        for l, (gu, down) in enumerate(full_weights):
            slots = placement.phy2log[l, list(placement.local_slots(me, n))]
            self.local.append((select_experts(gu, slots), select_experts(down, slots)))

    def __call__(self, layer: int, x: torch.Tensor, weights: torch.Tensor, logical_ids: torch.Tensor) -> torch.Tensor:
        # x: [T, D], weights: [T, K] fp32, logical_ids: [T, K] -> y: [T, D] (routed experts only)
        comm = self.comm
        n, me = comm.layout.world_size, comm.layout.rank
        t = x.shape[0]
        per = -(-t // n) if t else 0
        lo, hi = min(me * per, t), min((me + 1) * per, t)
        p = self.placement
        idx = torch.arange(lo, hi, device=x.device)
        phys = to_physical(logical_ids[lo:hi], p.log2phy[layer], p.logcnt[layer], idx)  # [hi-lo, K]
        if self.recorder is not None:
            self.recorder.record(layer, phys)
        xs, ws = x[lo:hi], weights[lo:hi]
        short = max(per, 1) - (hi - lo)
        if short:  # a short or empty shard: rows that go nowhere, so every rank dispatches max(per, 1) rows
            k = weights.shape[1]  # (a padded exchange's capacity, rows x top_k, is then the same on every rank)
            xs, ws = torch.cat([xs, x.new_zeros((short, x.shape[1]))]), torch.cat([ws, weights.new_zeros((short, k))])
            phys = torch.cat([phys, torch.full((short, k), -1, dtype=phys.dtype, device=x.device)])
        y = self.through_experts(layer, xs, ws, phys)[: hi - lo]  # [hi-lo, D]
        if n == 1:
            return y
        pad = torch.zeros((per, x.shape[1]), dtype=y.dtype, device=y.device)
        pad[: hi - lo] = y
        return torch.cat(comm.all_gather(pad))[:t]

    def through_experts(self, layer: int, xs: torch.Tensor, ws: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
        """``moe.dispatch`` of rows ``xs[T, D]`` routed to physical slots ``phys[T, K]``, this rank's slots of
        ``layer`` on what it received (``moe.experts``), ``moe.combine`` weighted by ``ws[T, K]`` -> ``[T, D]``."""
        ops, comm = self.ops, self.comm
        sent = ops["moe.dispatch"](xs, phys, comm, self.ep_p)
        gu, down = self.local[layer]
        ones = torch.ones((sent.x.shape[0], 1), dtype=torch.float32, device=xs.device)
        y_local = ops["moe.experts"](sent.x, ones, sent.local_ids[:, None], gu, down, self.experts_p)
        return ops["moe.combine"](y_local, ws, sent.handle, comm, self.ep_p)

    def shrink(self, placement: Placement) -> None:
        """Go on as a survivor of lost EP ranks: ``self.comm`` has been reformed without them, and
        ``placement`` is the old one without their slots (:func:`~inferhal.core.eplb.survive.without_ranks`), so
        this rank's slots hold the experts they held, whose weights it keeps."""
        self.ep_p = EPParams(ep_size=int(self.comm.layout.world_size), num_physical=placement.num_physical)
        self.placement = placement

    def rebalance(self, new: Placement) -> int:
        """Move this rank's expert weights to ``new`` (collective; every rank calls it with the same plan).
        Returns the number of slots this rank received from other ranks."""
        if new.phy2log.shape != self.placement.phy2log.shape:
            raise ValueError(f"phy2log shapes {tuple(self.placement.phy2log.shape)} / {tuple(new.phy2log.shape)} "
                             f"do not match")
        received = self.move_layers(new, range(new.num_layers))
        self.placement = new  # the plan itself (the mix move_layers leaves may pad log2phy wider)
        return received

    def move_layers(self, new: Placement, layers: Sequence[int]) -> int:
        """Move the weights of ``layers`` only to ``new``'s rows (collective, same arguments on every rank):
        the placement in use takes those layers' rows from ``new`` and keeps its own elsewhere (every row is a
        placement of its layer, so the mix is valid). Returns the slots received from other ranks."""
        old = self.placement
        m = max(old.log2phy.shape[2], new.log2phy.shape[2])
        p2l, l2p, cnt = old.phy2log.clone(), _pad_replicas(old.log2phy, m), old.logcnt.clone()
        received = 0
        for l in layers:
            gu, down = self.local[l]
            moved, got = move_layer({**_flat(gu, "gate_up"), **_flat(down, "down")}, old.phy2log[l].tolist(),
                                    new.phy2log[l].tolist(), self.comm)
            self.local[l] = (_unflat(moved, gu, "gate_up"), _unflat(moved, down, "down"))
            p2l[l], cnt[l], l2p[l] = new.phy2log[l], new.logcnt[l], _pad_replicas(new.log2phy, m)[l]
            received += got
        self.placement = Placement(p2l, l2p, cnt)
        return received


def _pad_replicas(log2phy: torch.Tensor, m: int) -> torch.Tensor:
    """``log2phy[L, E, M]`` padded with -1 to ``m`` replica columns."""
    if log2phy.shape[2] >= m:
        return log2phy.clone()
    pad = torch.full((*log2phy.shape[:2], m - log2phy.shape[2]), -1, dtype=log2phy.dtype)
    return torch.cat([log2phy, pad], dim=2)
