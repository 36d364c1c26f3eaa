"""bf16 products over int_block weights (GGUF's integer blocks, :func:`inferhal.core.ops.quant.int_block`),
dequantised in registers by ``avx512_linear.c``'s ``ih_q8_linear`` (built by :mod:`inferhal.kernels.cpu.lib`).

The kernel reads one byte a weight (plus an fp32 scale, and offset, per block of 16 or 32) instead of bf16's
two, forms each weight's fp32 value with the loader's own two roundings, rounds it to bf16 as torch casts
and runs the AVX512-BF16 product in its order: results are bit-identical to
:func:`inferhal.kernels.cpu.amx.linear` (``kernel="avx512"``) over the dequantised bf16 weight. At one to
:data:`FUSED_MAX_ROWS` rows a product is bound by reading its weight, and the unpacking costs less than the
bytes it saves; past that the unpacking is repeated per group of rows, and callers run the bf16 copy
instead (see docs/performance.md, "GGUF integer blocks at small batches").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferhal.core.ops.quant import QuantWeight
from inferhal.kernels.cpu.lib import library

#: rows up to which the in-register kernel beats the bf16 copy (Q8_FUSED_MAX in avx512_linear.c)
FUSED_MAX_ROWS = 8


@dataclass(frozen=True)
class Packed:
    """An int_block weight in the kernel's layout: ``wq`` int8 (per 32-column block, per k pair, a 64-byte
    line), ``scale`` and ``offset`` (or None) fp32 ``[n/32, k/bk, 32]``."""

    wq: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    bk: int
    n: int
    k: int


def supports(x: torch.Tensor, w) -> bool:
    """Whether :func:`linear` runs ``x [.., K]`` against ``w`` (bf16 x on the CPU, a 2-D int_block weight
    on the CPU with K a multiple of 32)."""
    return (isinstance(w, QuantWeight) and w.format == "int_block" and len(w.shape) == 2
            and x.dtype == torch.bfloat16 and x.device.type == "cpu" and w.data.device.type == "cpu"
            and x.dim() >= 1 and x.shape[-1] == w.shape[1] and w.shape[1] % 32 == 0 and w.block[1] in (16, 32))


def pack(w: QuantWeight) -> Packed:
    """``w`` (a 2-D int_block weight, K % 32 == 0) in the kernel's layout."""
    if not supports(torch.empty(0, w.shape[-1] if w.shape else 0, dtype=torch.bfloat16), w):
        raise ValueError(f"int_block pack: needs a 2-D int_block CPU weight with K % 32 == 0, got "
                         f"{getattr(w, 'format', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    lib = library()
    n, k = w.shape
    bk = w.block[1]
    nbs = -(-n // 32)
    data, scale = w.data.contiguous(), w.scale.contiguous()
    offset = None if w.offset is None else w.offset.contiguous()
    wq = torch.empty(lib.ih_q8_packed_bytes(n, k), dtype=torch.int8)
    sc = torch.empty(nbs, k // bk, 32, dtype=torch.float32)
    of = None if offset is None else torch.empty_like(sc)
    lib.ih_q8_pack(data.data_ptr(), k, scale.data_ptr(), None if offset is None else offset.data_ptr(), n, k, bk,
                   wq.data_ptr(), sc.data_ptr(), None if of is None else of.data_ptr())
    return Packed(wq, sc, of, bk, n, k)


def linear(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """``x [..., K]`` bf16 against the packed weight -> ``[..., n]`` bf16 (fp32 sums rounded to nearest even),
    bit-identical to the bf16 product over the dequantised weight, for any number of rows."""
    if not (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() >= 1 and x.shape[-1] == p.k):
        raise ValueError(f"int_block linear: needs bf16 CPU x [..., {p.k}], got {x.dtype} {tuple(x.shape)} "
                         f"on {x.device}")
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, p.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, p.n, dtype=torch.bfloat16)
    if m:
        library().ih_q8_linear(x2.data_ptr(), m, p.k, x2.stride(0), p.wq.data_ptr(), p.scale.data_ptr(),
                               None if p.offset is None else p.offset.data_ptr(), p.bk, p.n, y.data_ptr(), p.n, 0)
    return y if flat else y.view(*x.shape[:-1], p.n)
