"""`inferhal plan`, `plan devices`, a `-m parallel=dep8,dep16` sweep, the plot, and calibration rows."""

from __future__ import annotations

import json

import pytest

from inferhal.core.cli.main import main
from inferhal.core.plan import calibrate

ARGS = ["model=deepseek_v4_flash", "plan.device=B200", "cache.kv_dtype=fp8", "plan.traffic.batch_sizes=[1,64]"]


def test_plan_writes_json_and_a_readable_table(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *ARGS, "parallel=dep8", "plan.gpu_hour_usd=2", f"output={out}"]) == 0
    text = capsys.readouterr().out
    assert "memory per device" in text and "$/Mtok out" in text and "\x1b[" not in text  # no colour codes in a pipe
    plan = json.loads(out.read_text())
    assert plan["layout"] == {"tp": 1, "dp": 8, "ep": 8, "decode_devices": 8, "prefill_devices": 0}
    assert [r["batch"] for r in plan["rows"]] == [1, 64] and plan["omitted"]


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    assert main(["plan", *ARGS, "parallel=dep8", f"plan.plot={png}"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_sweep_over_layouts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", *ARGS, "-m", "parallel=dep8,dep16"]) == 0
    text = capsys.readouterr().out
    assert "tp=1 dp=8 ep=8" in text and "tp=1 dp=16 ep=16" in text


def test_devices_and_bad_words(capsys, tmp_path):
    out = tmp_path / "devices.json"
    assert main(["plan", "devices", f"output={out}"]) == 0
    rows = json.loads(out.read_text())
    assert {"B200", "B300", "GB300", "H200", "950PR", "950DT"} <= set(rows)
    assert all(r["sources"] for r in rows.values())
    assert main(["plan", "frobnicate"]) == 2
    assert "usage: inferhal plan" in capsys.readouterr().err
    assert main(["plan", *ARGS, "plan.device=Z9000"]) == 2


def test_calibration_rows_state_their_assumptions():
    data = calibrate.anchors()
    for e in data["published"]:
        assert e["missing"] and e["assumptions"] and e["source"]
    row = calibrate.published(data["published"][0])  # vLLM's 826 tok/s per user on 4 x B300
    assert row["figure"] == 826 and row["predicted"] > 0 and row["ratio"] == pytest.approx(row["predicted"] / 826)
    tiny = next(e for e in data["hosts"] if e["model"] == "deepseek_v4_tiny")
    rows = calibrate.host_rows(tiny, ".")
    assert [r["concurrency"] for r in rows] == [1, 8]
    # a 642k-parameter step is all dispatch: the roofline predicts far less than was measured, and says so
    assert all(r["predicted_ms"] < r["measured_ms"] / 10 for r in rows)


def test_no_recorded_device_op_beats_its_catalog_roofline():
    """A recorded H200 op faster than max(bytes / bandwidth, flops / peak) would mean the catalog's peaks are wrong."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[3]
    rows = calibrate.device_rows(calibrate.anchors()["devices"][0], str(root))
    assert len(rows) >= 8 and all("op" in r for r in rows)
    assert all(0 < r["of_roofline"] <= 1 for r in rows)
