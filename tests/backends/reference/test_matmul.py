"""The reference's default matrix product (``product``), its CPU path (oneDNN packed where the host's probe
passes, else ``F.linear``; ``INFERHAL_PORTABLE_CPU=1`` forces ``F.linear``) and its batch-invariant tiled form.

The product tests run on both paths whatever the host: ``path`` sets the switch and asks again. What an
AVX2-only host does is shown two ways: a fake refusal with the message such a host gives, and a child process
with ``ONEDNN_MAX_CPU_ISA=AVX2``, under which oneDNN refuses bf16 as it does there."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from inferhal.backends.reference import matmul as M
from inferhal.backends.reference.matmul import TILE_ROWS, product, tiled_linear

AVX2_REFUSAL = ("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, "
                "avx512vl and avx512dq")


def _use(monkeypatch, portable: bool) -> M.ProductPath:
    """This process's product path with the switch on or off, asked again (the cache is cleared on teardown)."""
    monkeypatch.setenv(M.PORTABLE_ENV, "1" if portable else "0")
    M.product_path.cache_clear()
    return M.product_path()


@pytest.fixture(autouse=True)
def _fresh_path():
    M.product_path.cache_clear()
    yield
    M.product_path.cache_clear()  # before monkeypatch restores the environment: the next call reads it again


@pytest.fixture(params=["probed", "portable"])
def path(request, monkeypatch):
    return _use(monkeypatch, request.param == "portable")


def _weights(g):
    w = torch.randn(96, 64, generator=g) * 0.1
    return {"contiguous": w, "transposed view": w.t().contiguous().t(), "strided rows": w[::2]}


@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (3, 5, 64), (0, 64), (64,)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_product_is_an_fp32_product_whatever_the_layout(shape, bias, path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g)
    for name, w in _weights(g).items():
        b = torch.randn(w.shape[0], generator=g) if bias else None
        out = product(x, w, b)
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert out.dtype == torch.float32 and out.shape == exact.shape, name
        # 64-term sums of values ~0.1..3: a few fp32 ulps of the float64 result, like F.linear itself
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=2e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_and_other_dtypes_are_f_linear_or_within_its_rounding(dtype, path):
    """Off oneDNN's packed path (the portable path, fp16, a dtype whose probe failed) the product is F.linear
    itself: bit for bit. On it (bf16 where the probe passes) oneDNN's inner product sums in an order of its own
    choosing per CPU (it was F.linear's bits on the AMD and Intel hosts measured, see matmul.py, which no CPU
    promises): both within the rounding of the output and an fp32 accumulation of a float64 product."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 64, generator=g).to(dtype), torch.randn(32, 64, generator=g).to(dtype)
    b = torch.randn(32, generator=g).to(dtype)
    if dtype not in path.packed:
        assert torch.equal(product(x, w), F.linear(x, w)) and torch.equal(product(x, w, b), F.linear(x, w, b))
        return
    for bias in (None, b):
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        # the output's rounding (2^-9 relative) plus an fp32 accumulation over K = 64 terms (64 * 2^-24)
        bound = (2.0 ** -9 + 64 * 2.0 ** -24) * (F.linear(x.double().abs(), w.double().abs())
                                                + (0 if bias is None else bias.double().abs()))
        for got in (product(x, w, bias), F.linear(x, w, bias)):
            assert got.dtype == dtype and bool(((got.double() - exact).abs() <= bound + 1e-30).all())


def test_the_probe_decides_per_dtype_and_says_why(monkeypatch):
    p = _use(monkeypatch, portable=False)
    for dt in M.PROBED:
        why = M.probe_onednn(dt)
        name = str(dt).removeprefix("torch.")
        assert (dt in p.packed) == (why is None), why
        assert (f"probe failed for {name}: {why}" in p.reason) if why else (name in p.reason.split(";")[0])
    assert M.describe().startswith("products: ") and p.reason in M.describe()


def test_the_switch_forces_f_linear_and_never_calls_onednn(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the portable path called torch.ops.mkldnn")

    monkeypatch.setattr(M, "_LINEAR", refuse)
    monkeypatch.setattr(M, "_REORDER", refuse)
    p = _use(monkeypatch, portable=True)
    assert p.packed == frozenset() and M.describe() == "products: portable F.linear (INFERHAL_PORTABLE_CPU=1)"
    g = torch.Generator().manual_seed(6)
    for dt in (torch.float32, torch.bfloat16):
        x, w, b = torch.randn(5, 64, generator=g).to(dt), torch.randn(24, 64, generator=g).to(dt), None
        assert torch.equal(product(x, w, b), F.linear(x, w, b)) and M.packed(w) is w


def test_a_switch_it_cannot_read_is_refused_with_its_name(monkeypatch):
    from inferhal.core.errors import UserError

    monkeypatch.setenv(M.PORTABLE_ENV, "maybe")
    with pytest.raises(UserError, match="INFERHAL_PORTABLE_CPU='maybe': expected 1"):
        M.product_path()


def test_a_cpu_that_refuses_bf16_runs_bf16_through_f_linear_and_keeps_fp32_on_onednn(monkeypatch):
    """The refusal an AVX2-only host gives (faked here): bf16 products run F.linear, fp32 keeps its own probe."""
    real = M._REORDER

    def reorder(w, rows):
        if w.dtype == torch.bfloat16:
            raise RuntimeError(AVX2_REFUSAL)
        return real(w, rows)

    fp32_ok = M.probe_onednn(torch.float32) is None
    monkeypatch.setattr(M, "_REORDER", reorder)
    M.clear_packed()
    p = _use(monkeypatch, portable=False)
    assert torch.bfloat16 not in p.packed and (torch.float32 in p.packed) == fp32_ok
    assert f"probe failed for bfloat16: RuntimeError: {AVX2_REFUSAL}" in M.describe()
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(7, 640, generator=g).bfloat16(), torch.randn(96, 640, generator=g).bfloat16()
    assert torch.equal(product(x, w), F.linear(x, w)) and not M.ONEDNN_PACKS.entries


def test_a_onednn_product_that_gives_wrong_bits_fails_the_probe(monkeypatch):
    monkeypatch.setattr(M, "_LINEAR", lambda x, w, b, *a: torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype))
    if M._REORDER is None:
        monkeypatch.setattr(M, "_REORDER", lambda w, rows: w)
    p = _use(monkeypatch, portable=False)
    assert p.packed == frozenset() and M.describe().startswith("products: portable F.linear (probe failed for")
    assert "product differs from F.linear" in p.reason


def test_the_choice_is_in_inferhal_backends_and_the_reference_profile(monkeypatch):
    from inferhal.backends.reference.device import profile
    from inferhal.core.cli.cmd_backends import report
    from inferhal.core.registry import BackendRegistry

    for portable in (False, True):
        _use(monkeypatch, portable)
        reason = report(BackendRegistry.discover())["probes"]["reference"].reason
        assert reason.endswith(M.describe()) and profile("cpu").sources["products"] == M.describe()
    assert "portable F.linear (INFERHAL_PORTABLE_CPU=1)" in reason
    assert "row tiles" in profile("cpu", batch_invariant=True).sources["products"]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA=AVX2 is an x86 setting")
def test_under_onednn_capped_at_avx2_bf16_runs_the_portable_path_with_the_same_results():
    """A child process with oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA``, read when oneDNN starts) refuses bf16
    exactly as an AVX2-only CPU does; the reference then runs its bf16 products through F.linear (ATen's own
    GEMM), within the bound matmul.py states of a float64 product, and its fp32 products as before."""
    code = """if True:
        import torch, torch.nn.functional as F
        from inferhal.backends.reference import matmul as M
        print(M.describe())
        g = torch.Generator().manual_seed(8)
        x, w = torch.randn(7, 640, generator=g).bfloat16(), (torch.randn(256, 640, generator=g) * 0.05).bfloat16()
        got, exact = M.product(x, w).double(), F.linear(x.double(), w.double())
        bound = 0.5 * 2.0 ** -8 * F.linear(x.double().abs(), w.double().abs())
        print("within", bool(((got - exact).abs() <= bound).all()), "equal", torch.equal(M.product(x, w), F.linear(x, w)))
    """
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", M.PORTABLE_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"probe failed for bfloat16: RuntimeError: {AVX2_REFUSAL}" in out.stdout, out.stdout
    assert "within True equal True" in out.stdout, out.stdout


def _needs_onednn(dtype):
    why = M.probe_onednn(dtype)
    return pytest.param(dtype, id=str(dtype).removeprefix("torch."),
                        marks=pytest.mark.skipif(why is not None, reason=f"no oneDNN {dtype} product here: {why}"))


def test_tiled_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2 * TILE_ROWS + 3, 64, generator=g), torch.randn(40, 64, generator=g)
    full = tiled_linear(x, w)
    assert torch.equal(full[:5], tiled_linear(x[:5], w)) and torch.equal(full[-1:], tiled_linear(x[-1:], w))


@pytest.mark.parametrize("dtype", [_needs_onednn(torch.float32), _needs_onednn(torch.bfloat16)])
def test_packed_weights_are_reused_follow_in_place_writes_and_leave_with_their_weight(dtype, monkeypatch):
    _use(monkeypatch, portable=False)
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


@pytest.mark.parametrize("dtype", [_needs_onednn(torch.float32)])
def test_products_run_unpacked_past_the_packing_budget(dtype, monkeypatch):
    _use(monkeypatch, portable=False)
    M.clear_packed()
    monkeypatch.setattr(M.ONEDNN_PACKS, "max_bytes", 100)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 64, generator=g), torch.randn(32, 64, generator=g)
    assert M.packed(w) is w and not M.ONEDNN_PACKS.entries
    torch.testing.assert_close(product(x, w), F.linear(x, w), rtol=1e-6, atol=1e-5)


def test_pack_cache_counts_a_quantised_sources_scales_in_its_budget():
    from inferhal.core.ops.quantize import quantize_int_block

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
