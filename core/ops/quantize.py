"""Each :class:`~inferhal.core.ops.quant.QuantWeight` format in plain torch, on any device: ``dequantize`` (the
format's definition, and the reference backend's way to run a quantised weight) and the ``quantize_*``
encoders (for tests, qualification cases and benchmarks; a checkpoint's own codes are loaded as they are)."""

from __future__ import annotations

import torch

from inferhal.core.ops.quant import QuantWeight, int_block, int_block_values

# e2m1 code → value (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    s = scale.float().repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    return s[..., :rows, :cols]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` → fp32 ``[..., K]`` (low nibble first)."""
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    codes = torch.stack((lo, hi), dim=-1).flatten(-2)
    return E2M1_VALUES.to(packed.device)[codes]


def dequantize(w: QuantWeight | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return w.to(dtype)
    *_, n, k = w.shape
    if w.format == "fp8_block":
        br, bc = w.block
        return (w.data.float() * _expand_blocks(w.scale, n, k, br, bc)).to(dtype)
    if w.format == "fp4_group":
        group = w.block[1]
        vals = unpack_e2m1(w.data)[..., :k]
        return (vals * w.scale.float().repeat_interleave(group, dim=-1)[..., :k]).to(dtype)
    if w.format == "int_block":  # two fp32 roundings, as the GGUF block formats dequantise
        return int_block_values(w).to(dtype)
    raise ValueError(f"unknown quantisation format {w.format!r}")


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> QuantWeight:
    """fp32/bf16 ``[..., N, K]`` → fp8_block with fp32 scales (amax / 448 per block)."""
    *lead, n, k = w.shape
    br, bc = block
    pn, pk = -n % br, -k % bc
    x = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    x = x.reshape(*lead, (n + pn) // br, br, (k + pk) // bc, bc)
    amax = x.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (x / scale[..., :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, n + pn, k + pk)[..., :n, :k].contiguous()
    return QuantWeight(q, scale, "fp8_block", tuple(w.shape), block)


def quantize_fp4_group(w: torch.Tensor, group: int = 32) -> QuantWeight:
    """fp32/bf16 ``[..., N, K]`` (K % group == 0) → fp4_group with fp32 scales (amax / 6 per group)."""
    *lead, n, k = w.shape
    if k % group:
        raise ValueError(f"fp4_group needs K divisible by {group}, got K={k}")
    x = w.float().reshape(*lead, n, k // group, group)
    scale = (x.abs().amax(dim=-1) / 6.0).clamp(min=1e-12)
    y = (x / scale[..., None]).reshape(*lead, n, k)
    mags = E2M1_VALUES[:8].to(w.device)
    codes = (y.abs()[..., None] - mags).abs().argmin(dim=-1)
    codes = codes | ((y < 0).long() << 3)
    codes = codes.reshape(*lead, n, k // 2, 2).to(torch.uint8)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return QuantWeight(packed.contiguous(), scale, "fp4_group", tuple(w.shape), (1, group))


def quantize_int_block(w: torch.Tensor, block: int = 32, offset: bool = False) -> QuantWeight:
    """fp32/bf16 ``[N, K]`` (K % block == 0) → int_block: symmetric int8 (scale amax / 127 per block), or with
    ``offset`` 4-bit codes 0..15 over each block's range (scale (max - min) / 15, offset -min, Q4_K's shape)."""
    n, k = w.shape
    if k % block or block not in (16, 32):
        raise ValueError(f"int_block needs blocks of 16 or 32 dividing K, got block={block}, K={k}")
    x = w.float().reshape(n, k // block, block)
    if offset:
        lo, hi = x.amin(dim=-1), x.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        v = ((x - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
        return int_block(v.to(torch.int8).reshape(n, k), scale, -lo)
    scale = (x.abs().amax(dim=-1) / 127.0).clamp(min=1e-12)
    v = (x / scale[..., None]).round().clamp(-127, 127)
    return int_block(v.to(torch.int8).reshape(n, k), scale)
