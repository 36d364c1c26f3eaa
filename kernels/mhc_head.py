"""``mhc.head``: DeepSeek-V4's final hyper-connection head, streams [T, N, D] -> x [T, D] before the final
norm and the LM head. One program per token (no split: batch-invariant): one pass over the flattened
streams for their mean square and the N mixing dot products with fn (the RMS factor applied after the
sum: the same value as normalising first, up to fp32 rounding), pre = sigmoid(scale * mixed + base) + eps,
then x = sum_n pre[n] streams[n], rounded once. Oracle: ``backends/reference/mhc.py:mhc_head``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import MhcParams
from inferhal.kernels.common import interp, round_to, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def mhc_head_kernel(s_ptr, fn_ptr, base_ptr, scale_ptr, x_ptr, N, D, stride_st, stride_fn, stride_x, eps, norm_eps,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    nd = N * D
    n = tl.arange(0, BLOCK_N)
    nm = n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, nd, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(s_ptr + t * stride_st + c, mask=c < nd, other=0.0).to(tl.float32)
        sq += v * v
        f = tl.load(fn_ptr + n[:, None] * stride_fn + c[None, :], mask=nm[:, None] & (c < nd)[None, :], other=0.0)
        acc += tl.sum(f.to(tl.float32) * v[None, :], axis=1)
    rs = tl.rsqrt(tl.sum(sq, axis=0) / nd + norm_eps)
    b = tl.load(base_ptr + n, mask=nm, other=0.0).to(tl.float32)
    pre = 1.0 / (1.0 + tl.exp(-(acc * rs * tl.load(scale_ptr) + b))) + eps
    pre = tl.where(nm, pre, 0.0)
    for d0 in range(0, D, BLOCK_K):
        d = d0 + tl.arange(0, BLOCK_K)
        st = tl.load(s_ptr + t * stride_st + n[:, None] * D + d[None, :], mask=nm[:, None] & (d < D)[None, :], other=0.0)
        x = tl.sum(pre[:, None] * st.to(tl.float32), axis=0)
        tl.store(x_ptr + t * stride_x + d, round_to(x, DTYPE, INTERP), mask=d < D)


def mhc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, p: MhcParams,
             *, target: str | None = None) -> torch.Tensor:
    """``mhc.head``: streams[T, N, D], fn[N, N*D], base[N], scale[1] -> x[T, D] in the streams' dtype."""
    t, n, d = streams.shape
    if tuple(fn.shape) != (n, n * d) or base.numel() != n or scale.numel() != 1:
        raise ValueError(f"mhc.head: fn must be [{n}, {n * d}], base [{n}], scale [1]; got {tuple(fn.shape)}, "
                         f"{tuple(base.shape)}, {tuple(scale.shape)}")
    s = streams.contiguous()
    x = torch.empty((t, d), dtype=streams.dtype, device=streams.device)
    if t:
        cfg = config("mhc_head", target)
        f = fn.float().contiguous()
        mhc_head_kernel[(t,)](s, f, base.float().contiguous(), scale.float().contiguous(), x, n, d, s.stride(0),
                              f.stride(0), x.stride(0), float(p.eps), float(p.norm_eps), BLOCK_N=next_pow2(n),
                              BLOCK_K=min(cfg["BLOCK_K"], next_pow2(n * d)), DTYPE=tl_dtype(streams.dtype),
                              INTERP=interp(), num_warps=cfg["num_warps"])
    return x
