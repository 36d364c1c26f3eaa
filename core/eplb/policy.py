"""The rebalance policy: a pure function from a load tensor to a placement, signature-compatible with
DeepSeek EPLB's ``rebalance_experts``.

Structure (DeepSeek's semantics): hierarchical when ``num_groups % num_nodes == 0`` -- pack the expert
groups onto nodes, replicate within each node, pack each node's replicas onto its GPUs -- and global
otherwise (one group, one node). Our steps:

1. replicas: each extra slot goes to the expert with the highest load per replica (D'Hondt). This
   minimises the largest per-replica load exactly, which is also the replica part of the lower bound.
2. packing: balanced Karmarkar-Karp (largest differencing with equal counts) and round-wise LPT, each
   refined by swap local search from the heaviest GPUs (:mod:`.packing`). For the current window alone
   (``drift=0``) the refined start with the lighter maximum is kept per row. By default the plan is made
   for the next window (:mod:`.drift`): of the two refined starts, the unrefined round-wise LPT and, on
   rows of at most :data:`LPT_ITEMS` replicas, the greedy LPT, each row keeps the one whose heaviest GPU
   is expected to be lightest when every expert's load drifts by ``drift``. The baseline
   (:mod:`.baseline`) packs with the greedy LPT alone.

A layer's balancedness is set by its heaviest GPU, which can never be lighter than the layer's floor
(its heaviest node's load over the node's GPUs, and its heaviest replica). So the packing of a node
whose heaviest GPU is already at or below that floor is final: only the nodes that can still lower the
layer's maximum get the second start and the search, which gives the same per-layer maximum for less work.

Everything is vectorised over layers (and nodes): the number of tensor ops does not depend on ``L``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional

import torch

from inferhal.core.eplb import drift as drift_model
from inferhal.core.eplb.packing import (kk_sorted, lpt_sorted, pack_loads, refine_sorted, round_sorted, sort_items,
                                        unsort)
from inferhal.core.eplb.placement import build_log2phy
from inferhal.core.eplb.validate import check_drift, check_layout, check_load

LPT_ITEMS = 128
"""Rows (one node's replicas) of at most this many items also get the greedy LPT as a drift candidate; it
takes one step per item, and on the larger single-node rows it was never the one picked."""

PackFn = Callable[[torch.Tensor, int, Optional[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
"""``(weight[X, n], num_packs, floor[X] or None) -> (pack_index, rank_in_pack)``; ``floor``: a row whose
heaviest pack is at or below it needs no further work."""


def replicate(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """D'Hondt apportionment: ``weight[X, n]`` -> ``(phy2log[X, num_physical], logcnt[X, n])``.

    Slots ``0..n-1`` hold experts ``0..n-1``; each further slot goes to the argmax of ``weight / logcnt``.
    """
    x, n = weight.shape
    rows = torch.arange(x)
    phy2log = torch.cat((torch.arange(n).expand(x, n), torch.empty(x, num_physical - n, dtype=torch.long)), dim=1)
    logcnt = torch.ones(x, n, dtype=torch.long)
    for i in range(n, num_physical):
        e = (weight / logcnt).argmax(dim=1)
        phy2log[:, i] = e
        logcnt[rows, e] += 1
    return phy2log, logcnt


def ours_pack(weight: torch.Tensor, num_packs: int,
              floor: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Balanced KK; the rows whose heaviest pack is above ``floor`` (all rows without one) also get
    round-wise LPT, both starts refined by swaps in one batch (rows stacked, so the search's steps are
    shared), and keep the start with the lighter maximum."""
    sorted_w, order = sort_items(weight)
    pack = kk_sorted(sorted_w, num_packs)  # [X, n] the pack of each sorted position
    todo = torch.arange(weight.shape[0])
    if floor is not None:
        todo = todo[pack_loads(sorted_w, pack, num_packs).amax(dim=1) > floor]
    t = todo.numel()
    if t:
        w = sorted_w[todo]
        both = w.repeat(2, 1)
        refined = refine_sorted(both, torch.cat((pack[todo], round_sorted(w, num_packs))), num_packs,
                                floor=None if floor is None else floor[todo].repeat(2))
        heaviest = pack_loads(both, refined, num_packs).amax(dim=1)
        pack[todo] = torch.where((heaviest[t:] < heaviest[:t])[:, None], refined[t:], refined[:t])
    return unsort(pack, order, num_packs)


def drift_pack(weight: torch.Tensor, expert: torch.Tensor, num_packs: int, floor: Optional[torch.Tensor],
               num_experts: int, drift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``weight[X, n]`` (replicas of ``expert[X, n] < num_experts``) for the next window: the
    candidates of the module docstring, scored by :func:`~inferhal.core.eplb.drift.pick`."""
    sorted_w, order = sort_items(weight)
    x, n = sorted_w.shape
    rd = round_sorted(sorted_w, num_packs)
    both = sorted_w.repeat(2, 1)
    refined = refine_sorted(both, torch.cat((kk_sorted(sorted_w, num_packs), rd)), num_packs,
                            floor=None if floor is None else floor.repeat(2))
    cands = [refined[:x], refined[x:], rd]
    if n <= LPT_ITEMS:
        cands.append(lpt_sorted(sorted_w, num_packs))
    pack, _ = drift_model.pick(sorted_w, expert.gather(1, order), torch.stack(cands, dim=1), num_packs,
                               num_experts, drift)
    return unsort(pack, order, num_packs)


@contextmanager
def one_thread():
    """The policy runs thousands of tiny ops; intra-op threads only add contention (20x slower on 2 busy
    cores), so run single-threaded and restore the caller's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm))


def hierarchical_phy2log(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                         num_gpus: int, pack: PackFn, drift: float = 0.0) -> torch.Tensor:
    """``weight[L, E]`` (float, valid) -> ``phy2log[L, R]``; global placement is ``num_groups = num_nodes = 1``.
    ``drift > 0``: the GPU packing is :func:`drift_pack`'s (``pack`` still packs groups onto nodes)."""
    L, E = weight.shape
    gsize = E // num_groups
    groups_per_node = num_groups // num_nodes
    # 1. groups -> nodes; "mlog" numbers experts node by node (node n owns mlog n*E/N .. (n+1)*E/N-1).
    gpack, grank = pack(weight.view(L, num_groups, gsize).sum(-1), num_nodes, None)  # [L, G]
    log2mlog = ((gpack * groups_per_node + grank) * gsize)[:, :, None] + torch.arange(gsize)
    log2mlog = log2mlog.reshape(L, E)
    mlog2log = _inverse(log2mlog)
    # 2. replicate within each node: rows are (layer, node).
    wnode = weight.gather(1, mlog2log).view(L * num_nodes, E // num_nodes)
    phy2mlog, mlogcnt = replicate(wnode, num_physical // num_nodes)  # [L*N, R/N]
    # 3. pack each node's replicas onto its GPUs.
    per_replica = (wnode / mlogcnt).gather(1, phy2mlog)  # [L*N, R/N]
    # No plan puts a layer's heaviest GPU below its heaviest node's mean GPU load or its heaviest replica.
    floor = torch.maximum(wnode.sum(1).view(L, num_nodes).amax(1) / (num_gpus // num_nodes),
                          per_replica.view(L, -1).amax(1))  # [L]
    if drift > 0:
        ppack, prank = drift_pack(per_replica, phy2mlog, num_gpus // num_nodes, floor.repeat_interleave(num_nodes),
                                  E // num_nodes, drift)
    else:
        ppack, prank = pack(per_replica, num_gpus // num_nodes, floor.repeat_interleave(num_nodes))
    slots = num_physical // num_gpus
    pphy2phy = _inverse(ppack * slots + prank)
    pphy2mlog = phy2mlog.gather(1, pphy2phy).view(L, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (torch.arange(num_nodes) * (E // num_nodes))[None, :, None]).view(L, num_physical)
    return mlog2log.gather(1, pphy2mlog)


def rebalance_with(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                   pack: PackFn, drift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy with packer ``pack``; ``drift > 0``: pack the GPUs for the next window (:func:`drift_pack`)."""
    w = check_load(weight)
    drift = check_drift(drift)
    hierarchical = check_layout(w.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    if not hierarchical:
        num_groups = num_nodes = 1
    with one_thread():
        phy2log = hierarchical_phy2log(w, num_replicas, num_groups, num_nodes, num_gpus, pack, drift)
    E = w.shape[1]
    logcnt = torch.zeros(w.shape[0], E, dtype=torch.long).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    return phy2log, build_log2phy(phy2log, E, num_replicas - E + 1), logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int, drift: float = drift_model.DRIFT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place ``num_replicas`` physical experts for the load ``weight[L, E]``.

    :param weight: ``[L, E]`` token counts (or any non-negative load) per layer and logical expert.
    :param num_replicas: physical slots per layer, a multiple of ``num_gpus`` and ``>= E``.
    :param num_groups: expert groups (``E % num_groups == 0`` when hierarchical).
    :param num_nodes: nodes; hierarchical placement when ``num_groups % num_nodes == 0``.
    :param num_gpus: GPUs (EP ranks); slot ``p`` lives on GPU ``p // (num_replicas // num_gpus)``.
    :param drift: how far each expert's load is expected to move by the next window (log-normal sigma);
        the packing is chosen for that next window (:mod:`.drift`). 0: the tightest packing of ``weight``.
        Deterministic either way (fixed-seed scenarios), so every rank computes the same plan.
    :returns: ``phy2log[L, R]`` int64, ``log2phy[L, E, R - E + 1]`` int64 padded with -1 (replica ``r``
        of expert ``e`` is its r-th lowest slot), ``logcnt[L, E]`` int64.
    :raises EplbInputError: NaN, infinite or negative loads, a wrong shape, sizes that do not divide, or a
        bad ``drift``.
    """
    return rebalance_with(weight, num_replicas, num_groups, num_nodes, num_gpus, ours_pack, drift)
