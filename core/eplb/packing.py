"""Balanced packing: put ``n`` weighted items into ``m`` packs of exactly ``n // m`` items each, so that the
heaviest pack is as light as possible. Every function works on a batch of rows ``[X, n]`` at once (one row
per layer, or per layer and node) with a fixed number of tensor ops per step, never a loop over rows.

- :func:`lpt_pack`: capacity-constrained longest-processing-time greedy (heaviest item to the lightest
  pack that still has room): the baseline; ``n`` steps.
- :func:`kk_pack`: balanced largest differencing (Karmarkar-Karp for equal-cardinality packs): ``n/m``
  partial solutions of one item per pack, repeatedly merging the two with the widest spread by pairing
  the heaviest pack of one with the lightest of the other; ``n/m - 1`` steps.
- :func:`refine_swaps`: local search: swap one item of the heaviest pack with one item of any other pack
  whenever that lowers the pair's maximum, best swap first, until no row improves.

All return ``(pack_index[X, n], rank_in_pack[X, n])``: item ``i`` of row ``x`` goes to pack
``pack_index[x, i]`` at position ``rank_in_pack[x, i]`` (positions ``0..n/m-1``, by ascending item index).
"""

from __future__ import annotations

import torch


def _check(weight: torch.Tensor, num_packs: int) -> tuple[int, int, int]:
    x, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} equal packs")
    return x, n, n // num_packs


def ranks_in_pack(pack_index: torch.Tensor, num_packs: int) -> torch.Tensor:
    """Position of each item inside its pack, by ascending item index: ``[X, n]``."""
    x, n = pack_index.shape
    key = pack_index * n + torch.arange(n)  # unique, ordered by (pack, item)
    order = key.argsort(dim=1)
    sorted_pack = pack_index.gather(1, order)
    first = torch.searchsorted(sorted_pack, torch.arange(num_packs).expand(x, num_packs).contiguous())
    pos = torch.arange(n).expand(x, n) - first.gather(1, sorted_pack)
    return torch.empty_like(pos).scatter_(1, order, pos)


def lpt_pack(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy: items by descending weight, each to the lightest pack with a free position."""
    x, n, cap = _check(weight, num_packs)
    rows = torch.arange(x)
    order = weight.argsort(dim=1, descending=True, stable=True)
    loads = torch.zeros(x, num_packs, dtype=weight.dtype)
    counts = torch.zeros(x, num_packs, dtype=torch.long)
    pack = torch.empty(x, n, dtype=torch.long)
    for k in range(n):
        item = order[:, k]
        p = loads.masked_fill(counts >= cap, float("inf")).argmin(dim=1)
        pack[rows, item] = p
        loads[rows, p] += weight[rows, item]
        counts[rows, p] += 1
    return pack, ranks_in_pack(pack, num_packs)


def round_pack(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LPT in rounds: each round gives the ``m`` heaviest remaining items, heaviest first, to the packs in
    ascending order of load, one each (so counts stay equal by construction); ``n/m`` steps."""
    x, n, cap = _check(weight, num_packs)
    order = weight.argsort(dim=1, descending=True, stable=True)
    sw = weight.gather(1, order).view(x, cap, num_packs)  # [X, rounds, m] descending
    loads = torch.zeros(x, num_packs, dtype=weight.dtype)
    slot_pack = torch.empty(x, cap, num_packs, dtype=torch.long)
    for k in range(cap):
        light = loads.argsort(dim=1, stable=True)  # packs, lightest first
        slot_pack[:, k] = light
        loads.scatter_add_(1, light, sw[:, k])
    pack = torch.empty(x, n, dtype=torch.long).scatter_(1, order, slot_pack.view(x, n))
    return pack, ranks_in_pack(pack, num_packs)


def kk_pack(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Balanced largest differencing method, vectorised over rows.

    A step touches only the two partials it merges (``[X, m]`` ops); which pack each item ends in is
    resolved once at the end by replaying the merges backwards, not by relabelling items every step.
    """
    x, n, cap = _check(weight, num_packs)
    if cap == 1:
        pack = torch.arange(n).expand(x, n).clone()
        return pack, torch.zeros_like(pack)
    rows = torch.arange(x)
    order = weight.argsort(dim=1, descending=True, stable=True)  # [X, n]
    # Partial k holds sorted items k*m .. k*m+m-1, one per position (descending).
    sums = weight.gather(1, order).view(x, cap, num_packs).clone()  # [X, P, m]
    spread = sums[:, :, 0] - sums[:, :, -1]  # [X, P]; -1 marks a partial merged away
    merges = []
    for _ in range(cap - 1):
        two = spread.topk(2, dim=1).indices  # [X, 2]; ties: any choice is a valid KK step
        a, b = two[:, 0], two[:, 1]
        sa, sb = sums[rows, a], sums[rows, b]  # [X, m]
        oa = sa.argsort(dim=1, descending=True, stable=True)
        ob = sb.argsort(dim=1, stable=True)
        # Position ob[k] of b joins position oa[k] of a.
        merged = sa.scatter_add(1, oa, sb.gather(1, ob))
        sums[rows, a] = merged
        spread[rows, a] = merged.amax(dim=1) - merged.amin(dim=1)
        spread[rows, b] = -1.0
        merges.append((a, b, torch.empty_like(ob).scatter_(1, ob, oa)))  # b's position -> a's position
    # final[x, k, q]: the pack of partial k's position q. A partial keeps its labels until it is merged.
    final = torch.empty(x, cap, num_packs, dtype=torch.long)
    final[rows, merges[-1][0]] = torch.arange(num_packs)
    for a, b, remap in reversed(merges):
        final[rows, b] = final[rows, a].gather(1, remap)
    pack = torch.empty(x, n, dtype=torch.long).scatter_(1, order, final.view(x, n))
    return pack, ranks_in_pack(pack, num_packs)


def refine_swaps(weight: torch.Tensor, pack_index: torch.Tensor, num_packs: int,
                 max_iters: int = 100, rel_tol: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Local search on a packing: best 1-for-1 swap between the heaviest pack and any other, repeated.

    Moving ``d = w_i - w_j`` from the heaviest pack (load ``M``) to pack ``g`` (load ``l_g``) leaves the
    pair's maximum at ``max(M - d, l_g + d)``, convex in ``d`` with its minimum at ``d* = (M - l_g)/2``; so
    for each item ``i`` and pack ``g`` the best partner is one of the two items of ``g`` whose weights
    bracket ``w_i - d*``, found by ``searchsorted`` in ``g``'s sorted weights. That makes one step
    ``O(m * cap * log cap)`` per row instead of ``O(m * cap^2)``, with the same choice.

    Each accepted swap strictly lowers the larger of the two packs it touches and keeps the total, so the
    sorted pack loads decrease lexicographically and the search ends (capped at ``max_iters``; a swap
    must gain more than ``rel_tol`` of the mean pack load). Rows that stop improving drop out.
    """
    x, n, cap = _check(weight, num_packs)
    rank = ranks_in_pack(pack_index, num_packs)
    members = torch.empty(x, n, dtype=torch.long).scatter_(1, pack_index * cap + rank, torch.arange(n).expand(x, n))
    members = members.view(x, num_packs, cap)  # [X, m, cap] item ids
    wm = weight.gather(1, members.view(x, n)).view(x, num_packs, cap)  # [X, m, cap]
    tol = rel_tol * weight.sum(dim=1).clamp(min=1e-30) / num_packs  # [X]
    active = torch.arange(x)  # rows still improving
    for _ in range(max_iters):
        if active.numel() == 0:
            break
        w_a, order = wm[active].sort(dim=2, stable=True)  # [A, m, cap] ascending within each pack
        m_a = members[active].gather(2, order)
        wm[active], members[active] = w_a, m_a
        a = active.numel()
        load = w_a.sum(-1)  # [A, m]
        lmax, gmax = load.max(dim=1)  # [A]
        wa = w_a[torch.arange(a), gmax]  # [A, cap] items of the heaviest pack
        target = wa[:, None, :] - ((lmax[:, None] - load) / 2)[:, :, None]  # [A, m, cap_i]
        hi = torch.searchsorted(w_a, target.contiguous()).clamp(max=cap - 1)
        cand = torch.stack((hi, (hi - 1).clamp(min=0)), dim=-1)  # [A, m, cap_i, 2] partner positions
        d = wa[:, None, :, None] - w_a.gather(2, cand.view(a, num_packs, -1)).view_as(cand).to(wa.dtype)
        pair_max = torch.maximum(lmax[:, None, None, None] - d, load[:, :, None, None] + d)
        gain, flat = (lmax[:, None, None, None] - pair_max).view(a, -1).max(dim=1)
        ok = gain > tol[active]
        active, flat, ga, cand = active[ok], flat[ok], gmax[ok], cand[ok]
        g = flat // (cap * 2)
        i = (flat // 2) % cap
        j = cand.flatten(1).gather(1, flat[:, None])[:, 0]
        wi, wj = wm[active, ga, i].clone(), wm[active, g, j].clone()
        mi, mj = members[active, ga, i].clone(), members[active, g, j].clone()
        wm[active, ga, i], wm[active, g, j] = wj, wi
        members[active, ga, i], members[active, g, j] = mj, mi
    pack = torch.empty(x, n, dtype=torch.long).scatter_(
        1, members.view(x, n), (torch.arange(n) // cap).expand(x, n))
    return pack, ranks_in_pack(pack, num_packs)


def pack_loads(weight: torch.Tensor, pack_index: torch.Tensor, num_packs: int) -> torch.Tensor:
    """``[X, m]`` total weight per pack."""
    return torch.zeros(weight.shape[0], num_packs, dtype=weight.dtype).scatter_add_(1, pack_index, weight)
