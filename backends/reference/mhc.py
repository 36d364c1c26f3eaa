"""Reference manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual streams."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferhal.core.ops.params import MhcParams


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project positive ``[..., N, N]`` onto (nearly) doubly-stochastic matrices: columns first."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, p: MhcParams,
            *, mm=F.linear):
    # streams: [T, N, D]; fn: [(2+N)N, N*D] -> x [T, D], post [T, N], comb [T, N, N]
    t, n, d = streams.shape
    flat = streams.reshape(t, n * d).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + p.norm_eps)
    mixed = mm(flat, fn.float())
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + p.eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * s[2] + comb_b.view(n, n), dim=-1) + p.eps
    comb = sinkhorn(comb, p.sinkhorn_iters, p.eps)
    x = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return x, post, comb


def mhc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    # y: [T, D]; streams: [T, N, D]; out[t, j] = post[t, j] y[t] + sum_i comb[t, i, j] streams[t, i]
    mixed = torch.einsum("tij,tid->tjd", comb.float(), streams.float())
    return (post.unsqueeze(-1).float() * y.float().unsqueeze(1) + mixed).to(streams.dtype)


def mhc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, p: MhcParams,
             *, mm=F.linear):
    # streams: [T, N, D]; fn: [N, N*D]; base: [N]; scale: [1] -> x [T, D]
    t, n, d = streams.shape
    flat = streams.reshape(t, n * d).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + p.norm_eps)
    pre = torch.sigmoid(mm(flat, fn.float()) * scale.float()[0] + base.float()) + p.eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


OPS = {
    "mhc.head": mhc_head,
    "mhc.pre": mhc_pre,
    "mhc.post": mhc_post,
}
