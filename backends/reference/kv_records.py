"""The reference codec of quantised KV records (formats as data: :mod:`inferhal.core.paging.formats`).

``encode(values [N, dims], fmt) -> uint8 [N, nbytes]`` and ``decode(records [..., nbytes], fmt) -> fp32
[..., dims]``. Scales and roundings are the ones the formats module states; decode is exact arithmetic
(code x scale in fp32), so any backend that writes the same bytes reads the same values.
"""

from __future__ import annotations

import torch

from inferhal.core.ops.quantize import E2M1_VALUES, unpack_e2m1
from inferhal.core.paging.formats import CODE_MAX, KVFormat

# e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: the midpoints between neighbours; a tie goes to the even code,
# so the midpoint above an even code rounds down (strict >) and the one above an odd code rounds up (>=)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


_PAIRS: dict = {}


def _e2m1_pairs(device) -> torch.Tensor:
    """byte → its two e2m1 values (low nibble first), fp32 ``[256, 2]``."""
    if device not in _PAIRS:
        _PAIRS[device] = unpack_e2m1(torch.arange(256, dtype=torch.uint8, device=device)).view(256, 2)
    return _PAIRS[device]


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) → e2m1 codes 0..15 (sign in bit 3), int64; magnitudes
    above 6 clip to 6, ties to the even code."""
    a = y.abs()
    mag = torch.zeros_like(a, dtype=torch.int64)
    for i, mid in enumerate(E2M1_MIDPOINTS):
        mag += (a >= mid) if i % 2 else (a > mid)
    return mag | ((y < 0).long() << 3)


def ue8m0_exponents(amax: torch.Tensor, code_max: float) -> torch.Tensor:
    """The ue8m0 scale of each block, as its exponent e (scale = 2**e): ceil(log2(amax / code_max)) in
    [-126, 127], exactly (from the float's own exponent and mantissa, not a rounded log2); an all-zero
    block gets -126."""
    mant, exp = torch.frexp(amax.float() / code_max)  # x = mant * 2**exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp).float()  # a power of two is its own ceiling
    return torch.where(mant == 0, torch.full_like(e, -126.0), e).clamp(-126, 127)


def _blocks(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """The coded channels ``[N, coded]`` as ``[N, num_scales, block]``, zero padded."""
    pad = fmt.num_scales * fmt.block - fmt.coded
    return torch.nn.functional.pad(x, (0, pad)).view(x.shape[0], fmt.num_scales, fmt.block)


def encode(values: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``values [N, dims]`` (any float dtype) → records ``uint8 [N, nbytes]``."""
    n = values.shape[0]
    if values.dim() != 2 or values.shape[1] != fmt.dims:
        raise ValueError(f"kv records ({fmt.name}): values must be [N, {fmt.dims}], got {tuple(values.shape)}")
    x = values.float()
    blocks = _blocks(x[:, :fmt.coded], fmt)  # [N, S, B]
    amax = blocks.abs().amax(dim=-1)  # [N, S]
    cmax = CODE_MAX[fmt.code]
    if fmt.scale == "ue8m0":
        e = ue8m0_exponents(amax, cmax)
        scale = torch.exp2(e)
        scale_bytes = (e + 127).to(torch.uint8)
    elif fmt.scale == "fp32":
        scale = (amax / cmax).clamp(min=torch.finfo(torch.float32).tiny)
        scale_bytes = scale.contiguous().view(torch.uint8)  # [N, S * 4]
    else:  # e4m3
        s8 = (amax / cmax).clamp(max=448.0).to(torch.float8_e4m3fn)
        scale = s8.float()
        scale_bytes = s8.view(torch.uint8)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (blocks / safe[..., None]).reshape(n, -1)[:, :fmt.coded]
    if fmt.code == "e4m3":
        codes = y.clamp(-cmax, cmax).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        c = e2m1_codes(y)
        c = torch.nn.functional.pad(c, (0, fmt.code_bytes * 2 - fmt.coded)).view(n, -1, 2)
        codes = (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)
    out = torch.zeros(n, fmt.nbytes, dtype=torch.uint8, device=values.device)
    out[:, :fmt.code_bytes] = codes
    if fmt.raw_dims:
        raw = values[:, fmt.coded:].to(torch.bfloat16).contiguous().view(torch.uint8)
        out[:, fmt.raw_at:fmt.scales_at] = raw
    scale_bytes = scale_bytes.reshape(n, -1)
    out[:, fmt.scales_at:fmt.scales_at + scale_bytes.shape[1]] = scale_bytes
    return out


def decode(records: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``records uint8 [..., nbytes]`` → fp32 ``[..., dims]`` (an all-zero record decodes to zeros)."""
    lead = records.shape[:-1]
    if records.dtype != torch.uint8 or records.shape[-1] != fmt.nbytes:
        raise ValueError(f"kv records ({fmt.name}): expected uint8 [..., {fmt.nbytes}], got {records.dtype} "
                         f"{tuple(records.shape)}")
    r = records.reshape(-1, fmt.nbytes)
    n = r.shape[0]
    codes = r[:, :fmt.code_bytes]
    if fmt.code == "e4m3":
        vals = codes.contiguous().view(torch.float8_e4m3fn).float()
    else:  # both nibbles of a byte at once: a 256 x 2 table (low nibble = even channel)
        vals = _e2m1_pairs(r.device)[codes.long()].view(n, -1)[:, :fmt.coded]
    sb = r[:, fmt.scales_at:fmt.scales_at + fmt.num_scales * (4 if fmt.scale == "fp32" else 1)].contiguous()
    if fmt.scale == "ue8m0":
        scale = torch.where(sb == 0, torch.zeros((), device=r.device), torch.exp2(sb.float() - 127))
    elif fmt.scale == "fp32":
        scale = sb.view(torch.float32)
    else:
        scale = sb.view(torch.float8_e4m3fn).float()
    if fmt.coded == fmt.num_scales * fmt.block:  # whole blocks: one broadcast multiply
        vals = (vals.view(n, fmt.num_scales, fmt.block) * scale[:, :, None]).view(n, fmt.coded)
    else:
        vals = vals * scale.repeat_interleave(fmt.block, dim=1)[:, :fmt.coded]
    if fmt.raw_dims:
        raw = r[:, fmt.raw_at:fmt.scales_at].contiguous().view(torch.bfloat16).float()
        vals = torch.cat((vals, raw), dim=1)
    return vals.view(*lead, fmt.dims)


__all__ = ["E2M1_VALUES", "decode", "e2m1_codes", "encode", "ue8m0_exponents"]
