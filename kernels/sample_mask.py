"""``sample.mask``: -inf on the logits of tokens a grammar forbids (structured outputs), from xgrammar's int32
token bitmask (bit ``v % 32`` of word ``v // 32``). One program per (constrained row, ``BLOCK_V`` tokens).
Oracle: ``backends/reference/ops.py:sample_mask``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.kernels.tuning import config


@triton.jit
def sample_mask_kernel(l_ptr, m_ptr, row_ptr, V, stride_l, stride_m, BLOCK_V: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = v < V
    row = tl.load(row_ptr + i)
    word = tl.load(m_ptr + i * stride_m + v // 32, mask=ok, other=-1)
    bit = (word >> (v % 32)) & 1
    tl.store(l_ptr + row * stride_l + v, tl.full((BLOCK_V,), float("-inf"), tl.float32), mask=ok & (bit == 0))


def sample_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, *, target: str | None = None) -> None:
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != rows.numel():
        raise ValueError(f"sample.mask: bitmask must be int32 [len(rows)={rows.numel()}, ceil(V/32)], got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"sample.mask: logits must be fp32 with contiguous rows, got {logits.dtype}")
    v = logits.shape[1]
    if bitmask.shape[1] * 32 < v:
        raise ValueError(f"sample.mask: bitmask covers {bitmask.shape[1] * 32} tokens, logits have {v}")
    if rows.numel() == 0:
        return
    m = bitmask.contiguous()
    bv = config("sample_mask", target)["BLOCK_V"]
    sample_mask_kernel[(rows.numel(), triton.cdiv(v, bv))](logits, m, rows.to(torch.int64).contiguous(), v,
                                                           logits.stride(0), m.stride(0), BLOCK_V=bv)
