"""``embed``: table rows gathered by token id, times a scale (Gemma: sqrt(D)). One program per (token,
``BLOCK_D`` columns). Oracle: ``backends/reference/ops.py:embed``, whose scale is a tensor in the table's
dtype: the wrapper rounds it to that dtype too, and the product is rounded once to the table dtype.
Ids must lie in [0, V) (as ``F.embedding`` requires; not checked here: that would synchronise the host)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.kernels.common import host_round, interp, round_to, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def embed_kernel(id_ptr, tab_ptr, y_ptr, D, stride_tab, stride_y, scale, HAS_SCALE: tl.constexpr,
                 DTYPE: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    row = tl.load(id_ptr + t).to(tl.int64)
    v = tl.load(tab_ptr + row * stride_tab + d, mask=dm, other=0.0)
    if HAS_SCALE:
        v = round_to(v.to(tl.float32) * scale, DTYPE, INTERP)
    tl.store(y_ptr + t * stride_y + d, v, mask=dm)


def embed(ids: torch.Tensor, table: torch.Tensor, scale: float = 1.0, *, target: str | None = None) -> torch.Tensor:
    """``embed``: ids[T] -> table[ids] * scale [T, D] in the table's dtype."""
    if table.dim() != 2:
        raise ValueError(f"embed: table must be [V, D], got {tuple(table.shape)}")
    flat = ids.reshape(-1)
    d = table.shape[1]
    tab = table if table.stride(1) == 1 else table.contiguous()
    y = torch.empty((flat.numel(), d), dtype=table.dtype, device=table.device)
    if flat.numel() and d:
        cfg = config("embed", target)
        bd = min(cfg["BLOCK_D"], next_pow2(d))
        s = host_round(scale, table.dtype)  # the reference's scale, rounded to the dtype (on the host)
        embed_kernel[(flat.numel(), triton.cdiv(d, bd))](flat.contiguous(), tab, y, d, tab.stride(0), y.stride(0), s,
                                                         HAS_SCALE=scale != 1.0, DTYPE=tl_dtype(table.dtype),
                                                         BLOCK_D=bd, INTERP=interp(), num_warps=cfg["num_warps"])
    return y.view(*ids.shape, d)
