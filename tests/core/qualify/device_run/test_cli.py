"""The device run with the backend as a parameter, here the reference on this host at reduced sizes: every row
carries its level and lands in the report; bad arguments are refused; a run killed midway keeps the rows it
measured and ``--collect`` rebuilds the report from them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest


def _cmd(*args):
    return [sys.executable, "-m", "inferhal.core.qualify.device_run.cli", *args]


def _run(*args, tmp_path, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(_cmd(*args), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=timeout)


@pytest.mark.slow
def test_a_run_on_the_reference_records_every_row_with_its_level(tmp_path):
    out = tmp_path / "run.json"
    got = _run("--backend", "reference", "--scale", "reduced", "--sections", "kernels,perf", "--ops", "norm.rms",
               "--workers", "1", "--out", str(out), tmp_path=tmp_path)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-3000:]
    rep = json.loads(out.read_text())
    level = rep["env"]["execution_level"]
    assert level.startswith("device: PyTorch") and rep["backend"] == "reference" and len(rep["source_digest"]) == 64
    assert rep["kernels"] and all(r["status"] == "pass" and r["execution_level"] == level for r in rep["kernels"])
    kinds = {r["kind"] for r in rep["perf"]}
    assert {"ceiling", "kernel"} <= kinds and all(r["execution_level"] == level for r in rep["perf"])
    norm = next(r for r in rep["perf"] if r.get("op") == "norm.rms")
    assert norm["status"] == "measured" and norm["ms"] > 0 and norm["ceiling"] == "copy" and norm["of_ceiling"] > 0
    assert "## Kernels beside ceilings at the same shapes" in (tmp_path / "run.md").read_text()
    assert "device_run:" in got.stdout and "all passed" in got.stdout


@pytest.mark.parametrize("args,needle", [
    (("--backend", "reference", "--sections", "kernals"), "unknown section"),
    (("--sections", "kernels"), "--backend NAME is required"),
])
def test_bad_arguments_are_refused(tmp_path, args, needle):
    got = _run(*args, "--out", str(tmp_path / "r.json"), tmp_path=tmp_path)
    assert got.returncode == 2 and needle in got.stderr and "Traceback" not in got.stderr


def test_an_unavailable_backend_exits_2_with_its_reason(tmp_path):
    got = _run("--backend", "ascend950", "--out", str(tmp_path / "r.json"), tmp_path=tmp_path)
    assert got.returncode == 2 and "no device to check" in got.stderr and "Traceback" not in got.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["probe"]["available"] is False and rep["execution_level"] == "absent"


def test_a_killed_run_keeps_its_rows_and_collect_rebuilds_the_report(tmp_path):
    out = tmp_path / "run.json"
    rows = tmp_path / "run.rows.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen(_cmd("--backend", "reference", "--scale", "reduced", "--sections", "kernels", "--workers", "1",
                                 "--out", str(out)), cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            n = sum('"section": "kernels"' in line for line in rows.read_text().splitlines()) if rows.exists() else 0
            if n >= 6:
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.2)
        assert n >= 6
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its worker, mid-section
        proc.wait()
    got = _run("--collect", "--out", str(out), tmp_path=tmp_path)
    assert got.returncode == 0, got.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["collected_after_stop"] and len(rep["kernels"]) >= 6 and rep["backend"] == "reference"
    assert all(r["status"] == "pass" and r["execution_level"].startswith("device: PyTorch") for r in rep["kernels"])
    assert "kernels" in got.stdout
