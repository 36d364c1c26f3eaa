"""The bf16 linears over the AMX tile layout against float64 products, on this CPU: each test runs for
both kernels, ``amx`` (kernels/cpu/amx_linear.c) and ``avx512`` (kernels/cpu/avx512_linear.c).

These run a kernel for real (execution level: device) where the CPU has its instructions (AMX; or
AVX512-BF16) and a C compiler builds it; elsewhere they skip with the reason :func:`lib.status` or
:func:`lib.avx512_status` gives (tests/kernels/cpu/test_lib.py covers the build and the status everywhere).

Tolerances: the kernels sum K bf16 products in fp32 (AMX tiles, or vdpbf16ps k pairs, in a fixed order);
against a float64 product of the same bf16 inputs the fp32 output differs by fp32 re-association only
(rtol 1e-5 over K <= 1024 terms). The bf16 output is that fp32 result rounded to nearest even, so it
must equal the fp32 output cast by torch bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from inferhal.kernels.cpu import amx, lib

STATUS = {"amx": lib.status(), "avx512": lib.avx512_status()}


@pytest.fixture(params=amx.KERNELS)
def kernel(request):
    """Each kernel that runs here (the other skips with its reason)."""
    st = STATUS[request.param]
    if not st.available:
        pytest.skip(f"the {request.param} kernel is unavailable here: {st.reason}")
    return request.param


def _rand(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 40, 64), (15, 17, 96), (16, 32, 640), (17, 100, 640),
                                   (33, 640, 1024), (64, 48, 32), (130, 2050, 256)])
def test_linear_matches_float64_product_and_rounds_to_nearest_even(m, n, k, kernel):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = _rand(g, m, k), _rand(g, n, k, scale=k ** -0.5)
    wp = amx.pack(w)
    want = x.double() @ w.double().T
    got32 = amx.linear(x, wp, n, torch.float32, kernel=kernel)
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-5)
    got16 = amx.linear(x, wp, n, kernel=kernel)
    assert got16.dtype == torch.bfloat16 and got16.shape == (m, n)
    assert torch.equal(got16, got32.bfloat16())


def test_rows_are_batch_invariant_and_deterministic(kernel):
    g = torch.Generator().manual_seed(1)
    x, w = _rand(g, 70, 640), _rand(g, 300, 640, scale=0.04)
    wp = amx.pack(w)
    full = amx.linear(x, wp, 300, kernel=kernel)
    assert torch.equal(full, amx.linear(x, wp, 300, kernel=kernel))
    for lo, hi in [(0, 1), (3, 19), (40, 70), (5, 37)] + [(0, m) for m in range(2, 40)]:  # every row grouping
        assert torch.equal(amx.linear(x[lo:hi], wp, 300, kernel=kernel), full[lo:hi]), (lo, hi)


def test_strided_inputs_leading_dims_and_empty_batches(kernel):
    g = torch.Generator().manual_seed(2)
    table = _rand(g, 90, 128, scale=0.1)
    w = table[10:75, :64]  # rows with a stride of 128, as a slice of a wider table
    x = _rand(g, 3, 5, 128)[..., 64:]  # non-contiguous activations with leading dims
    got = amx.linear(x, amx.pack(w), 65, torch.float32, kernel=kernel)
    assert got.shape == (3, 5, 65)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    assert amx.linear(x[:0], amx.pack(w), 65, kernel=kernel).shape == (0, 5, 65)


@pytest.mark.parametrize("m,n", [(1, 70), (5, 33), (32, 1000), (40, 96)])
def test_fp32_output_into_a_buffer_holds_the_bf16_rounded_sums(m, n, kernel):
    g = torch.Generator().manual_seed(m + n)
    x, w = _rand(g, m, 640), _rand(g, n, 640, scale=0.04)
    wp = amx.pack(w)
    wide = torch.full((m, n + 9), float("nan"))  # a buffer with a row stride wider than n
    out = wide[:, 3 : 3 + n]
    got = amx.linear(x, wp, n, torch.float32, out=out, bf16_values=True, kernel=kernel)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.float32
    assert torch.equal(out, amx.linear(x, wp, n, kernel=kernel).float())  # one pass = the bf16 product widened
    assert wide[:, :3].isnan().all() and wide[:, 3 + n :].isnan().all()  # nothing outside the view is touched
    plain = torch.empty(m, n)
    amx.linear(x, wp, n, torch.float32, out=plain, kernel=kernel)
    assert torch.equal(plain, amx.linear(x, wp, n, torch.float32, kernel=kernel))


def test_bad_output_buffers_are_clear_errors(kernel):
    x, wp = torch.zeros(2, 64, dtype=torch.bfloat16), amx.pack(torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"needs torch.float32 \(2, 8\)"):
        amx.linear(x, wp, 8, torch.float32, out=torch.empty(2, 7), kernel=kernel)
    with pytest.raises(ValueError, match="needs torch.float32"):
        amx.linear(x, wp, 8, torch.float32, out=torch.empty(2, 8, dtype=torch.bfloat16), kernel=kernel)
    with pytest.raises(ValueError, match="unit column stride"):
        amx.linear(x, wp, 8, torch.float32, out=torch.empty(8, 2).t(), kernel=kernel)
    with pytest.raises(ValueError, match="bf16_values"):
        amx.linear(x, wp, 8, bf16_values=True, kernel=kernel)


def test_bad_shapes_are_clear_errors(kernel):
    w = torch.zeros(8, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K % 32 == 0"):
        amx.pack(w)
    with pytest.raises(ValueError, match="bf16 CPU weight"):
        amx.pack(torch.zeros(8, 64))
    wp = amx.pack(torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not a packed"):
        amx.linear(torch.zeros(2, 64, dtype=torch.bfloat16), wp, 40, kernel=kernel)
    with pytest.raises(ValueError, match="out_dtype"):
        amx.linear(torch.zeros(2, 64, dtype=torch.bfloat16), wp, 8, torch.float16, kernel=kernel)


@pytest.mark.skipif(not STATUS["avx512"].available, reason=f"no CPU kernels here: {STATUS['avx512'].reason}")
def test_unknown_or_unavailable_kernel_is_a_clear_error(monkeypatch):
    x, wp = torch.zeros(2, 64, dtype=torch.bfloat16), amx.pack(torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"kernel must be one of \('amx', 'avx512'\), got 'avx2'"):
        amx.linear(x, wp, 8, kernel="avx2")
    monkeypatch.setattr(lib, "_amx", lambda: lib.Status(False, "this CPU lacks amx_tile, amx_bf16"))
    with pytest.raises(RuntimeError, match="AMX product is unavailable: this CPU lacks amx_tile"):
        amx.linear(x, wp, 8, kernel="amx")
    assert torch.equal(amx.linear(x, wp, 8, kernel="avx512"), torch.zeros(2, 8, dtype=torch.bfloat16))


def test_supports_only_bf16_dense_weights_with_whole_k_tiles():
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    assert amx.supports(x, w)
    assert not amx.supports(x.float(), w.float())
    assert not amx.supports(x[:, :48], w[:, :48])
    assert not amx.supports(x, w.t().contiguous().t())  # column-major weight
