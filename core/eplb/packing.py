"""Balanced packing: put ``n`` weighted items into ``m`` packs of exactly ``n // m`` items each, so that the
heaviest pack is as light as possible. Every function works on a batch of rows ``[X, n]`` at once (one row
per layer, or per layer and node) with a fixed number of tensor ops per step, never a loop over rows.

- :func:`lpt_pack` (:func:`lpt_sorted`): capacity-constrained longest-processing-time greedy (heaviest item to the lightest
  pack that still has room): the baseline; ``n`` steps.
- :func:`round_pack`: LPT in rounds of ``m`` items; ``n/m`` steps.
- :func:`kk_pack`: balanced largest differencing (Karmarkar-Karp for equal-cardinality packs): ``n/m``
  partial solutions of one item per pack, repeatedly merging the two with the widest spread by pairing
  the heaviest pack of one with the lightest of the other; ``n/m - 1`` steps.
- :func:`refine_swaps`: local search: swap one item of the heaviest pack with one item of any other pack
  whenever that lowers the pair's maximum, best swap first, until no row improves.

All return ``(pack_index[X, n], rank_in_pack[X, n])``: item ``i`` of row ``x`` goes to pack
``pack_index[x, i]`` at position ``rank_in_pack[x, i]`` (positions ``0..n/m-1``, by ascending item index).
Sorting rows is the dearest op here, so the ``*_sorted`` forms work on the items already sorted by
descending weight (``sorted_w[X, n]``) and return the pack of each sorted position: a caller chaining
several of them sorts once and computes the ranks once.
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


def lpt_sorted(sorted_w: torch.Tensor, num_packs: int) -> torch.Tensor:
    """Greedy LPT on items sorted by descending weight: each to the lightest pack with a free position
    (the first ``m`` one to each empty pack at once); returns the pack of each sorted position. ``n - m``
    steps of a few in-place ``[X, m]`` ops."""
    x, n, cap = _check(sorted_w, num_packs)
    pack = torch.empty(x, n, dtype=torch.long)
    pack[:, :num_packs] = torch.arange(num_packs)
    if cap == 1:
        return pack
    load = sorted_w[:, :num_packs].clone()
    count = torch.ones(x, num_packs, dtype=torch.int32)
    one, full = torch.ones(x, 1, dtype=torch.int32), torch.tensor(float("inf"), dtype=sorted_w.dtype)
    open_load = load.clone()  # load, inf where the pack is full
    for k in range(num_packs, n):
        p = pack[:, k : k + 1]
        torch.argmin(open_load, dim=1, keepdim=True, out=p)
        load.scatter_add_(1, p, sorted_w[:, k : k + 1])
        count.scatter_add_(1, p, one)
        torch.where(count >= cap, full, load, out=open_load)
    return pack


def lpt_pack(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy: items by descending weight, each to the lightest pack with a free position."""
    return _unsorted(weight, num_packs, lpt_sorted)


def round_sorted(sorted_w: torch.Tensor, num_packs: int) -> torch.Tensor:
    """LPT in rounds: each round gives the ``m`` heaviest remaining items, heaviest first, to the packs in
    ascending order of load, one each (so counts stay equal by construction); ``n/m`` steps."""
    x, n, cap = _check(sorted_w, num_packs)
    sw = sorted_w.view(x, cap, num_packs)  # [X, rounds, m] descending
    loads = torch.zeros(x, num_packs, dtype=sorted_w.dtype)
    slot_pack = torch.empty(x, cap, num_packs, dtype=torch.long)
    for k in range(cap):
        light = loads.argsort(dim=1, stable=True)  # packs, lightest first
        slot_pack[:, k] = light
        loads.scatter_add_(1, light, sw[:, k])
    return slot_pack.view(x, n)


def round_pack(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`round_sorted` on ``weight[X, n]``."""
    return _unsorted(weight, num_packs, round_sorted)


def kk_sorted(sorted_w: torch.Tensor, num_packs: int) -> torch.Tensor:
    """Balanced largest differencing method, vectorised over rows.

    A step touches only the two partials it merges (``[X, m]`` ops); which pack each item ends in is
    resolved once at the end by replaying the merges backwards, not by relabelling items every step.
    """
    x, n, cap = _check(sorted_w, num_packs)
    if cap == 1:
        return torch.arange(n).expand(x, n).clone()
    rows = torch.arange(x)
    # Partial k holds sorted items k*m .. k*m+m-1, one per position (descending).
    sums = sorted_w.reshape(x, cap, num_packs).clone()  # [X, P, m]
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
    return final.view(x, n)


def kk_pack(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kk_sorted` on ``weight[X, n]``."""
    return _unsorted(weight, num_packs, kk_sorted)


def sort_items(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_w, order)``: ``weight[X, n]`` by descending weight (ties by item index), and the item of
    each sorted position."""
    order = weight.argsort(dim=1, descending=True, stable=True)
    return weight.gather(1, order), order


def unsort(sorted_pack: torch.Tensor, order: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pack of each sorted position back to item order, with the ranks."""
    pack = torch.empty_like(sorted_pack).scatter_(1, order, sorted_pack)
    return pack, ranks_in_pack(pack, num_packs)


def _unsorted(weight: torch.Tensor, num_packs: int, fn) -> tuple[torch.Tensor, torch.Tensor]:
    _check(weight, num_packs)
    sorted_w, order = sort_items(weight)
    return unsort(fn(sorted_w, num_packs), order, num_packs)


def best_swaps(src: torch.Tensor, src_load: torch.Tensor, dst: torch.Tensor,
               dst_load: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best 1-for-1 swap between each source pack and each of its candidate packs.

    ``src[A, S, cap]`` item weights of ``S`` source packs, ``src_load[A, S]``; ``dst[A, S, C, cap]`` the
    weights of ``C`` candidate packs per source, ascending within each pack, ``dst_load[A, S, C]``.
    Returns ``gain[A, S, C]`` (how much the pair's larger load drops; ``<= 0``: no improving swap) and the
    positions ``i`` (in the source) and ``j`` (in the candidate) of the best swap.

    Moving ``d = w_i - w_j`` from a pack of load ``M`` to one of load ``l`` leaves the pair's maximum at
    ``max(M - d, l + d) = M - h + |w_i - h - w_j|`` with ``h = (M - l) / 2``: the best partner of ``i`` is the
    item of the candidate pack nearest to ``w_i - h``, one of the two that ``searchsorted`` brackets.
    """
    cap = dst.shape[-1]
    half = (src_load[:, :, None] - dst_load) / 2  # [A, S, C]
    target = src[:, :, None, :] - half[..., None]  # [A, S, C, cap_i]: the ideal partner's weight
    hi = torch.searchsorted(dst, target).clamp_(max=cap - 1)
    lo = (hi - 1).clamp_(min=0)
    err_hi = (dst.gather(3, hi) - target).abs_()
    err_lo = (target - dst.gather(3, lo)).abs_()
    err, i = torch.minimum(err_lo, err_hi).min(dim=3)  # [A, S, C]
    at = i[..., None]
    j = hi.gather(3, at) - (err_lo.gather(3, at) < err_hi.gather(3, at)).long()  # lo = hi - 1 where it differs
    return half - err, i, j[..., 0]


def refine_sorted(sorted_w: torch.Tensor, sorted_pack: torch.Tensor, num_packs: int, max_iters: int = 100,
                  rel_tol: float = 1e-6, heavy: int | None = None, floor: torch.Tensor | None = None) -> torch.Tensor:
    """Local search on a packing: swap an item of the heaviest pack with one of any other pack, repeated.

    Each step takes, per row, the best swap (:func:`best_swaps`) between the heaviest pack and every other
    pack, and in the same step lets the next ``heavy - 1`` heaviest packs each make their best swap with
    their own share of the ``4 * (heavy - 1)`` lightest packs (every ``(heavy-1)``-th by load, so no two
    swaps touch one pack), so that packs just under the maximum come down together instead of one step
    each (default ``heavy``: ``m // 8`` capped at 4). Every accepted swap strictly lowers the larger load of its two packs and
    keeps the total, so the sorted loads decrease lexicographically and the search ends; a row stops when
    the heaviest pack has no swap gaining more than ``rel_tol`` of the mean pack load, when its heaviest
    pack is at or below ``floor[X]`` (if given), or at ``max_iters``. Stopped rows leave the working set;
    a step re-sorts only the packs it touched.
    """
    x, n, cap = _check(sorted_w, num_packs)
    m = num_packs
    k = max(1, min(4, m // 8)) if heavy is None else max(1, min(heavy, m // 2))
    share = min(4, (m - k) // (k - 1)) if k > 1 else 0  # candidate packs per extra heavy pack
    # Each pack's sorted positions, ascending by weight (positions run by descending weight).
    mem = sorted_pack.argsort(dim=1, stable=True).view(x, m, cap).flip(2)
    w = sorted_w.gather(1, mem.view(x, n)).view(x, m, cap)  # w, mem: [A, m, cap] of the working rows
    done = mem.clone()  # rows leave the working set into here
    rows = torch.arange(x)  # original index of each working row
    tol = rel_tol * sorted_w.sum(dim=1).clamp(min=1e-30) / m  # [A]
    floor = torch.full((x,), -1.0, dtype=sorted_w.dtype) if floor is None else floor.to(sorted_w.dtype)
    for _ in range(max_iters):
        load = w.sum(-1)  # [A, m]
        by_load = load.argsort(dim=1, descending=True) if k > 1 else load.argmax(dim=1, keepdim=True)
        top = by_load[:, :1]  # [A, 1] the heaviest pack
        a = rows.numel()
        gain, i, j = best_swaps(w.gather(1, top[:, :, None].expand(a, 1, cap)), load.gather(1, top),
                                w[:, None], load[:, None])  # [A, 1, m]
        gain, g = gain[:, 0].max(dim=1)
        ok = (gain > tol) & (load.gather(1, top)[:, 0] > floor)
        if not bool(ok.all()):
            done[rows[~ok]] = mem[~ok]
            rows, w, mem, tol, floor, load, by_load, top, g, i, j = (
                t[ok] for t in (rows, w, mem, tol, floor, load, by_load, top, g, i, j))
            a = rows.numel()
            if a == 0:
                break
        src, dst = top, g[:, None]  # [A, S] packs swapping, S = 1 + extra heavy packs
        pos_i, pos_j = i[:, 0].gather(1, dst), j[:, 0].gather(1, dst)
        take = torch.ones(a, 1, dtype=torch.bool)
        if share:
            more = by_load[:, 1:k]  # [A, k-1]
            cand = by_load[:, m - share * (k - 1):].reshape(a, share, k - 1).transpose(1, 2)  # [A, k-1, share]
            # extra heavy pack r's share: every (k-1)-th of the lightest packs
            cw = w.gather(1, cand.reshape(a, -1, 1).expand(-1, -1, cap)).view(a, k - 1, share, cap)
            gr, ir, jr = best_swaps(w.gather(1, more[:, :, None].expand(-1, -1, cap)), load.gather(1, more), cw,
                                    load.gather(1, cand.reshape(a, -1)).view(a, k - 1, share))
            clash = (cand == g[:, None, None]) | (more == g[:, None])[:, :, None]  # the heaviest's partner
            gr, c = gr.masked_fill(clash, float("-inf")).max(dim=2)  # [A, k-1]
            src, dst = torch.cat((src, more), 1), torch.cat((dst, cand.gather(2, c[..., None])[..., 0]), 1)
            pos_i = torch.cat((pos_i, ir.gather(2, c[..., None])[..., 0]), 1)
            pos_j = torch.cat((pos_j, jr.gather(2, c[..., None])[..., 0]), 1)
            take = torch.cat((take, gr > tol[:, None]), 1)
        r = torch.arange(a)[:, None].expand_as(take)[take]
        pi, pj = (src * cap + pos_i)[take], (dst * cap + pos_j)[take]
        wf, mf = w.view(a, -1), mem.view(a, -1)
        wi, wj, mi, mj = wf[r, pi], wf[r, pj], mf[r, pi], mf[r, pj]
        wf[r, pi], wf[r, pj], mf[r, pi], mf[r, pj] = wj, wi, mj, mi
        touched = torch.cat((src, dst), 1)[:, :, None].expand(-1, -1, cap)  # untouched ones stay sorted
        tw, o = w.gather(1, touched).sort(dim=2, stable=True)
        w.scatter_(1, touched, tw)
        mem.scatter_(1, touched, mem.gather(1, touched).gather(2, o))
    done[rows] = mem
    return torch.empty(x, n, dtype=torch.long).scatter_(1, done.view(x, n), (torch.arange(n) // cap).expand(x, n))


def refine_swaps(weight: torch.Tensor, pack_index: torch.Tensor, num_packs: int, max_iters: int = 100,
                 rel_tol: float = 1e-6, heavy: int | None = None,
                 floor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`refine_sorted` on ``weight[X, n]`` packed as ``pack_index[X, n]``."""
    _check(weight, num_packs)
    sorted_w, order = sort_items(weight)
    refined = refine_sorted(sorted_w, pack_index.gather(1, order), num_packs, max_iters, rel_tol, heavy, floor)
    return unsort(refined, order, num_packs)


def pack_loads(weight: torch.Tensor, pack_index: torch.Tensor, num_packs: int) -> torch.Tensor:
    """``[X, m]`` total weight per pack."""
    return torch.zeros(weight.shape[0], num_packs, dtype=weight.dtype).scatter_add_(1, pack_index, weight)
