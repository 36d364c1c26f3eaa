"""Rotary embedding: ``rope.apply`` (neox or interleaved pairs, rotary channels at the head's start or
end, inverse rotation for DeepSeek-V4's attention output). One program per (token, group of heads): a
[heads, channels] tile of at most :data:`TILE_PER_WARP` elements a warp.
Oracle: ``backends/reference/ops.py:rope_apply``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import RopeParams
from inferhal.kernels.common import interp, round_to, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def rope_kernel(x_ptr, pos_ptr, cs_ptr, y_ptr, H, D, stride_xt, stride_xh, stride_yt, stride_yh, stride_cs,
                ROT_START, R_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = (h < H)[:, None]
    xrow = x_ptr + t * stride_xt + h[:, None] * stride_xh  # [BLOCK_H, 1]
    yrow = y_ptr + t * stride_yt + h[:, None] * stride_yh
    # pass-through channels (the rotary ones are overwritten below)
    cols = tl.arange(0, BLOCK_D)[None, :]
    keep = hm & (cols < D) & ((cols < ROT_START) | (cols >= ROT_START + 2 * R_HALF))
    tl.store(yrow + cols, tl.load(xrow + cols, mask=keep), mask=keep)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_R)
    m = i < R_HALF
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=m, other=1.0)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + R_HALF + i, mask=m, other=0.0)[None, :]
    if INVERSE:
        sin = -sin
    if INTERLEAVED:
        ia = ROT_START + 2 * i[None, :]
        ib = ia + 1
    else:
        ia = ROT_START + i[None, :]
        ib = ia + R_HALF
    mm = hm & m[None, :]
    a = tl.load(xrow + ia, mask=mm, other=0.0).to(tl.float32)
    b = tl.load(xrow + ib, mask=mm, other=0.0).to(tl.float32)
    tl.store(yrow + ia, round_to(a * cos - b * sin, DTYPE, INTERP), mask=mm)
    tl.store(yrow + ib, round_to(b * cos + a * sin, DTYPE, INTERP), mask=mm)


#: elements of a program's [heads, channels] tile per warp: a program rotates as many of a token's heads as fit
#: (one head per program before: T x H programs, 30 % of a tiny DeepSeek-V4 step's time in Triton's interpreter,
#: which pays per program and per operation, not per element); 16 a thread, as one 512-channel head in one warp
#: was (sm_90a: 4,096 elements in one warp spilled 152 B)
TILE_PER_WARP = 512


def heads_per_program(h: int, block_d: int, num_warps: int) -> int:
    return min(next_pow2(h), max(1, TILE_PER_WARP * num_warps // block_d))


def rope_apply(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, p: RopeParams,
               *, target: str | None = None) -> torch.Tensor:
    """``rope.apply``: x[T, H, D] -> rotated copy."""
    if x.dim() != 3:
        raise ValueError(f"rope.apply: x must be [T, H, D], got shape {tuple(x.shape)}")
    t, h, d = x.shape
    r = p.rotary_dim
    if r > d:
        raise ValueError(f"rope.apply: rotary_dim {r} > head dim {d}")
    if cos_sin.shape[-1] != r:
        raise ValueError(f"rope.apply: cos_sin last dim {cos_sin.shape[-1]} != rotary_dim {r}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cs = cos_sin.float().contiguous()
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t and h:
        cfg = config("rope", target)
        bd = next_pow2(d)
        bh = heads_per_program(h, bd, cfg["num_warps"])
        rope_kernel[(t, triton.cdiv(h, bh))](
            x, positions.contiguous(), cs, y, h, d, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cs.stride(0),
            0 if p.placement == "head" else d - r, R_HALF=r // 2, BLOCK_H=bh, BLOCK_D=bd, BLOCK_R=next_pow2(r // 2),
            INTERLEAVED=p.style == "interleaved", INVERSE=p.inverse, DTYPE=tl_dtype(x.dtype), INTERP=interp(),
            num_warps=cfg["num_warps"])
    return y
