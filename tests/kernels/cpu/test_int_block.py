"""The in-register int_block product (kernels/cpu/int_block.py, ``ih_q8_linear`` in avx512_linear.c) against
the AVX512-BF16 product over the dequantised bf16 weight: they must agree bit for bit (the kernel forms each
weight's fp32 value with the same two roundings, rounds it to bf16 to nearest even and sums in the bf16
kernel's order). Runs where the AVX-512 kernels build (execution level: device); skips with the reason
elsewhere."""

from __future__ import annotations

import pytest
import torch

from inferhal.core.ops.quantize import dequantize
from inferhal.core.ops.quant import int_block as make_int_block
from inferhal.kernels.cpu import amx, int_block, lib

ST = lib.avx512_status()
pytestmark = pytest.mark.skipif(not ST.available, reason=f"the AVX-512 kernels are unavailable here: {ST.reason}")


def _weight(g, n, k, bk, offset, lo=-32, hi=32):
    data = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    sign = torch.where(torch.rand(n, k // bk, generator=g) < 0.5, -1.0, 1.0)
    scale = (torch.rand(n, k // bk, generator=g) * 0.05 + 1e-4) * sign
    off = torch.rand(n, k // bk, generator=g) * 0.02 if offset else None
    return make_int_block(data, scale, off)


@pytest.mark.parametrize("n,k,bk,offset", [(1, 32, 32, False), (40, 64, 32, True), (70, 96, 16, False),
                                           (33, 640, 32, False), (640, 1024, 32, True), (640, 2048, 16, False),
                                           (97, 256, 16, True)])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 17])  # 9 and 17 rows: passes of up to 8
def test_bit_identical_to_the_bf16_product_over_the_dequantised_weight(m, n, k, bk, offset):
    g = torch.Generator().manual_seed(m * 100000 + n * 10 + k + bk)
    w = _weight(g, n, k, bk, offset)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    want = amx.linear(x, amx.pack(dequantize(w, torch.bfloat16)), n, kernel="avx512")
    got = int_block.linear(x, int_block.pack(w))
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_strided_and_batched_rows_and_row_views_of_a_fused_weight():
    g = torch.Generator().manual_seed(7)
    w = _weight(g, 96, 128, 32, True)
    part = w.rows(32, 80)  # a view of 48 output rows, as a fused q|k|v splits
    wide = (torch.randn(2, 3, 256, generator=g)).bfloat16()
    x = wide[..., ::2]  # column stride 2: the kernel gets a contiguous copy
    want = amx.linear(x.contiguous(), amx.pack(dequantize(part, torch.bfloat16)), 48, kernel="avx512")
    got = int_block.linear(x, int_block.pack(part))
    assert got.shape == (2, 3, 48) and torch.equal(got, want)
    assert int_block.linear(x[:0].reshape(0, 128), int_block.pack(part)).shape == (0, 48)


def test_the_kernel_reads_about_half_the_bytes_of_the_bf16_copy():
    w = _weight(torch.Generator().manual_seed(1), 4096, 640, 32, False)
    p = int_block.pack(w)
    packed = sum(t.numel() * t.element_size() for t in (p.wq, p.scale))
    assert packed / (4096 * 640 * 2) == pytest.approx(0.5625)  # 1 byte a weight + one fp32 per 32


def test_clear_errors_for_what_it_does_not_take():
    g = torch.Generator().manual_seed(3)
    p = int_block.pack(_weight(g, 8, 64, 32, False))
    with pytest.raises(ValueError, match=r"needs bf16 CPU x \[\.\.\., 64\]"):
        int_block.linear(torch.zeros(1, 32, dtype=torch.bfloat16), p)
    with pytest.raises(ValueError, match="needs bf16"):
        int_block.linear(torch.zeros(1, 64), p)
    with pytest.raises(ValueError, match="K % 32 == 0"):
        int_block.pack(make_int_block(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 3)))
    assert not int_block.supports(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16))
