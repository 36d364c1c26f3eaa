"""Manifold-constrained hyper-connections (DeepSeek-V4): ``mhc.pre`` and ``mhc.post``.

``mhc.pre``: one program per token: RMS of the flattened streams, the (2+N)N mixing logits as one
pass over fn (no split: batch-invariant), sigmoid / 2·sigmoid / softmax, ``sinkhorn_iters``
Sinkhorn-Knopp steps on the N x N matrix in registers, and the pre-weighted stream sum.
``mhc.post``: one program per (token, D-block): streams' = post ⊗ y + combᵀ · streams.
Oracle: ``backends/reference/mhc.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import MhcParams
from inferhal.kernels.common import interp, round_to, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def mhc_pre_kernel(s_ptr, fn_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr, N, D, stride_st, stride_fn,
                   eps, norm_eps, ITERS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
                   BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    nd = N * D
    nj = (2 + N) * N
    j = tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_J,), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, nd, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(s_ptr + t * stride_st + c, mask=c < nd, other=0.0).to(tl.float32)
        sq += v * v
        f = tl.load(fn_ptr + j[:, None] * stride_fn + c[None, :], mask=(j < nj)[:, None] & (c < nd)[None, :], other=0.0)
        acc += tl.sum(f.to(tl.float32) * v[None, :], axis=1)
    rs = tl.rsqrt(tl.sum(sq, axis=0) / nd + norm_eps)
    mixed = acc * rs + 0.0  # [BLOCK_J]: pre | post | comb (row-major N x N)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    b = tl.load(base_ptr + j, mask=j < nj, other=0.0).to(tl.float32)
    n = tl.arange(0, BLOCK_N)
    nm = n < N
    pick = j[None, :] == n[:, None]  # [BLOCK_N, BLOCK_J]
    pre = tl.sum(tl.where(pick, mixed[None, :] * s0 + b[None, :], 0.0), axis=1)
    pre = 1.0 / (1.0 + tl.exp(-pre)) + eps
    pick = j[None, :] == (N + n)[:, None]
    post = tl.sum(tl.where(pick, mixed[None, :] * s1 + b[None, :], 0.0), axis=1)
    post = 2.0 / (1.0 + tl.exp(-post))
    idx = 2 * N + n[:, None] * N + n[None, :]  # [BLOCK_N, BLOCK_N]
    pick3 = j[None, None, :] == idx[:, :, None]
    logit = tl.sum(tl.where(pick3, mixed[None, None, :] * s2 + b[None, None, :], 0.0), axis=2)
    valid = nm[:, None] & nm[None, :]
    logit = tl.where(valid, logit, -float("inf"))
    ex = tl.exp(logit - tl.max(logit, axis=1)[:, None])
    ex = tl.where(valid, ex, 0.0)
    comb = ex / tl.where(nm, tl.sum(ex, axis=1), 1.0)[:, None] + eps
    comb = tl.where(valid, comb, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)  # columns first, as the reference
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(post_ptr + t * N + n, post, mask=nm)
    tl.store(comb_ptr + t * N * N + n[:, None] * N + n[None, :], comb, mask=valid)
    for d0 in range(0, D, BLOCK_K):
        d = d0 + tl.arange(0, BLOCK_K)
        st = tl.load(s_ptr + t * stride_st + n[:, None] * D + d[None, :], mask=nm[:, None] & (d < D)[None, :], other=0.0)
        x = tl.sum(tl.where(nm, pre, 0.0)[:, None] * st.to(tl.float32), axis=0)
        tl.store(x_ptr + t * D + d, round_to(x, DTYPE, INTERP), mask=d < D)


@triton.jit
def mhc_post_kernel(y_ptr, s_ptr, post_ptr, comb_ptr, o_ptr, N, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DTYPE: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    n = tl.arange(0, BLOCK_N)
    nm = n < N
    y = tl.load(y_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
    st = tl.load(s_ptr + t * N * D + n[:, None] * D + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
    comb = tl.load(comb_ptr + t * N * N + n[:, None] * N + n[None, :], mask=nm[:, None] & nm[None, :], other=0.0)
    post = tl.load(post_ptr + t * N + n, mask=nm, other=0.0)
    # out[j, d] = post[j] y[d] + sum_i comb[i, j] st[i, d]
    mixed = tl.sum(comb.to(tl.float32)[:, :, None] * st.to(tl.float32)[:, None, :], axis=0)
    out = post.to(tl.float32)[:, None] * y[None, :] + mixed
    tl.store(o_ptr + t * N * D + n[:, None] * D + d[None, :], round_to(out, DTYPE, INTERP), mask=nm[:, None] & dm[None, :])


def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, p: MhcParams,
            *, target: str | None = None):
    """``mhc.pre``: streams[T, N, D] -> (x[T, D], post[T, N] fp32, comb[T, N, N] fp32)."""
    t, n, d = streams.shape
    if n != p.hc_mult:
        raise ValueError(f"mhc.pre: streams have N={n}, params say hc_mult={p.hc_mult}")
    nj = (2 + n) * n
    if tuple(fn.shape) != (nj, n * d) or base.numel() != nj or scale.numel() != 3:
        raise ValueError(f"mhc.pre: fn must be [{nj}, {n * d}], base [{nj}], scale [3]; got {tuple(fn.shape)}, "
                         f"{tuple(base.shape)}, {tuple(scale.shape)}")
    s = streams.contiguous()
    x = torch.empty((t, d), dtype=streams.dtype, device=streams.device)
    post = torch.empty((t, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((t, n, n), dtype=torch.float32, device=streams.device)
    if t:
        cfg = config("mhc_pre", target)
        f = fn.contiguous()
        mhc_pre_kernel[(t,)](s, f, base.float().contiguous(), scale.float().contiguous(), x, post, comb, n, d,
                             s.stride(0), f.stride(0), float(p.eps), float(p.norm_eps), ITERS=p.sinkhorn_iters,
                             BLOCK_N=next_pow2(n), BLOCK_J=next_pow2(nj), BLOCK_K=cfg["BLOCK_K"],
                             DTYPE=tl_dtype(streams.dtype), INTERP=interp(), num_warps=cfg["num_warps"])
    return x, post, comb


def mhc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             *, target: str | None = None) -> torch.Tensor:
    """``mhc.post``: streams'[T, N, D] = post ⊗ y + combᵀ · streams."""
    t, n, d = streams.shape
    out = torch.empty_like(streams, memory_format=torch.contiguous_format)
    if t:
        cfg = config("mhc_post", target)
        bd = min(cfg["BLOCK_D"], next_pow2(d))
        mhc_post_kernel[(t, triton.cdiv(d, bd))](y.contiguous(), streams.contiguous(), post.contiguous(),
                                                 comb.contiguous(), out, n, d, BLOCK_N=next_pow2(n), BLOCK_D=bd,
                                                 DTYPE=tl_dtype(streams.dtype), INTERP=interp(),
                                                 num_warps=cfg["num_warps"])
    return out
