"""Two native ops in plain PyTorch; every other op falls back to the reference, visibly.

Each op has the signature documented for its ID in ``inferhal.core.ops.vocabulary``. Both are
batch invariant (the profile claims it): every row is reduced on its own, and the matmul runs over
fixed 16-row tiles, so a row's result never depends on how many rows share the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE = 16


def rms_norm(x, weight, p, residual=None):
    # x: [T, D]; fp32 math, one rounding to x's dtype at the end
    h = x if residual is None else x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + p.eps)
    if weight is not None:
        w = weight.float()
        y = y * (1.0 + w if p.unit_offset else w)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


def linear(x, w, bias=None):
    # x: [T, K], w: [N, K] or a QuantWeight (dequantised with the reference's helper, then the same tiles)
    if isinstance(w, torch.Tensor):
        wd = w.to(x.dtype)
    else:
        from inferhal.core.ops.quantize import dequantize

        wd = dequantize(w, x.dtype)
    t = x.shape[0]
    pad = -t % TILE
    xp = torch.cat((x, x.new_zeros(pad, x.shape[1]))) if pad else x
    y = torch.cat([F.linear(xp[i:i + TILE], wd) for i in range(0, xp.shape[0], TILE)])[:t]
    return y if bias is None else y + bias.to(x.dtype)


OPS = {"norm.rms": rms_norm, "linear": linear}
