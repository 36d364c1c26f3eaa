"""Quantised weights as the 950's MXFP8 matmuls take them: experts for the grouped matmul (moe.experts,
``npu_grouped_matmul``), linear weights for ``npu_quant_matmul``'s MX mode (linear).

MX scales are e8m0 (powers of two) per 32 values along the reduction axis K. A
:class:`~inferhal.core.ops.quant.QuantWeight` ``[E, N, K]`` converts **exactly** when its scales are powers of two
and its blocks cover whole 32-groups of one row:

- ``fp4_group`` with 32-column groups (MXFP4, V4's expert format): every e2m1 value (0, 0.5, ..., 6) is an
  e4m3 value, so the codes widen to e4m3 and the scales stay; the weight then takes twice its FP4 bytes (the
  native W4A8 path needs the FRACTAL_NZ cast vllm-ascend applies, ``npu_format_cast``, which is not wired).
- ``fp8_block`` whose column block is a multiple of 32: each row of a block repeats its scale per 32 columns.

Anything else (fp32 scales that are not powers of two, e.g. ``amax / 6``; ``int_block``; K not a multiple of 64,
the scale pairs' layout) is not MX: :func:`mx_weight` says why, and the wrapper falls back for that call.
Layouts as vllm-ascend's ``w8a8_mxfp8.py process_weights_after_loading`` makes them: experts' data ``[E, K, N]`` (a
transposed view of ``[E, N, K]``), scale ``[E, K/64, N, 2]``; a linear's data ``[K, N]`` and scale ``[K/64, N, 2]``,
both transposed views.
"""

from __future__ import annotations

import torch

from inferhal.core.ops.quantize import unpack_e2m1
from inferhal.core.ops.quant import QuantWeight


def _exponents(scale: torch.Tensor) -> torch.Tensor | str:
    """Scale tensor → its e8m0 bytes (uint8), or why it has none."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    s = scale.float()
    mant, exp = torch.frexp(s)
    if not bool(((mant == 0.5) & (s > 0)).all()):
        return "scales that are not powers of two (MX scales are e8m0)"
    e = exp - 1
    if int(e.min()) < -127 or int(e.max()) > 127:
        return "scales outside e8m0's range"
    return (e + 127).to(torch.uint8)


def _codes_and_exponents(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``(e4m3 codes [..., N, K], e8m0 bytes uint8 [..., N, K/32])`` of ``w``, or why it is not MX."""
    n, k = w.shape[-2:]
    if k % 64:
        return f"K = {k}: MX scales come in pairs of 32-groups (K a multiple of 64)"
    if w.format == "fp4_group":
        if w.block[1] != 32:
            return f"fp4_group with {w.block[1]}-column groups: MX groups are 32"
        ex = _exponents(w.scale)
        if isinstance(ex, str):
            return f"fp4_group {ex}"
        return unpack_e2m1(w.data)[..., :k].to(torch.float8_e4m3fn), ex  # exact: e2m1 values are e4m3 values
    if w.format == "fp8_block":
        br, bc = w.block
        if bc % 32:
            return f"fp8_block {br}x{bc}: the column block must cover whole 32-groups"
        ex = _exponents(w.scale)
        if isinstance(ex, str):
            return f"fp8_block {ex}"
        return w.data, ex.repeat_interleave(br, dim=-2)[..., :n, :].repeat_interleave(bc // 32, dim=-1)[..., :k // 32]
    return f"{w.format} weights: not an MX format"


def mx_weight(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``(data e4m3 [E, K, N], scale e8m0 [E, K/64, N, 2])`` of a 3-D expert weight, or why it is not MX."""
    if len(w.shape) != 3:
        return f"{w.format} weight of shape {w.shape}: experts are [E, N, K]"
    e, n, k = w.shape
    got = _codes_and_exponents(w)
    if isinstance(got, str):
        return got
    data, ex = got
    scale = ex.reshape(e, n, k // 64, 2).transpose(1, 2).contiguous().view(torch.float8_e8m0fnu)
    return data.transpose(1, 2), scale


def mx_linear_weight(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``(data e4m3 [K, N], scale uint8 [K/64, N, 2])`` of a 2-D linear weight for ``npu_quant_matmul``'s MX mode,
    or why it is not MX. Both are transposed views of contiguous ``[N, K]`` / ``[N, K/64, 2]`` tensors, as
    vllm-ascend's ``w8a8_mxfp8.py process_weights_after_loading`` leaves them (the 950's MX matmul takes the
    weight's scale transposed only)."""
    if len(w.shape) != 2:
        return f"{w.format} weight of shape {w.shape}: a linear weight is [N, K]"
    n, k = w.shape
    got = _codes_and_exponents(w)
    if isinstance(got, str):
        return got
    data, ex = got
    return data.contiguous().transpose(0, 1), ex.reshape(n, k // 64, 2).contiguous().transpose(0, 1)
