"""The reference's default matrix product (``product``) and its batch-invariant tiled form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferhal.backends.reference import matmul as M
from inferhal.backends.reference.matmul import TILE_ROWS, product, tiled_linear


def _weights(g):
    w = torch.randn(96, 64, generator=g) * 0.1
    return {"contiguous": w, "transposed view": w.t().contiguous().t(), "strided rows": w[::2]}


@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (3, 5, 64), (0, 64), (64,)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_product_is_an_fp32_product_whatever_the_layout(shape, bias):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g)
    for name, w in _weights(g).items():
        b = torch.randn(w.shape[0], generator=g) if bias else None
        out = product(x, w, b)
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert out.dtype == torch.float32 and out.shape == exact.shape, name
        # 64-term sums of values ~0.1..3: a few fp32 ulps of the float64 result, like F.linear itself
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=2e-6, msg=name)


def test_other_dtypes_are_exactly_f_linear():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 64, generator=g).bfloat16(), torch.randn(32, 64, generator=g).bfloat16()
    assert torch.equal(product(x, w), F.linear(x, w))


def test_tiled_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2 * TILE_ROWS + 3, 64, generator=g), torch.randn(40, 64, generator=g)
    full = tiled_linear(x, w)
    assert torch.equal(full[:5], tiled_linear(x[:5], w)) and torch.equal(full[-1:], tiled_linear(x[-1:], w))


needs_onednn = pytest.mark.skipif(M._ONEDNN is None or M._REORDER is None,
                                  reason="this torch build has no oneDNN linear (nothing is packed)")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_are_reused_follow_in_place_writes_and_leave_with_their_weight(dtype):
    g = torch.Generator().manual_seed(4)
    M.clear_packed()
    table = torch.randn(96, 64, generator=g).to(dtype)
    x = torch.randn(5, 64, generator=g).to(dtype)
    first = product(x, table[:48])
    assert len(M.ONEDNN_PACKS.entries) == 1 and M.ONEDNN_PACKS.nbytes == 48 * 64 * table.element_size()
    assert M.packed(table[:48]) is M.packed(table[:48])  # a fresh slice object finds the same packed copy
    tol = {"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-5}
    torch.testing.assert_close(first, F.linear(x, table[:48]), **tol)
    torch.testing.assert_close(product(x, table[48:]), F.linear(x, table[48:]), **tol)  # another slice, its own copy
    table[:48].mul_(-2)  # written in place: the stale packed copy must not be used
    torch.testing.assert_close(product(x, table[:48]), F.linear(x, table[:48]), **tol)
    assert not torch.equal(product(x, table[:48]), first)
    del table
    import gc

    gc.collect()
    assert not M.ONEDNN_PACKS.entries and M.ONEDNN_PACKS.nbytes == 0  # gone with the weight, before its memory is reused


@needs_onednn
def test_products_run_unpacked_past_the_packing_budget(monkeypatch):
    M.clear_packed()
    monkeypatch.setattr(M.ONEDNN_PACKS, "max_bytes", 100)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 64, generator=g), torch.randn(32, 64, generator=g)
    assert M.packed(w) is w and not M.ONEDNN_PACKS.entries
    torch.testing.assert_close(product(x, w), F.linear(x, w), rtol=1e-6, atol=1e-5)


def test_pack_cache_counts_a_quantised_sources_scales_in_its_budget():
    from inferhal.backends.reference.quant import quantize_int_block

    q = quantize_int_block(torch.randn(4, 64), 16, offset=True)  # int8 data 256 B, scale and offset 64 B each
    cache = M.PackCache(lambda w: w.data.clone(), max_bytes=383)
    assert cache.get(q.data, source=q) is None and not cache.entries  # 384 B: past the budget
    cache.max_bytes = 384
    assert cache.get(q.data, source=q) is not None and cache.nbytes == q.nbytes() == 384


def test_pack_cache_says_whether_it_would_keep_a_copy_without_packing():
    packed = []
    cache = M.PackCache(lambda w: packed.append(1) or w.clone(), max_bytes=64 * 4)
    small, big = torch.ones(8, 8), torch.ones(9, 8)
    assert cache.keeps(small) and not cache.keeps(big) and not packed  # asking packs nothing
    cache.get(small)
    assert cache.keeps(small) and packed == [1]  # kept: yes, with the budget now spent
    assert not cache.keeps(torch.ones(2, 2))
    with torch.inference_mode():
        assert not cache.keeps(torch.ones(2, 2))  # no version counter: never kept
