"""Cases of moe.dispatch and moe.combine (expert-parallel all-to-all), on one rank.

The communicator comes from the backend under test (``active.communicator(ParallelLayout())``,
``world_size == 1``): its collectives are identities, but the ops run their real code (grouping by
destination, local expert ids, the weighted sum of combine in a fixed order). Multi-rank exchange is
covered by the multi-process EP tests, not here.

- dispatch: the contract fixes *which* rows arrive and their local expert ids, not their order, so
  results are compared as a multiset (rows sorted by local id, then by value); a copy: exact.
- combine: needs the handle of the same backend's own dispatch, so ``prepare`` dispatches first; the
  "expert outputs" are a per-slot affine map of each received row (``y = x * s[e] + b[e]``), which
  does not depend on the order dispatch chose, so every backend combines the same values.
"""

from __future__ import annotations

import numpy as np
import torch

from inferhal.core.ops.params import EPParams
from inferhal.core.qualify.cases.base import DTYPES, OpCase, cases_for, gen, randn
from inferhal.core.qualify.tolerances import Tolerance, ulps

_SWEEP = [
    # T, D, K, physical slots, share of choices skipped (-1), level
    (16, 64, 2, 8, 0.0, "quick"),
    (9, 128, 6, 32, 0.2, "quick"),
    (1, 256, 6, 16, 0.0, "full"),
    (64, 512, 6, 64, 0.1, "full"),
    (33, 128, 8, 256, 0.3, "full"),
]


def _build(seed: int, t: int, d: int, k: int, e: int, skip: float, dtype: str):
    """→ x[T, D], ids[T, K] (distinct physical slots per token, some -1), weights[T, K] fp32, EPParams."""
    g = gen(seed)
    x = randn(g, t, d, dtype=DTYPES[dtype])
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[torch.rand(t, k, generator=g) < skip] = -1
    weights = torch.rand(t, k, generator=g)
    return x, ids, weights, EPParams(ep_size=1, num_physical=e)


def _sorted_rows(x: torch.Tensor, ids: torch.Tensor):
    """Rows ordered by (local id, then the row's values): the received multiset in a canonical order."""
    if x.shape[0] == 0:
        return x, ids
    cols = x.detach().float().cpu().numpy()
    order = np.lexsort((*cols.T[::-1], ids.detach().cpu().numpy()))  # last key is the primary one
    o = torch.from_numpy(order).to(x.device)
    return x[o], ids[o]


def _token_rows(x_sorted: torch.Tensor, ids_sorted: torch.Tensor, src_x: torch.Tensor):
    """The received rows (in canonical order) that came from the tokens ``src_x`` (matched by value)."""
    want = {tuple(r) for r in src_x.float().tolist()}
    keep = torch.tensor([tuple(r) in want for r in x_sorted.float().tolist()], dtype=torch.bool)
    return x_sorted[keep], ids_sorted[keep]


@cases_for("moe.dispatch")
def moe_dispatch() -> list[OpCase]:
    out = []
    for t, d, k, e, skip, level in _SWEEP:
        for dtype in ("float32", "bfloat16"):
            def build(seed, t=t, d=d, k=k, e=e, skip=skip, dtype=dtype):
                x, ids, _, p = _build(seed, t, d, k, e, skip, dtype)
                return (x, ids, None, p), {}  # None: the backend's communicator, set by prepare

            def prepare(inputs, env):
                (x, ids, _, p), kw = inputs
                return (x, ids, env.communicator(), p), kw

            def take(a, kw, n):
                return (a[0][:n], a[1][:n], *a[2:]), kw

            def row_slice(o, a, kw, n):
                return _token_rows(o[0], o[1], a[0][:n])

            def cost(a, kw):
                sent = int((a[1] >= 0).sum())
                return 0.0, 2.0 * sent * a[0].shape[1] * a[0].element_size()

            tol = Tolerance(exact=True, why="a copy of each routed row and its local expert id: bitwise equal, "
                            "compared as a multiset (the receive order is not part of the contract)")
            label = f"T={t} D={d} K={k} E={e} ep=1" + (f" skip={skip:g}" if skip else "")
            out.append(OpCase("moe.dispatch", label, dtype, build, tol, level, prepare=prepare,
                              output=lambda r, a, kw: (r.x, r.local_ids), canon=lambda o: _sorted_rows(*o),
                              rows=lambda a, kw: a[0].shape[0], take=take, row_slice=row_slice, cost=cost))
    return out


@cases_for("moe.combine")
def moe_combine() -> list[OpCase]:
    out = []
    for t, d, k, e, skip, level in _SWEEP:
        for dtype in ("float32", "bfloat16"):
            def build(seed, t=t, d=d, k=k, e=e, skip=skip, dtype=dtype):
                x, ids, w, p = _build(seed, t, d, k, e, skip, dtype)
                g = gen(seed + 1)
                scale, shift = randn(g, e, d, dtype=x.dtype), randn(g, e, d, dtype=x.dtype, scale=0.5)
                return (x, ids, w, scale, shift, p), {}

            def prepare(inputs, env):
                (x, ids, w, scale, shift, p), kw = inputs
                comm = env.communicator()
                sent = env.op("moe.dispatch")(x, ids, comm, p)  # the backend's own dispatch and handle
                y_local = sent.x * scale[sent.local_ids] + shift[sent.local_ids]  # [R, D] "expert outputs"
                return (y_local, w, sent.handle, comm, p), kw

            def take(a, kw, n):
                return (a[0][:n], a[1][:n], a[2][:n], *a[3:]), kw

            def cost(a, kw):
                sent = int((a[1] >= 0).sum())
                return 2.0 * sent * a[0].shape[1], (sent + a[0].shape[0]) * a[0].shape[1] * a[0].element_size()

            why = "K fp32 products summed in another order (the reference: k = 0..K-1), one output rounding"
            label = f"T={t} D={d} K={k} E={e} ep=1" + (f" skip={skip:g}" if skip else "")
            out.append(OpCase("moe.combine", label, dtype, build, ulps(dtype, 2 if dtype != "float32" else 4 * k, why),
                              level, prepare=prepare, rows=lambda a, kw: a[0].shape[0], take=take,
                              row_slice=lambda o, a, kw, n: o[:n], cost=cost))
    return out
