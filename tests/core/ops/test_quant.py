"""int_block weights (core/ops/quant.py) and their dequantisation (core/ops/quantize.py)."""

from __future__ import annotations

import pytest
import torch

from inferhal.core.ops.quantize import dequantize
from inferhal.core.ops.quant import QuantWeight, cat_rows, int_block


def _w(n, k, bk, offset, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(-16, 16, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // bk, generator=g) * 0.1
    return int_block(data, scale, torch.rand(n, k // bk, generator=g) if offset else None)


def test_dequantise_rounds_twice_per_block_as_gguf_does():
    w = _w(3, 64, 16, True)
    got = dequantize(w)
    for r in range(3):
        for c in range(64):  # one element at a time, in float32: fl(fl(v a) - o)
            a, o = w.scale[r, c // 16], w.offset[r, c // 16]
            prod = torch.tensor(float(w.data[r, c]), dtype=torch.float32) * a
            assert got[r, c].item() == (prod - o).item()
    plain = _w(2, 32, 32, False)
    assert torch.equal(dequantize(plain), plain.data.float() * plain.scale)
    assert dequantize(plain, torch.bfloat16).dtype == torch.bfloat16


def test_rows_cat_and_bytes():
    a, b = _w(4, 64, 32, False, 1), _w(6, 64, 32, True, 2)
    ab = cat_rows((a, b))
    assert ab.shape == (10, 64) and ab.block == (1, 32) and ab.offset is not None
    assert torch.equal(dequantize(ab), torch.cat((dequantize(a), dequantize(b))))  # a zero offset is no offset
    assert torch.equal(dequantize(ab.rows(4, 10)), dequantize(b))
    assert ab.nbytes() == 10 * 64 + 2 * 10 * 2 * 4
    t = torch.ones(2, 3)
    assert torch.equal(cat_rows((t, t)), torch.ones(4, 3))


def test_clear_errors():
    with pytest.raises(ValueError, match="data must be int8"):
        int_block(torch.zeros(2, 32), torch.ones(2, 1))
    with pytest.raises(ValueError, match="scale must be fp32"):
        int_block(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 4))  # blocks of 8
    with pytest.raises(ValueError, match="offset .* and scale .* differ"):
        int_block(torch.zeros(2, 64, dtype=torch.int8), torch.ones(2, 2), torch.ones(2, 4))
    with pytest.raises(ValueError, match="of one block size"):
        cat_rows((_w(2, 64, 32, False), _w(2, 64, 16, False)))
    with pytest.raises(ValueError, match="only int_block weights take one"):
        QuantWeight(torch.zeros(2, 2), torch.ones(1, 1), "fp8_block", (2, 2), (128, 128), torch.ones(1, 1))
    with pytest.raises(ValueError, match="2-D int_block"):
        QuantWeight(torch.zeros(2, 2), torch.ones(1, 1), "fp8_block", (2, 2)).rows(0, 1)
