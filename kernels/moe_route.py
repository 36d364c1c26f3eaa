"""MoE routing: ``moe.route`` (sqrtsoftplus | sigmoid | softmax scores, correction bias used only to
choose, top-k, renormalisation, routed scaling; or hash-routed ids). One program holds BLOCK_T whole rows of
expert logits (E <= a few hundred); rows never interact, so routing is batch-invariant.
Ties in the choice break towards the lower expert id. Oracle: ``backends/reference/moe.py:moe_route``
(its ids come unsorted from ``torch.topk``: compare per token as sets)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import RouteParams
from inferhal.kernels.common import interp  # noqa: F401
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config

SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@triton.jit
def _score(l, row_max, row_sum, SCORING: tl.constexpr):
    if SCORING == 0:
        return tl.exp(l - row_max) / row_sum
    elif SCORING == 1:
        return 1.0 / (1.0 + tl.exp(-l))
    else:
        # softplus as torch computes it (linear above 20), log1p(e) = log(u) * e / (u - 1) for accuracy
        e = tl.exp(tl.minimum(l, 20.0))
        u = 1.0 + e
        lp = tl.where(u == 1.0, e, tl.log(u) * e / tl.where(u == 1.0, 1.0, u - 1.0))
        return tl.sqrt(tl.where(l > 20.0, l, lp))


@triton.jit
def moe_route_kernel(logit_ptr, bias_ptr, hash_ptr, w_ptr, id_ptr, T, E, stride_l, scaling,
                     K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                     SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HASH: tl.constexpr, RENORM: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # BLOCK_T tokens, each row independent
    rmask = rows < T
    cols = tl.arange(0, BLOCK_E)
    valid = rmask[:, None] & (cols < E)[None, :]
    l = tl.load(logit_ptr + rows[:, None] * stride_l + cols[None, :], mask=valid, other=-float("inf")).to(tl.float32)
    row_max = tl.max(l, axis=1)
    row_max = tl.where(rmask, row_max, 0.0)
    row_sum = tl.sum(tl.where(valid, tl.exp(l - row_max[:, None]), 0.0), axis=1)
    row_sum = tl.where(rmask, row_sum, 1.0)
    kcols = tl.arange(0, BLOCK_K)
    kmask = rmask[:, None] & (kcols < K)[None, :]
    if HAS_HASH:
        ids = tl.load(hash_ptr + rows[:, None] * K + kcols[None, :], mask=kmask, other=0).to(tl.int64)
        lk = tl.load(logit_ptr + rows[:, None] * stride_l + ids, mask=kmask, other=0.0).to(tl.float32)
        w = tl.where(kmask, _score(lk, row_max[:, None], row_sum[:, None], SCORING), 0.0)
    else:
        s = _score(l, row_max[:, None], row_sum[:, None], SCORING)
        choose = s
        if HAS_BIAS:
            choose = s + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
        choose = tl.where(valid, choose, -float("inf"))
        ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
        w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for j in tl.static_range(K):
            best = tl.max(choose, axis=1)
            hit = choose == best[:, None]
            idx = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)  # lowest id among ties
            sel = cols[None, :] == idx[:, None]
            ids = tl.where(kcols[None, :] == j, idx.to(tl.int64)[:, None], ids)
            w = tl.where(kcols[None, :] == j, tl.sum(tl.where(sel, s, 0.0), axis=1)[:, None], w)
            choose = tl.where(sel, -float("inf"), choose)
    if RENORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    tl.store(w_ptr + rows[:, None] * K + kcols[None, :], w * scaling, mask=kmask)
    tl.store(id_ptr + rows[:, None] * K + kcols[None, :], ids, mask=kmask)


def moe_route(logits: torch.Tensor, p: RouteParams, bias: torch.Tensor | None = None,
              hash_ids: torch.Tensor | None = None, *, target: str | None = None):
    """``moe.route``: logits[T, E] -> (weights[T, K] fp32, ids[T, K] int64)."""
    t, e = logits.shape
    k = p.top_k
    if hash_ids is None and k > e:
        raise ValueError(f"moe.route: top_k {k} > number of experts {e}")
    if bias is not None and bias.numel() != e:
        raise ValueError(f"moe.route: bias has {bias.numel()} entries, logits have E={e}")
    if hash_ids is not None and tuple(hash_ids.shape) != (t, k):
        raise ValueError(f"moe.route: hash_ids shape {tuple(hash_ids.shape)} != (T, top_k) = {(t, k)}")
    lg = logits if logits.stride(-1) == 1 else logits.contiguous()
    w = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t:
        cfg = config("moe_route", target)
        bt = cfg["BLOCK_T"]
        moe_route_kernel[(triton.cdiv(t, bt),)](
            lg, bias.contiguous() if bias is not None else lg, hash_ids.contiguous() if hash_ids is not None else ids,
            w, ids, t, e, lg.stride(0), float(p.routed_scaling), K=k, BLOCK_T=bt, BLOCK_E=next_pow2(e),
            BLOCK_K=next_pow2(k),
            SCORING=SCORING[p.scoring], HAS_BIAS=bias is not None, HAS_HASH=hash_ids is not None,
            RENORM=p.renormalize, num_warps=cfg["num_warps"])
    return w, ids
