"""Cases of moe.route, moe.experts, mhc.pre and mhc.post."""

from __future__ import annotations

import torch

from inferhal.core.ops.params import ExpertsParams, MhcParams, RouteParams
from inferhal.core.ops.quantize import quantize_fp4_group, quantize_fp8_block
from inferhal.core.qualify.cases.base import DTYPES, OpCase, cases_for, gen, matmul_cost, nbytes, randn, row_dim0
from inferhal.core.qualify.tolerances import ulps

_ROWS0 = dict(rows=lambda a, k: a[0].shape[0], row_slice=lambda out, a, k, n: row_dim0(out, n))


def _sort_by_id(out):
    """moe.route's top-k order is unspecified: compare (weights, ids) with each row sorted by expert id."""
    w, ids = out
    order = torch.argsort(ids, dim=-1, stable=True)
    return w.gather(1, order), ids.gather(1, order)


@cases_for("moe.route")
def moe_route() -> list[OpCase]:
    out = []
    for t, e, k, scoring, bias, hashed, scaling, level in [
        (16, 8, 2, "softmax", False, False, 1.0, "quick"), (9, 64, 6, "sqrtsoftplus", True, False, 1.5, "quick"),
        (7, 32, 6, "sqrtsoftplus", False, True, 1.5, "quick"), (33, 256, 6, "sqrtsoftplus", True, False, 1.5, "full"),
        (12, 128, 8, "sigmoid", True, False, 2.5, "full"), (5, 16, 4, "softmax", False, True, 1.0, "full"),
    ]:
        for dtype in ("float32", "bfloat16"):
            def build(seed, t=t, e=e, k=k, scoring=scoring, bias=bias, hashed=hashed, scaling=scaling, dtype=dtype):
                g = gen(seed)
                logits = randn(g, t, e, dtype=DTYPES[dtype], scale=2.0)
                kw = {}
                if bias:
                    kw["bias"] = randn(g, e, scale=0.1)
                if hashed:
                    kw["hash_ids"] = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
                return (logits, RouteParams(top_k=k, scoring=scoring, renormalize=True, routed_scaling=scaling)), kw

            def take(a, kw, n):
                return (a[0][:n], a[1]), {kk: (v[:n] if kk == "hash_ids" else v) for kk, v in kw.items()}

            label = f"T={t} E={e} k={k} {scoring}" + (" +bias" if bias else "") + (" hash" if hashed else "")
            tol = ulps("float32", 64, "fp32 scores (exp, softplus, sqrt) and a renormalising sum; ids must be equal")
            out.append(OpCase("moe.route", label, dtype, build, tol, level, take=take, canon=_sort_by_id, **_ROWS0,
                              cost=lambda a, kw: (8.0 * a[0].numel(), nbytes(a[0]))))
    return out


def _quant(w: torch.Tensor, fmt: str):
    return quantize_fp8_block(w) if fmt == "fp8_block" else quantize_fp4_group(w)


@cases_for("moe.experts")
def moe_experts() -> list[OpCase]:
    out = []
    for t, d, inter, e, k, limit, fmt, level in [
        (12, 128, 64, 8, 2, 0.0, "plain", "quick"), (9, 64, 96, 6, 3, 10.0, "plain", "quick"),
        (8, 128, 128, 4, 2, 10.0, "fp8_block", "quick"), (8, 128, 64, 4, 2, 0.0, "fp4_group", "quick"),
        (40, 256, 128, 16, 6, 10.0, "plain", "full"), (17, 256, 256, 8, 6, 10.0, "fp4_group", "full"),
        (3, 256, 128, 32, 6, 0.0, "fp8_block", "full"),
    ]:
        for dtype in ("float32", "bfloat16"):
            def build(seed, t=t, d=d, inter=inter, e=e, k=k, limit=limit, fmt=fmt, dtype=dtype):
                g = gen(seed)
                dt = DTYPES[dtype]
                x = randn(g, t, d, dtype=dt)
                ids = torch.stack([torch.randperm(e + 2, generator=g)[:k] for _ in range(t)]) - 1  # -1 and E: remote
                w = torch.rand(t, k, generator=g)
                gu = randn(g, e, 2 * inter, d, scale=d ** -0.5 * 4)
                dn = randn(g, e, d, inter, scale=inter ** -0.5)
                gu, dn = (gu.to(dt), dn.to(dt)) if fmt == "plain" else (_quant(gu, fmt), _quant(dn, fmt))
                return (x, w, ids, gu, dn, ExpertsParams(swiglu_limit=limit)), {}

            def take(a, kw, n):
                return (a[0][:n], a[1][:n], a[2][:n], *a[3:]), {}

            def cost(a, kw, d=d, inter=inter, fmt=fmt):
                elem = a[0].element_size()
                w_elem = {"plain": elem, "fp8_block": 1.0, "fp4_group": 0.5}[fmt]
                routed = int(((a[2] >= 0) & (a[2] < a[3].shape[0])).sum())
                f1, _ = matmul_cost(routed, 2 * inter, d, elem)
                f2, _ = matmul_cost(routed, d, inter, elem)
                touched = len({int(i) for i in a[2].flatten() if 0 <= int(i) < a[3].shape[0]})
                return f1 + f2, touched * 3 * inter * d * w_elem + 2 * nbytes(a[0])

            n = 64 if dtype == "float32" else 16
            why = ("two GEMMs with SwiGLU between; the hidden activation is rounded to the input dtype once, which "
                   "a fused kernel may skip (one extra rounding propagated through the down projection)")
            label = f"T={t} D={d} I={inter} E={e} k={k}" + (f" limit={limit:g}" if limit else "") + \
                ("" if fmt == "plain" else f" {fmt}")
            out.append(OpCase("moe.experts", label, dtype, build, ulps(dtype, n, why), level, take=take, cost=cost,
                              **_ROWS0))
    return out


# ------------------------------------------------------------------------------------------- mHC

@cases_for("mhc.pre")
def mhc_pre() -> list[OpCase]:
    out = []
    for t, n, d, iters, level in [(8, 4, 64, 20, "quick"), (3, 2, 128, 5, "quick"), (33, 4, 256, 20, "full"),
                                  (1, 4, 512, 20, "full")]:
        for dtype in ("float32", "bfloat16"):
            def build(seed, t=t, n=n, d=d, iters=iters, dtype=dtype):
                g = gen(seed)
                streams = randn(g, t, n, d, dtype=DTYPES[dtype])
                fn = randn(g, (2 + n) * n, n * d, scale=(n * d) ** -0.5)
                base = randn(g, (2 + n) * n, scale=0.5)
                scale = torch.rand(3, generator=g) + 0.5
                return (streams, fn, base, scale, MhcParams(hc_mult=n, sinkhorn_iters=iters)), {}

            def take(a, kw, m):
                return (a[0][:m], *a[1:]), {}

            tol = ulps(dtype, 8 if dtype != "float32" else 256,
                       "fp32 mixing logits over N*D inputs, sigmoid/softmax and Sinkhorn iterations; x rounded once")
            out.append(OpCase("mhc.pre", f"T={t} N={n} D={d} iters={iters}", dtype, build, tol, level, take=take,
                              **_ROWS0, cost=lambda a, kw: matmul_cost(a[0].shape[0], a[1].shape[0], a[1].shape[1], 4)))
    return out


@cases_for("mhc.post")
def mhc_post() -> list[OpCase]:
    out = []
    for t, n, d, level in [(8, 4, 64, "quick"), (5, 2, 256, "full"), (64, 4, 512, "full")]:
        for dtype in ("float32", "bfloat16"):
            def build(seed, t=t, n=n, d=d, dtype=dtype):
                g = gen(seed)
                dt = DTYPES[dtype]
                comb = torch.softmax(randn(g, t, n, n), dim=-1)
                return (randn(g, t, d, dtype=dt), randn(g, t, n, d, dtype=dt), 2 * torch.rand(t, n, generator=g),
                        comb), {}

            def take(a, kw, m):
                return tuple(x[:m] for x in a), {}

            tol = ulps(dtype, 4 if dtype != "float32" else 16, "N+1 fp32 products summed, one output rounding")
            out.append(OpCase("mhc.post", f"T={t} N={n} D={d}", dtype, build, tol, level, take=take, **_ROWS0,
                              cost=lambda a, kw: (2.0 * a[1].numel() * (a[1].shape[1] + 1), 2 * nbytes(a[1]) + nbytes(a[0]))))
    return out


@cases_for("mhc.head")
def mhc_head() -> list[OpCase]:
    out = []
    for t, n, d, level in [(8, 4, 64, "quick"), (33, 4, 256, "full"), (2, 2, 512, "full")]:
        for dtype in ("float32", "bfloat16"):
            def build(seed, t=t, n=n, d=d, dtype=dtype):
                g = gen(seed)
                return (randn(g, t, n, d, dtype=DTYPES[dtype]), randn(g, n, n * d, scale=(n * d) ** -0.5),
                        randn(g, n, scale=0.5), torch.rand(1, generator=g) + 0.5, MhcParams(hc_mult=n)), {}

            def take(a, kw, m):
                return (a[0][:m], *a[1:]), {}

            tol = ulps(dtype, 8 if dtype != "float32" else 256,
                       "fp32 mixing logits over N*D inputs and a sigmoid; x rounded once")
            out.append(OpCase("mhc.head", f"T={t} N={n} D={d}", dtype, build, tol, level, take=take, **_ROWS0,
                              cost=lambda a, kw: matmul_cost(a[0].shape[0], a[1].shape[0], a[1].shape[1], 4)))
    return out
