"""The reference's ``lm_head`` op: the chunked LM-head product, fp32 logits in a caller's buffer."""

from __future__ import annotations

import pytest
import torch

from inferhal.backends.reference import ops as ref
from inferhal.backends.reference.ops import OPS, ops_for


def lm_head(table, x, w, out=None):
    return table["lm_head"](x, w, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_chunked_logits_equal_one_product_widened_to_fp32(monkeypatch, dtype, rows):
    monkeypatch.setattr(ref, "LM_HEAD_CHUNK", 7)  # ragged last chunk: 50 = 7 * 7 + 1
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 16, generator=g).to(dtype)
    x = torch.randn(rows, 16, generator=g).to(dtype)
    out = lm_head(OPS, x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, 50)
    # bf16: each product is rounded to bf16 either way, so the chunks are exact; fp32: the BLAS blocks a
    # narrower product differently, which moves the last bit or two (measured 1e-7 relative)
    exact = dtype == torch.bfloat16
    torch.testing.assert_close(out, OPS["linear"](x, w).float(), rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)


def test_logits_land_in_the_callers_buffer_and_a_wrong_buffer_is_named():
    w, x = torch.randn(30, 8), torch.randn(3, 8)
    buf = torch.full((3, 30), float("nan"))
    out = lm_head(OPS, x, w, buf)
    assert out.data_ptr() == buf.data_ptr() and not out.isnan().any()
    with pytest.raises(ValueError, match=r"needs float32 \(3, 30\)"):
        lm_head(OPS, x, w, torch.empty(3, 29))
    with pytest.raises(ValueError, match="bfloat16"):
        lm_head(OPS, x, w, torch.empty(3, 30, dtype=torch.bfloat16))


def test_a_quantised_head_runs_as_one_product_into_the_buffer():
    from inferhal.core.ops.quantize import dequantize, quantize_fp8_block

    g = torch.Generator().manual_seed(5)
    q = quantize_fp8_block(torch.randn(256, 128, generator=g))
    x = torch.randn(3, 128, generator=g).bfloat16()
    buf = torch.empty(3, 256)
    out = lm_head(OPS, x, q, buf)
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(out, OPS["linear"](x, dequantize(q, torch.bfloat16)).float(), rtol=0, atol=0)


def test_batch_invariant_mode_runs_the_head_over_fixed_row_tiles():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=g).bfloat16()
    x = torch.randn(9, 64, generator=g).bfloat16()
    bi = ops_for(batch_invariant=True)
    whole = lm_head(bi, x, w)
    assert all(torch.equal(lm_head(bi, x[:n], w), whole[:n]) for n in (1, 4, 8))
