"""Building and loading the CPU kernels' library (kernels/cpu/lib.py): runs on any machine."""

from __future__ import annotations

import pytest

from inferhal.kernels.cpu import lib


def test_status_names_what_is_missing(monkeypatch):
    lib.clear()
    try:
        monkeypatch.setattr(lib, "cpu_flags", lambda: frozenset({"avx512f"}))
        st = lib.avx512_status()
        assert not st.available and "avx512bw, avx512vl, avx512_bf16" in st.reason and "Zen 4" in st.reason
        st = lib.status()  # no AMX: that is what the AMX product's status names first
        assert not st.available and "amx_tile" in st.reason and "amx_bf16" in st.reason
        monkeypatch.setattr(lib, "cpu_flags", lambda: frozenset(lib.CPU_FLAGS))
        monkeypatch.setattr(lib, "compiler", lambda: None)
        lib.clear()
        for st in (lib.avx512_status(), lib.status()):
            assert not st.available and "no C compiler" in st.reason
        with pytest.raises(RuntimeError, match="unavailable: no C compiler"):
            lib.library()
    finally:
        monkeypatch.undo()
        lib.clear()


@pytest.mark.skipif(not lib.avx512_status().available, reason=f"no CPU kernels here: {lib.avx512_status().reason}")
def test_a_cpu_without_amx_runs_the_avx512_kernels_only(monkeypatch):
    lib.clear()
    try:
        monkeypatch.setattr(lib, "cpu_flags", lambda: frozenset(lib.AVX512_FLAGS))
        assert lib.avx512_status().available and lib.library() is not None
        st = lib.status()
        assert not st.available and st.reason.startswith("this CPU lacks amx_tile, amx_bf16")
        with pytest.raises(RuntimeError, match="AMX product is unavailable: this CPU lacks amx_tile"):
            lib.library(amx=True)
    finally:
        monkeypatch.undo()
        lib.clear()


def test_build_failure_is_reported_with_the_compilers_message(tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: error: no AMX here' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="could not build amx_linear.c \\+ avx512_linear.c \\+ elementwise.c \\+ attention.c \\+ head_argmax.c: cc: error: no AMX here"):
        lib.build(str(fake), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so*")) and not list((tmp_path / "out").glob("tmp*"))


@pytest.mark.skipif(lib.compiler() is None, reason="no C compiler on PATH")
def test_build_is_cached_by_source_flags_and_compiler(tmp_path):
    cc = lib.compiler()
    first = lib.build(cc, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert lib.build(cc, tmp_path) == first and first.stat().st_mtime_ns == mtime  # not rebuilt


def test_max_cpu_isa_avx2_hides_avx512_and_amx(monkeypatch):
    monkeypatch.setattr(lib, "_cpuinfo", lambda field: "fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 amx_tile")
    try:
        for value, want in (("AVX2", {"fpu", "sse2", "avx2", "fma"}), ("", None), ("all", None)):
            monkeypatch.setenv(lib.MAX_ISA_ENV, value)
            lib.cpu_flags.cache_clear()
            assert lib.cpu_flags() == (want or {"fpu", "sse2", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16",
                                                 "amx_tile"})
        monkeypatch.setenv(lib.MAX_ISA_ENV, "AVX2")
        lib.cpu_flags.cache_clear()
        lib.clear()
        assert not lib.avx512_status().available and "avx512f" in lib.avx512_status().reason
        monkeypatch.setenv(lib.MAX_ISA_ENV, "SSE9")
        lib.cpu_flags.cache_clear()
        with pytest.raises(ValueError, match="INFERHAL_MAX_CPU_ISA='SSE9': use AVX2"):
            lib.cpu_flags()
    finally:
        monkeypatch.undo()
        lib.cpu_flags.cache_clear()
        lib.clear()
