"""``qualify.recorded``: a device check JSON recorded on a lent GPU joins a qualify report at its recorded
level, apart from this run's rows and verdict; a bad file is a clean error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from inferhal.core.errors import UserError
from inferhal.core.qualify import recorded

H200 = Path(__file__).parents[3] / "docs" / "hardware" / "h200-2026-12-04.json"


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "inferhal.core.cli.main", "qualify", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


def test_the_recorded_h200_run_is_a_device_check_with_device_rows():
    data = recorded.load(str(H200), "cuda_sm100")
    assert data["execution_level"] == "device: NVIDIA H200 (sm_90), not Blackwell"
    assert {r["execution_level"] for r in data["kernels"]} == {data["execution_level"]}
    assert {r["reference"] for r in data["kernels"]} == {"cuda:0"}  # the oracle ran on the same GPU
    assert all(r["status"] == "pass" for r in data["kernels"])


def test_merge_adds_recorded_rows_without_touching_the_verdict():
    rep = {"ops": {"norm.rms": {"status": "not-run"}, "embed": {"status": "fallback"}},
           "summary": {"verdict": "incomplete", "exit_status": 3, "notes": []}}
    recorded.merge(rep, recorded.load(str(H200), "cuda_sm100"), "h200.json")
    assert rep["summary"]["verdict"] == "incomplete" and rep["summary"]["exit_status"] == 3
    assert rep["ops"]["norm.rms"]["recorded"]["status"] == "pass"
    assert rep["ops"]["norm.rms"]["recorded"]["level"].startswith("device: NVIDIA H200")
    assert "recorded" not in rep["ops"]["embed"]
    assert rep["recorded"]["e2e"] and rep["recorded"]["perf"]
    assert any("h200.json" in n for n in rep["summary"]["notes"])
    assert any(line.strip().startswith("e2e gemma3_270m") for line in recorded.summary_lines(rep))


@pytest.mark.parametrize("content,match", [("{not json", "cannot be read as JSON"),
                                           ('{"schema": 1}', "not a device check"),
                                           ('{"schema": 1, "kernels": [], "backend": "ascend950"}', "for backend")])
def test_bad_recorded_files_are_user_errors(tmp_path, content, match):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(UserError, match=match):
        recorded.load(str(bad), "cuda_sm100")
    with pytest.raises(UserError, match="cannot be read"):
        recorded.load(str(tmp_path / "missing.json"), "cuda_sm100")


def test_unavailable_backend_with_a_recording_writes_the_device_rows(tmp_path):
    out = _cli("backend=cuda_sm100", f"qualify.recorded={H200}", f"qualify.output_dir={tmp_path}",
               "qualify.progress=false", cwd=tmp_path)
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]  # incomplete here: nothing ran on this host
    assert "recorded (device: NVIDIA H200 (sm_90), not Blackwell" in out.stdout
    rep = json.loads((tmp_path / "cuda_sm100-quick" / "report.json").read_text())
    assert rep["summary"]["verdict"] == "unavailable" and rep["recorded"]["ops"]["moe.experts"]["status"] == "pass"
    html = (tmp_path / "cuda_sm100-quick" / "report.html").read_text()
    assert "Recorded device results" in html and "not Blackwell" in html


def test_a_bad_recording_fails_before_anything_runs(tmp_path):
    out = _cli("backend=reference", f"qualify.recorded={tmp_path / 'nope.json'}", f"qualify.output_dir={tmp_path}",
               cwd=tmp_path)
    assert out.returncode == 2 and "qualify.recorded=" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "reference-quick").exists()
