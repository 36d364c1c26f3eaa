"""FP8 / FP4 KV records (formats as data: ``core/paging/formats.py``) on the GPU: ``kv.write`` encoding one
record per token into a uint8 page slot, and a row decoder (records gathered by flat slot → fp32 values).

One program per token (or gathered row). Every rounding is done with integer arithmetic that the formats
module defines, so the bytes equal the reference codec's (``backends/reference/kv_records.py``) on the device
and in the interpreter alike: e4m3 codes round to nearest even (``common.round_to``), ue8m0 exponents are
``ceil(log2(amax / max_code))`` from the float's bits, the RoPE part is bf16 by round-to-nearest-even on the
bits, divisions are correctly rounded (``div_rn``). Channels go in even/odd pairs (blocks are even: 16, 32,
64, 128), which is how e2m1 packs two codes per byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferhal.kernels.common import interp, round_to
from inferhal.kernels.runtime import next_pow2
from inferhal.kernels.tuning import config

CODES = {"e4m3": 0, "e2m1": 1}
SCALES = {"ue8m0": 0, "fp32": 1, "e4m3": 2}


@triton.jit
def _div(a, b, INTERP: tl.constexpr):
    if INTERP:
        return a / b
    return tl.math.div_rn(a, b)


@triton.jit
def _e2m1(y):
    """fp32 (already scaled) → e2m1 code 0..15, ties to the even code, magnitudes above 6 clip to 6."""
    a = tl.abs(y)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
           + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return mag | ((y < 0).to(tl.int32) << 3)


@triton.jit
def _e2m1_value(c):
    """e2m1 code (int32 0..15) → fp32: 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    m = c & 7
    e = m >> 1
    v = tl.where(m < 2, m.to(tl.float32) * 0.5, (1.0 + (m & 1).to(tl.float32) * 0.5) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _e2m1_bits(c):
    """e2m1 code (int32 0..15) → fp32 built from its bits: magnitude code x = 2e + m is 2**(e-1) (1 + m/2) =
    the float with bits (x << 22) + (126 << 23) for x >= 2, and x / 2 for the zero and subnormal codes."""
    x = c & 7
    v = tl.where(x >= 2, ((x << 22) + (126 << 23)).to(tl.float32, bitcast=True), x.to(tl.float32) * 0.5)
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _e4m3_value(b):
    """e4m3 byte (int32 0..255) → fp32 (no NaN: 0x7F / 0xFF are never written)."""
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    v = tl.where(e == 0, m * 0.001953125, ((e + 120) << 23).to(tl.float32, bitcast=True) * (1.0 + m * 0.125))
    return tl.where((b & 128) != 0, -v, v)


@triton.jit
def load_records(c_ptr, row, ok, d, D, CODE: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                 CODED: tl.constexpr, RAW_AT: tl.constexpr, SCALES_AT: tl.constexpr, UNSCALED: tl.constexpr = False):
    """Decoded fp32 ``[len(row), len(d)]``: channels ``d`` of the records at element offsets ``row`` (the
    record's first byte in ``c_ptr``), zero where not ``ok`` or ``d >= D`` (what an attention kernel's key tile
    load gives for a value cache). ``UNSCALED``: the codes' values only (the caller applies the scales,
    :func:`record_row_scale`), exact in bf16."""
    m = ok[:, None] & (d < D)[None, :]
    coded = (d < CODED)[None, :]
    base = c_ptr + row[:, None]
    if CODE == 0:
        v = _e4m3_value(tl.load(base + d[None, :], mask=m & coded, other=0).to(tl.int32))
    else:
        b = tl.load(base + (d // 2)[None, :], mask=m & coded, other=0).to(tl.int32)
        v = _e2m1_value((b >> (4 * (d & 1))[None, :]) & 15)
    si = (d // BLOCK)[None, :]
    if UNSCALED:
        scale = 1.0
    elif SCALE == 0:
        sb = tl.load(base + SCALES_AT + si, mask=m & coded, other=0).to(tl.int32)
        scale = tl.where(sb == 0, 0.0, (sb << 23).to(tl.float32, bitcast=True))
    elif SCALE == 1:
        bits = tl.load(base + SCALES_AT + 4 * si, mask=m & coded, other=0).to(tl.int32)
        for k in tl.static_range(1, 4):
            bits = bits | (tl.load(base + SCALES_AT + 4 * si + k, mask=m & coded, other=0).to(tl.int32) << (8 * k))
        scale = bits.to(tl.float32, bitcast=True)
    else:
        scale = _e4m3_value(tl.load(base + SCALES_AT + si, mask=m & coded, other=0).to(tl.int32))
    v = v * scale
    if CODED < D:  # the RoPE channels, bf16
        r = (d - CODED)[None, :]
        rm = m & (d >= CODED)[None, :]
        lo = tl.load(base + RAW_AT + 2 * r, mask=rm, other=0).to(tl.int32)
        hi = tl.load(base + RAW_AT + 2 * r + 1, mask=rm, other=0).to(tl.int32)
        v = tl.where(coded, v, ((lo | (hi << 8)) << 16).to(tl.float32, bitcast=True))
    return tl.where(m, v, 0.0)


@triton.jit
def decode_tile(c_ptr, row, ok, D, DTYPE: tl.constexpr, CODE: tl.constexpr, SCALE: tl.constexpr,
                BLOCK: tl.constexpr, CODED: tl.constexpr, RAW_AT: tl.constexpr, SCALES_AT: tl.constexpr,
                BLOCK_D: tl.constexpr, GROUP: tl.constexpr, ALIGN: tl.constexpr, UNSCALED: tl.constexpr = False):
    """The records at byte offsets ``row [N]`` decoded into ``[N, BLOCK_D]`` of ``DTYPE`` (zeros where not
    ``ok`` or past ``D``): the same values as :func:`load_records`, with fewer live registers for the wide
    tiles of the split-KV kernels. Channels are handled as ``[N, BLOCK_D // GROUP, GROUP]`` with one scale
    load per (record, group) (``GROUP`` = min(scale block, BLOCK_D)); e4m3 codes go through the hardware's
    conversion from bytes loaded ``ALIGN``-wide (every row offset is a multiple of ``ALIGN``), an e2m1 channel
    reads its byte's nibble and builds the float from the bits (joining the two nibbles of a byte instead
    spilled 1.4-2.9 KB on sm_90a/sm_100a), the RoPE channels are loaded as bf16. A code times its
    ue8m0 / e4m3 scale is exact in bf16 (at most 4 + 4 significant bits), so ``DTYPE`` bf16 rounds nothing
    for main records. ``UNSCALED``: the codes' values only (the caller applies the scales, as
    :func:`load_records`)."""
    N: tl.constexpr = row.shape[0]
    G: tl.constexpr = BLOCK_D // GROUP
    row = tl.multiple_of(row, ALIGN)
    g = tl.arange(0, G)[None, :, None]
    okr = ok[:, None, None]
    dd = g * GROUP + tl.arange(0, GROUP)[None, None, :]  # [1, G, GROUP] channel
    base = c_ptr + row[:, None, None]
    if CODE == 0:  # e4m3 bytes
        v = tl.load(c_ptr.to(tl.pointer_type(tl.float8e4nv)) + row[:, None, None] + dd, mask=okr & (dd < CODED),
                    other=0.0).to(tl.float32)
    else:  # e2m1: byte i holds channels 2i (low nibble) and 2i + 1
        b = tl.load(base + dd // 2, mask=okr & (dd < CODED), other=0).to(tl.int32)
        v = _e2m1_bits((b >> ((dd & 1) * 4)) & 15)
    si = (g * GROUP) // BLOCK  # [1, G, 1]
    sm = okr & (g * GROUP < CODED)
    if UNSCALED:
        scale = 1.0
    elif SCALE == 0:
        sb = tl.load(base + SCALES_AT + si, mask=sm, other=0).to(tl.int32)
        scale = tl.where(sb == 0, 0.0, (sb << 23).to(tl.float32, bitcast=True))
    elif SCALE == 1:
        bits = tl.load(base + SCALES_AT + 4 * si, mask=sm, other=0).to(tl.int32)
        for k in tl.static_range(1, 4):
            bits = bits | (tl.load(base + SCALES_AT + 4 * si + k, mask=sm, other=0).to(tl.int32) << (8 * k))
        scale = bits.to(tl.float32, bitcast=True)
    else:
        scale = tl.load(c_ptr.to(tl.pointer_type(tl.float8e4nv)) + row[:, None, None] + SCALES_AT + si, mask=sm,
                        other=0.0).to(tl.float32)
    v = v * scale
    if CODED < D:  # the RoPE channels, bf16 at an even byte offset
        raw = tl.load(c_ptr.to(tl.pointer_type(tl.bfloat16)) + (row[:, None, None] + RAW_AT) // 2 + (dd - CODED),
                      mask=okr & (dd >= CODED) & (dd < D), other=0.0).to(tl.float32)
        v = tl.where(dd < CODED, v, raw)
    return tl.reshape(v, (N, BLOCK_D)).to(DTYPE)


@triton.jit
def record_row_scale(c_ptr, row, ok, SCALES_AT: tl.constexpr):
    """The fp32 scale of each record at ``row`` whose coded channels form one block (FP8 indexer keys of
    at most 128 channels): a product with the unscaled codes times this equals the product with the values."""
    bits = tl.load(c_ptr + row + SCALES_AT, mask=ok, other=0).to(tl.int32)
    for k in tl.static_range(1, 4):
        bits = bits | (tl.load(c_ptr + row + SCALES_AT + k, mask=ok, other=0).to(tl.int32) << (8 * k))
    return bits.to(tl.float32, bitcast=True)


def record_args(fmt) -> dict:
    """The constexprs :func:`load_records` takes for records of ``fmt`` (None: a value cache, all unused)."""
    if fmt is None:
        return {"RECORD": False, "CODE": 0, "SCALE": 0, "RBLOCK": 1, "CODED": 0, "RAW_AT": 0, "SCALES_AT": 0}
    return {"RECORD": True, "CODE": CODES[fmt.code], "SCALE": SCALES[fmt.scale], "RBLOCK": fmt.block,
            "CODED": fmt.coded, "RAW_AT": fmt.raw_at, "SCALES_AT": fmt.scales_at}


def tile_args(fmt, block_d: int, cache: torch.Tensor | None = None) -> dict:
    """The constexprs :func:`decode_tile` takes beyond :func:`record_args`: ``GROUP`` and ``ALIGN`` (the
    largest power of two up to 16 dividing the cache's strides and byte offset; 8 without a cache)."""
    if fmt is None:
        return {"GROUP": 16, "ALIGN": 1}
    align = 8
    if cache is not None:
        import math

        align = math.gcd(16, cache.stride(0), cache.stride(1), cache.data_ptr() % 16 or 16)
    if fmt.raw_dims and (align % 2 or fmt.raw_at % 2):
        raise ValueError(f"{fmt.name} records: the bf16 RoPE channels must start at an even byte")
    return {"GROUP": min(fmt.block, block_d), "ALIGN": align}


@triton.jit
def kv_record_write_kernel(v_ptr, c_ptr, slot_ptr, BS, stride_v, stride_cb, stride_co,
                           CODE: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr, CODED: tl.constexpr,
                           NS_P2: tl.constexpr, RAW: tl.constexpr, RAW_P2: tl.constexpr, RAW_AT: tl.constexpr,
                           SCALES_AT: tl.constexpr, PAD_AT: tl.constexpr, PAD: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        dst = c_ptr + (slot // BS) * stride_cb + (slot % BS) * stride_co
        src = v_ptr + t * stride_v
        s = tl.arange(0, NS_P2)[:, None]
        j = tl.arange(0, BLOCK // 2)[None, :]
        ch = s * BLOCK + 2 * j  # even channel of each pair
        ok = ch < CODED
        ev = tl.load(src + ch, mask=ok, other=0.0).to(tl.float32)
        od = tl.load(src + ch + 1, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(ev), axis=1), tl.max(tl.abs(od), axis=1))  # [NS_P2]
        CMAX: tl.constexpr = 448.0 if CODE == 0 else 6.0
        ratio = _div(amax, tl.full(amax.shape, CMAX, tl.float32), INTERP)
        srow = tl.arange(0, NS_P2)
        sok = srow * BLOCK < CODED
        if SCALE == 0:  # ue8m0: the least power of two >= ratio, exponent in [-126, 127]
            bits = ratio.to(tl.int32, bitcast=True)
            ex = (bits >> 23) & 255
            e = tl.where((bits & 0x7FFFFF) != 0, ex - 126, ex - 127)
            e = tl.minimum(tl.maximum(tl.where(ex == 0, -126, e), -126), 127)
            scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
            tl.store(dst + SCALES_AT + srow, (e + 127).to(tl.uint8), mask=sok)
        elif SCALE == 1:  # fp32 amax / max_code, stored little-endian
            scale = tl.maximum(ratio, 1.1754943508222875e-38)
            sb = scale.to(tl.int32, bitcast=True)
            for k in tl.static_range(4):
                tl.store(dst + SCALES_AT + 4 * srow + k, ((sb >> (8 * k)) & 255).to(tl.uint8), mask=sok)
        else:  # e4m3 amax / 6, rounded to nearest even
            s8 = round_to(tl.minimum(ratio, 448.0), tl.float8e4nv, INTERP)
            scale = s8.to(tl.float32)
            tl.store(dst + SCALES_AT + srow, s8.to(tl.uint8, bitcast=True), mask=sok)
        safe = tl.where(scale > 0, scale, 1.0)[:, None]
        ye = _div(ev, safe + tl.zeros(ev.shape, tl.float32), INTERP)
        yo = _div(od, safe + tl.zeros(od.shape, tl.float32), INTERP)
        if CODE == 0:
            qe = round_to(tl.minimum(tl.maximum(ye, -448.0), 448.0), tl.float8e4nv, INTERP).to(tl.uint8, bitcast=True)
            qo = round_to(tl.minimum(tl.maximum(yo, -448.0), 448.0), tl.float8e4nv, INTERP).to(tl.uint8, bitcast=True)
            tl.store(dst + ch, qe, mask=ok)
            tl.store(dst + ch + 1, qo, mask=ok & (ch + 1 < CODED))
        else:
            byte = _e2m1(ye) | (tl.where(ch + 1 < CODED, _e2m1(yo), 0) << 4)
            tl.store(dst + ch // 2, byte.to(tl.uint8), mask=ok)
        if RAW > 0:  # the RoPE channels in bf16, round to nearest even on the bits
            i = tl.arange(0, RAW_P2)
            rk = i < RAW
            r = tl.load(src + CODED + i, mask=rk, other=0.0).to(tl.float32)
            rb = r.to(tl.uint32, bitcast=True)
            h = (rb + 0x7FFF + ((rb >> 16) & 1)) >> 16
            tl.store(dst + RAW_AT + 2 * i, (h & 255).to(tl.uint8), mask=rk)
            tl.store(dst + RAW_AT + 2 * i + 1, ((h >> 8) & 255).to(tl.uint8), mask=rk)
        if PAD > 0:
            k = tl.arange(0, 8)
            tl.store(dst + PAD_AT + k, tl.zeros((8,), tl.uint8), mask=k < PAD)


@triton.jit
def kv_record_decode_kernel(c_ptr, row_ptr, o_ptr, D, BS, stride_cb, stride_co, stride_o,
                            CODE: tl.constexpr, SCALE: tl.constexpr, RBLOCK: tl.constexpr, CODED: tl.constexpr,
                            RAW_AT: tl.constexpr, SCALES_AT: tl.constexpr, BLOCK_D: tl.constexpr,
                            TILE: tl.constexpr = False, GROUP: tl.constexpr = 16, ALIGN: tl.constexpr = 1):
    """One record per program, through the attention kernels' tile decoder: :func:`load_records`, or
    :func:`decode_tile` (``TILE``)."""
    r = tl.program_id(0).to(tl.int64)
    flat = tl.load(row_ptr + r + tl.zeros((1,), tl.int64))  # [1]
    ok = flat >= 0  # no entry: zeros, as a zero record decodes
    safe = tl.maximum(flat, 0)
    d = tl.arange(0, BLOCK_D)
    row = (safe // BS) * stride_cb + (safe % BS) * stride_co
    if TILE:
        v = decode_tile(c_ptr, row, ok, D, tl.float32, CODE, SCALE, RBLOCK, CODED, RAW_AT, SCALES_AT, BLOCK_D, GROUP,
                        ALIGN)
    else:
        v = load_records(c_ptr, row, ok, d, D, CODE, SCALE, RBLOCK, CODED, RAW_AT, SCALES_AT)  # [1, BLOCK_D]
    tl.store(o_ptr + r * stride_o + d[None, :], v, mask=(d < D)[None, :])


def _constexprs(fmt) -> dict:
    ns = fmt.num_scales
    return {"CODE": CODES[fmt.code], "SCALE": SCALES[fmt.scale], "BLOCK": fmt.block, "CODED": fmt.coded,
            "NS_P2": next_pow2(ns), "RAW": fmt.raw_dims, "RAW_P2": next_pow2(max(fmt.raw_dims, 1)),
            "RAW_AT": fmt.raw_at, "SCALES_AT": fmt.scales_at}


def decode_constexprs(fmt) -> dict:
    """The constexprs of :func:`kv_record_decode_kernel` for records of ``fmt``."""
    args = {k: v for k, v in record_args(fmt).items() if k != "RECORD"}
    return {**args, "BLOCK_D": next_pow2(fmt.dims)}


def check_record_cache(cache: torch.Tensor, fmt, what: str) -> None:
    """A cache of ``fmt`` records: uint8 ``[NB, BS, nbytes]``, each record contiguous (even blocks and widths)."""
    if fmt.block % 2 or fmt.coded % 2:
        raise ValueError(f"{what} {fmt.name}: the kernels take an even block and coded width, got {fmt.block}, {fmt.coded}")
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != fmt.nbytes or cache.stride(2) != 1:
        raise ValueError(f"{what} {fmt.name}: cache must be uint8 [NB, BS, {fmt.nbytes}] with contiguous records, got "
                         f"{cache.dtype} {tuple(cache.shape)}")


def kv_write_record(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, fmt, *,
                    target: str | None = None) -> None:
    """``kv.write`` with ``KVWriteParams.record = fmt``: values ``[T, dims]`` (any float dtype) as records into
    ``cache uint8 [NB, BS, nbytes]`` at ``slot_mapping [T]`` (-1 skips)."""
    check_record_cache(cache, fmt, "kv.write")
    t = values.shape[0]
    if not t:
        return
    v = values.reshape(t, -1)
    if v.shape[1] != fmt.dims:
        raise ValueError(f"kv.write {fmt.name}: values must be [T, {fmt.dims}], got {tuple(values.shape)}")
    v = v.contiguous()
    used = fmt.scales_at + fmt.num_scales * (4 if fmt.scale == "fp32" else 1)
    cfg = config("kv_write", target)
    kv_record_write_kernel[(t,)](v, cache, slot_mapping.contiguous(), cache.shape[1], v.stride(0), cache.stride(0),
                                 cache.stride(1), **_constexprs(fmt), PAD_AT=used, PAD=fmt.nbytes - used,
                                 INTERP=interp(), num_warps=cfg["num_warps"])


def decode_rows(cache: torch.Tensor, flat: torch.Tensor, fmt, *, target: str | None = None,
                tile: bool = False) -> torch.Tensor:
    """fp32 ``[N, dims]``: the records at flat slots ``flat [N]`` (block * BS + offset; -1 → zeros) of
    ``cache uint8 [NB, BS, nbytes]``, decoded by :func:`load_records` (or :func:`decode_tile` with ``tile``)."""
    check_record_cache(cache, fmt, "kv records")
    n = flat.numel()
    out = torch.empty(n, fmt.dims, dtype=torch.float32, device=cache.device)
    if n:
        cfg = config("kv_write", target)
        kv_record_decode_kernel[(n,)](cache, flat.reshape(-1).to(torch.int64).contiguous(), out, fmt.dims,
                                      cache.shape[1], cache.stride(0), cache.stride(1), out.stride(0),
                                      **decode_constexprs(fmt), TILE=tile,
                                      **tile_args(fmt, decode_constexprs(fmt)["BLOCK_D"], cache),
                                      num_warps=cfg["num_warps"])
    return out
