"""RMSNorm with the residual add fused in: ``norm.rms``.

One program per row, the whole row in one block (no split along D, so the result of a row never
depends on the batch: batch-invariant). Signature and semantics: ``norm.rms`` in
:mod:`inferhal.core.ops.vocabulary`; the oracle is ``backends/reference/ops.py:norm_rms``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import RmsNormParams
from inferhal.kernels.common import interp, round_to, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, D, stride_x, stride_r, stride_y, stride_h, eps,
                    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                    DTYPE: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # h = x + residual in the activation dtype, as the reference adds before normalising
        h = round_to(x + r, DTYPE, INTERP)
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
        x = h.to(tl.float32)
    ms = tl.sum(x * x, axis=0) / D
    y = x * tl.rsqrt(ms + eps)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            w = w + 1.0
        y = y * w
    tl.store(y_ptr + row * stride_y + cols, round_to(y, DTYPE, INTERP), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, p: RmsNormParams,
             residual: torch.Tensor | None = None, *, target: str | None = None):
    """``norm.rms``: x[..., D] -> y, or (y, h = x + residual) with a residual."""
    shape = x.shape
    d = shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty_like(x2)
    r2 = h = None
    if residual is not None:
        if residual.shape != shape:
            raise ValueError(f"norm.rms: residual shape {tuple(residual.shape)} != x shape {tuple(shape)}")
        r2 = residual.reshape(-1, d).contiguous()
        h = torch.empty_like(x2)
    if weight is not None and weight.numel() != d:
        raise ValueError(f"norm.rms: weight has {weight.numel()} elements, x has D={d}")
    cfg = config("norm_rms", target)
    n = x2.shape[0]
    if n:
        rms_norm_kernel[(n,)](
            x2, r2 if r2 is not None else x2, weight.contiguous() if weight is not None else x2, y,
            h if h is not None else y, d, x2.stride(0), r2.stride(0) if r2 is not None else 0, y.stride(0),
            h.stride(0) if h is not None else 0, float(p.eps),
            HAS_RES=residual is not None, HAS_W=weight is not None, UNIT_OFFSET=p.unit_offset,
            DTYPE=tl_dtype(x.dtype), BLOCK_D=next_pow2(d), INTERP=interp(), num_warps=cfg["num_warps"])
    y = y.view(shape)
    return y if residual is None else (y, h.view(shape))
