"""``inferhal qualify`` from the command line: multirun directories, an unavailable backend, a broken one."""

from __future__ import annotations

import json
import subprocess
import sys


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "inferhal.core.cli.main", "qualify", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


def test_multirun_jobs_write_separate_reports(tmp_path):
    out = _cli("-m", "backend=reference", "qualify=quick,full", "qualify.ops=[embed]", "qualify.progress=false",
               "qualify.golden=false", "qualify.audits=false", f"qualify.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    quick = json.loads((tmp_path / "reference-quick" / "report.json").read_text())
    full = json.loads((tmp_path / "reference-full" / "report.json").read_text())
    assert quick["options"]["level"] == "quick" and full["options"]["level"] == "full"
    assert len(full["rows"]) > len(quick["rows"]) > 0
    assert (tmp_path / "reference-full" / "report.html").read_text().startswith("<!doctype html>")
    assert {a["status"] for a in quick["audits"]["checks"]} == {"not-run"}  # qualify.audits=false, said so
    assert quick["manifest"]["config_sha256"] != full["manifest"]["config_sha256"]


def test_unavailable_backend_reports_declared_ops_as_not_run(tmp_path):
    out = _cli("backend=ascend950", f"qualify.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 2 and "unavailable" in out.stderr
    rep = json.loads((tmp_path / "ascend950-quick" / "report.json").read_text())
    assert rep["summary"]["verdict"] == "unavailable" and rep["rows"] == []
    assert all(o["status"] != "pass" for o in rep["ops"].values())
    assert {(a["status"], a["level"]) for a in rep["audits"]["checks"]} == {("not-run", "absent")}
    assert "CANN" in rep["manifest"]["toolchain"] and rep["manifest"]["config_sha256"]
    page = (tmp_path / "ascend950-quick" / "report.html").read_text()
    assert page.index("id='verdicts'") < page.index("<h2>Details")


def test_broken_backend_through_the_command(registry, tmp_path, capsys):
    from inferhal.core.cli import cmd_qualify
    from inferhal.core.cli.main import compose

    cfg = compose(["backend.name=broken", "qualify.ops=[linear]", "qualify.progress=false",
                   f"qualify.output_dir={tmp_path}"], "qualify")
    assert cmd_qualify.run(cfg, [], registry=registry) == 1
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "K=64 is not a multiple" in " ".join(printed.split())
    assert (tmp_path / "broken-quick" / "report.html").exists()
