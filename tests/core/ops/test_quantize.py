"""The formats' encoders and decoder (core/ops/quantize.py); int_block's in test_quant.py."""

import torch

from inferhal.core.ops.quantize import dequantize, quantize_fp4_group, quantize_fp8_block


def test_fp8_block_and_fp4_group_round_trip_within_format_precision():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 200, 160, generator=g)
    q8 = quantize_fp8_block(w)
    assert q8.data.dtype == torch.float8_e4m3fn and q8.scale.shape == (3, 2, 2)
    # e4m3 has 3 mantissa bits: relative step 2^-3, so |err| <= 2^-4 * |w| (plus subnormals near zero)
    err8 = (dequantize(q8) - w).abs()
    assert bool((err8 <= w.abs() * 2 ** -4 + q8.scale.max() * 2 ** -9).all())
    q4 = quantize_fp4_group(w)
    assert q4.data.dtype == torch.uint8 and q4.data.shape == (3, 200, 80) and q4.scale.shape == (3, 200, 5)
    # e2m1 grid (0, .5, 1, 1.5, 2, 3, 4, 6) x scale: the largest gap is 2 (between 4 and 6) -> |err| <= 1 * scale
    scale = q4.scale.repeat_interleave(32, -1)
    assert bool(((dequantize(q4) - w).abs() <= scale * 1.0 + 1e-6).all())
