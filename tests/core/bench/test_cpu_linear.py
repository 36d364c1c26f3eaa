"""``inferhal bench cpu_linear``: the timing loop, the backends it finds, and its report, on small shapes (no
speed is asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from inferhal.backends.reference import ops as ref
from inferhal.core.bench import cpu_linear


def _slow_copy(x, w):  # an "engine" whose output differs from oneDNN's by a known amount
    return (ref.linear(x, w).float() + 2 ** -8 * ref.linear(x, w).float().abs().max()).bfloat16()


def test_measure_times_every_engine_and_compares_outputs():
    runners = {"reference": ref.linear, "same": ref.linear, "off": _slow_copy}
    rows = cpu_linear.measure(runners, [("a", 48, 64), ("b", 96, 32)], [1, 5], repeats=3, call_seconds=0.001)
    assert len(rows) == 2 * 2 * 3
    for r in rows:
        assert r["ms"] > 0 and r["gflops"] > 0 and len(r["repeat_ms"]) == 3 and r["calls"] >= 1
        assert r["ms"] == pytest.approx(sorted(r["repeat_ms"])[1])  # the median repeat
    assert all(r["ratio"] == 1.0 and r["max_ulps"] == 0 for r in rows if r["engine"] == "reference")
    assert all(r["max_ulps"] == 0 for r in rows if r["engine"] == "same")
    assert all(0.5 <= r["max_ulps"] <= 2.5 for r in rows if r["engine"] == "off")  # one ulp of the scale, rounded


def test_kernels_lists_the_reference_first_and_says_why_a_backend_is_missing(monkeypatch):
    from inferhal.kernels.cpu import lib

    monkeypatch.setattr(lib, "_amx", lambda: lib.Status(False, "this CPU lacks amx_tile"))
    runners, missing = cpu_linear.kernels()
    assert list(runners)[0] == "reference" and missing["cpu_amx"] == "this CPU lacks amx_tile"
    assert ("cpu_avx512" in runners) == lib.avx512_status().available
    assert "cuda_sm100" not in runners  # unavailable here, or on a GPU: not this CPU
    if "cpu_avx512" in runners:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
        torch.testing.assert_close(runners["cpu_avx512"](x, w), ref.linear(x, w), rtol=2 ** -7, atol=1e-2)
    only, why = cpu_linear.kernels("cpu_amx")
    assert list(only) == ["reference"] and list(why) == ["cpu_amx"]  # backend=NAME: that one alone


def test_run_writes_the_table_json_and_plot(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.setattr(cpu_linear, "SHAPES", (("tiny", 64, 32),))
    monkeypatch.setattr(cpu_linear, "CALL_SECONDS", 0.001)
    monkeypatch.setattr(cpu_linear, "kernels", lambda only=None: ({"reference": ref.linear, "k": ref.linear},
                                                                   {"cpu_amx": "no AMX"}))
    cfg = OmegaConf.create({"bench": {"concurrency": [1, 4], "repeats": 1, "output_dir": str(tmp_path)},
                            "backend": {"name": "reference"}, "output": None})
    assert cpu_linear.run(cfg) == 0
    data = json.loads((tmp_path / "cpu_linear.json").read_text())
    assert data["not_measured"] == {"cpu_amx": "no AMX"} and len(data["rows"]) == 4
    assert {(r["engine"], r["rows"]) for r in data["rows"]} == {("reference", 1), ("reference", 4), ("k", 1), ("k", 4)}
    assert (tmp_path / "cpu_linear.png").stat().st_size > 1000
