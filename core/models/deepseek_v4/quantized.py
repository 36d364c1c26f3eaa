"""Checkpoint tensors → :class:`~inferhal.core.ops.quant.QuantWeight` (or plain tensors).

- FP8 block-scaled: ``weight`` float8_e4m3fn ``[..., N, K]`` with ``weight_scale_inv`` (DeepSeek ``scale``)
  ``[..., ceil(N/bn), ceil(K/bk)]`` in fp32, float8_e8m0fnu or raw ue8m0 bytes (uint8); w = q * s per block.
- FP4 (e2m1, two codes per byte, low nibble first) in int8/uint8 ``[..., N, K/2]`` with one scale per
  32-element group along K, ``[..., N, K/32]``.
Weights that run dense are dequantised by the format's own definition, :func:`inferhal.core.ops.quantize.dequantize`.
"""

from __future__ import annotations

import torch

from inferhal.core.errors import UserError
from inferhal.core.ops.quant import QuantWeight


def _scale(s: torch.Tensor) -> torch.Tensor:
    if s.dtype == torch.uint8:  # ue8m0 exponent bytes
        return s.view(torch.float8_e8m0fnu)
    if s.dtype in (torch.float32, torch.float8_e8m0fnu):
        return s
    return s.float()


def make_quant(name: str, data: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...],
               block: tuple[int, int] = (128, 128)) -> QuantWeight:
    """Build and shape-check a QuantWeight for tensor ``name`` with logical ``shape`` ``[..., N, K]``."""
    *lead, n, k = shape
    scale = _scale(scale)
    if data.dtype == torch.float8_e4m3fn:
        bn, bk = block
        want_s = (*lead, -(-n // bn), -(-k // bk))
        if tuple(data.shape) != tuple(shape) or tuple(scale.shape) != want_s:
            raise UserError(f"checkpoint tensor {name!r}: fp8 weight {tuple(data.shape)} with scale {tuple(scale.shape)} "
                            f"does not fit shape {tuple(shape)} with {bn}x{bk} blocks (scale {want_s})")
        return QuantWeight(data, scale, "fp8_block", tuple(shape), (bn, bk))
    if data.dtype in (torch.int8, torch.uint8):
        if tuple(data.shape) != (*lead, n, k // 2) or k % 2 or scale.dim() != len(shape) or scale.shape[-1] == 0 \
                or k % scale.shape[-1] or tuple(scale.shape[:-1]) != (*lead, n):
            raise UserError(f"checkpoint tensor {name!r}: fp4 weight {tuple(data.shape)} with scale {tuple(scale.shape)} "
                            f"does not fit shape {tuple(shape)} (packed [..., N, K/2], scales [..., N, K/group])")
        return QuantWeight(data.view(torch.uint8), scale, "fp4_group", tuple(shape), (1, k // scale.shape[-1]))
    raise UserError(f"checkpoint tensor {name!r}: a scale is given but the weight dtype {data.dtype} is neither "
                    f"float8_e4m3fn nor packed fp4 (int8/uint8)")
