"""Scatter of one KV entry per token into its page slot: ``kv.write``, optionally quantised to FP8
(e4m3, one fp32 scale per entry = amax / 448). One program per token; slot -1 is skipped.
The cache may be a strided view (the shared pool's byte pages): block and in-block strides are
honoured, the entry itself must be contiguous. Oracle: ``backends/reference/ops.py:kv_write``."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from inferhal.core.ops.params import KVWriteParams
from inferhal.kernels.common import interp, round_to, tl_dtype
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config


@triton.jit
def kv_write_kernel(v_ptr, c_ptr, sc_ptr, slot_ptr, S, BS, stride_v, stride_cb, stride_co, stride_sb, stride_so,
                    FP8: tl.constexpr, DTYPE: tl.constexpr, BLOCK_S: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = slot // BS
        off = slot % BS
        c = tl.arange(0, BLOCK_S)
        m = c < S
        v = tl.load(v_ptr + t * stride_v + c, mask=m, other=0.0).to(tl.float32)
        dst = c_ptr + blk * stride_cb + off * stride_co + c
        if FP8:
            amax = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12)
            scale = amax / 448.0
            q = tl.minimum(tl.maximum(v / scale, -448.0), 448.0)
            tl.store(dst, round_to(q, tl.float8e4nv, INTERP), mask=m)
            tl.store(sc_ptr + blk * stride_sb + off * stride_so, scale)
        else:
            tl.store(dst, round_to(v, DTYPE, INTERP), mask=m)


def kv_write(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, p: KVWriteParams = KVWriteParams(),
             scale_cache: torch.Tensor | None = None, *, target: str | None = None) -> None:
    """``kv.write``: values[T, *slot] into cache[NB, BS, *slot] at slot_mapping[T] (in place); with
    ``p.record`` one FP8/FP4 record per entry (:mod:`inferhal.kernels.kv_records`)."""
    if p.record is not None:
        from inferhal.kernels.kv_records import kv_write_record

        return kv_write_record(values, cache, slot_mapping, p.record, target=target)
    slot_shape = tuple(cache.shape[2:])
    if tuple(values.shape[1:]) != slot_shape:
        raise ValueError(f"kv.write: values entries {tuple(values.shape[1:])} != cache slot shape {slot_shape}")
    s = math.prod(slot_shape)
    inner = cache[0, 0] if cache.shape[0] and cache.shape[1] else None
    if inner is not None and not inner.is_contiguous():
        raise ValueError("kv.write: one cache entry must be contiguous (block and slot strides may be anything)")
    fp8 = p.quant == "fp8"
    if fp8:
        if scale_cache is None:
            raise ValueError("kv.write with quant='fp8' needs scale_cache [NB, BS]")
        if cache.dtype != torch.float8_e4m3fn or scale_cache.dtype != torch.float32:
            raise ValueError(f"kv.write fp8: cache must be float8_e4m3fn and scale_cache float32, got {cache.dtype}, "
                             f"{scale_cache.dtype}")
    t = values.shape[0]
    if t:
        v = values.reshape(t, s).contiguous()
        sc = scale_cache if fp8 else cache
        cfg = config("kv_write", target)
        kv_write_kernel[(t,)](v, cache, sc, slot_mapping.contiguous(), s, cache.shape[1], v.stride(0), cache.stride(0),
                              cache.stride(1), sc.stride(0), sc.stride(1), FP8=fp8,
                              DTYPE=tl_dtype(cache.dtype) if not fp8 else tl.float32, BLOCK_S=next_pow2(s),
                              INTERP=interp(), num_warps=cfg["num_warps"])
