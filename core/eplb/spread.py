"""Drift-aware polish of a packing: lower each GPU's load *risk* without raising the layer's maximum
beyond a budget.

The next window's loads differ from the one a plan was made from; a GPU whose load rests on few heavy
replicas, or on two replicas of one expert (they move together: two replicas on one GPU act as one
replica of twice the load), swings more. A GPU's risk is ``load + DRIFT * sqrt(V)`` with
``V = sum over experts of (its replicas' total load on the GPU)^2``: the standard deviation of the GPU's
load if every expert's load moved independently by a relative ``DRIFT``. The packer minimises the
heaviest GPU; on the way it often concentrates variance (any of several near-equal packings will do for
it), and the greedy LPT packing, which spreads equal replicas one per GPU, then balances the next windows
better although it balances the current one worse.

:func:`spread_sorted` runs, per row, a swap search on the risk: each step swaps one item of the riskiest
pack with one item of any other pack when that lowers the larger risk of the two, never putting a pack
above ``cap_load[X]``. The caller sets that budget (:func:`layer_caps`: part of the way from the packer's
maximum to the greedy LPT packing's, so the current window stays at least as balanced as under LPT). Vectorised over rows
as :mod:`.packing` is; each step is a fixed number of ``[X, S, m, S]`` tensor ops.
"""

from __future__ import annotations

import torch

DRIFT = 1.0
"""Relative change of an expert's load between windows that the risk is sized for (times the usual
spread of a maximum over many GPUs); the polish is insensitive to it between ~0.8 and ~1.5."""


def pack_variance(w: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``V[X, m]`` of packs ``w[X, m, S]`` whose items are replicas of experts ``e[X, m, S]``:
    ``sum_items w * (load of the item's expert in the pack)`` = ``sum_experts (expert load in pack)^2``."""
    same = (e[..., :, None] == e[..., None, :])  # [X, m, S, S]
    return (w * (same * w[..., None, :]).sum(-1)).sum(-1)


def spread_sorted(sorted_w: torch.Tensor, sorted_expert: torch.Tensor, sorted_pack: torch.Tensor, num_packs: int,
                  cap_load: torch.Tensor, drift: float = DRIFT, max_iters: int | None = None,
                  rel_tol: float = 1e-6, top: int = 8) -> torch.Tensor:
    """Risk swap search on a packing (:mod:`.packing`'s sorted form: ``sorted_w[X, n]`` descending,
    ``sorted_expert[X, n]`` the expert of each position, ``sorted_pack[X, n]`` its pack). Returns the new
    pack of each sorted position; every pack keeps its item count and stays ``<= max(cap_load[X], its
    row's starting maximum)``. A row stops when its riskiest pack has no swap lowering the pair's larger
    risk by more than ``rel_tol`` of the mean pack load, or after ``max_iters`` (default ``2 m``) steps.
    Only the riskiest pack's ``top`` items with the largest variance shares (``w * its expert's load in
    the pack``) are tried, against every item of every other pack: ``[X, top, m, S]`` per step."""
    x, n = sorted_w.shape
    m, S = num_packs, n // num_packs
    mem = sorted_pack.argsort(dim=1, stable=True).view(x, m, S)  # sorted positions held by each pack
    w = sorted_w.gather(1, mem.view(x, n)).view(x, m, S)
    e = sorted_expert.gather(1, mem.view(x, n)).view(x, m, S)
    done = mem.clone()
    rows = torch.arange(x)
    tol = rel_tol * sorted_w.sum(dim=1).clamp(min=1e-30) / m
    cap = torch.maximum(cap_load.to(w.dtype), w.sum(-1).amax(1)) * (1 + 1e-6)  # [X]; never below the start
    ar, k = torch.arange(m), min(top, S)
    for _ in range(2 * m if max_iters is None else max_iters):
        a = rows.numel()
        load, var = w.sum(-1), pack_variance(w, e)  # [A, m]
        risk = load + drift * var.clamp(min=0).sqrt()
        g = risk.argmax(dim=1)  # [A]
        at = g[:, None, None].expand(a, 1, S)
        wg, eg = w.gather(1, at)[:, 0], e.gather(1, at)[:, 0]  # [A, S] the riskiest pack's items
        lg, vg = load.gather(1, g[:, None]), var.gather(1, g[:, None])  # [A, 1]
        same_g = eg[:, :, None] == eg[:, None, :]  # [A, S, S]
        ti = (wg * (same_g * wg[:, None, :]).sum(-1)).topk(k, dim=1).indices  # [A, k] by variance share
        wi, ei = wg.gather(1, ti), eg.gather(1, ti)
        # Swap item i of g (expert x, weight p) with item j of pack h (expert y, weight q): [A, k, m, S_j]
        p, x_ = wi[:, :, None, None], ei[:, :, None, None]
        q, y = w[:, None], e[:, None]
        n_gx = same_g.gather(1, ti[:, :, None].expand(-1, -1, S)).sum(-1)[:, :, None, None]  # replicas of x in g
        n_gy = (eg[:, None, None, :] == e[..., None]).sum(-1)[:, None]  # replicas of y in g: [A, 1, m, S_j]
        n_hx = (ei[:, :, None, None] == e[:, None]).sum(-1)[..., None]  # replicas of x in h: [A, k, m, 1]
        n_hy = (e[..., :, None] == e[..., None, :]).sum(-1)[:, None]  # replicas of y in h
        lh, vh = load[:, None, :, None], var[:, None, :, None]
        new_lg, new_lh = lg[..., None, None] - p + q, lh - q + p
        new_vg = vg[..., None, None] - (2 * n_gx - 1) * p * p + (2 * n_gy + 1) * q * q
        new_vh = vh - (2 * n_hy - 1) * q * q + (2 * n_hx + 1) * p * p
        worse = torch.maximum(new_lg + drift * new_vg.clamp(min=0).sqrt(), new_lh + drift * new_vh.clamp(min=0).sqrt())
        bad = (x_ == y) | (ar == g[:, None])[:, None, :, None] | (torch.maximum(new_lg, new_lh) > cap[:, None, None, None])
        best, at = worse.masked_fill(bad, float("inf")).view(a, -1).min(dim=1)
        ok = best < risk.gather(1, g[:, None])[:, 0] - tol
        if not bool(ok.all()):
            done[rows[~ok]] = mem[~ok]
            rows, w, e, mem, tol, cap, g, at, ti = (t[ok] for t in (rows, w, e, mem, tol, cap, g, at, ti))
            a = rows.numel()
            if a == 0:
                break
        r = torch.arange(a)
        i, h, j = ti[r, at // (m * S)], (at // S) % m, at % S
        pi, pj = g * S + i, h * S + j
        for t in (w.view(a, -1), e.view(a, -1), mem.view(a, -1)):
            u, v = t[r, pi], t[r, pj]
            t[r, pi], t[r, pj] = v, u
    done[rows] = mem
    return torch.empty(x, n, dtype=torch.long).scatter_(1, done.view(x, n), (torch.arange(n) // S).expand(x, n))


def layer_caps(sorted_w: torch.Tensor, sorted_pack: torch.Tensor, num_packs: int, rows_per_layer: int,
               budget: float) -> torch.Tensor:
    """The load no pack of a layer may pass, per row ``[X]``: ``budget`` of the way from the layer's
    heaviest pack now towards its heaviest under the greedy LPT packing of the same rows (DeepSeek's
    packing), never below now. So with ``budget <= 1`` no layer ends heavier than under the greedy, or
    than now where the greedy is lighter."""
    from inferhal.core.eplb.packing import lpt_max_sorted, pack_loads

    now = pack_loads(sorted_w, sorted_pack, num_packs).amax(1).view(-1, rows_per_layer).amax(1)  # [L]
    if budget <= 0:
        return now.repeat_interleave(rows_per_layer)
    lpt = lpt_max_sorted(sorted_w, num_packs).view(-1, rows_per_layer).amax(1)
    return torch.maximum(now, now + budget * (lpt - now)).repeat_interleave(rows_per_layer)


def spread_pack(weight: torch.Tensor, expert: torch.Tensor, pack_index: torch.Tensor, num_packs: int,
                rows_per_layer: int = 1, budget: float = 0.25, max_iters: int = 8,
                top: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`spread_sorted` on ``weight[X, n]`` (items are replicas of ``expert[X, n]``) packed as
    ``pack_index[X, n]``, rows ``rows_per_layer`` at a time forming one layer (its nodes), under
    :func:`layer_caps`."""
    from inferhal.core.eplb.packing import sort_items, unsort

    sorted_w, order = sort_items(weight)
    sorted_pack = pack_index.gather(1, order)
    cap = layer_caps(sorted_w, sorted_pack, num_packs, rows_per_layer, budget)
    out = spread_sorted(sorted_w, expert.gather(1, order), sorted_pack, num_packs, cap, max_iters=max_iters,
                        top=top)
    return unsort(out, order, num_packs)
