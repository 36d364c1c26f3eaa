"""The qualification runner on test backends: a broken one fails readably, perf only where it may be
measured, baselines catch regressions, wired-unrun ops are never passed, killed runs resume."""

from __future__ import annotations

import json

from inferhal.core.qualify import report as report_mod
from inferhal.core.qualify.cases import op_cases


def test_broken_backend_fails_naming_op_shape_and_error(qualify, tmp_path):
    rep = qualify("broken")
    s = rep["summary"]
    assert s["verdict"] == "fail" and s["exit_status"] == 1
    assert set(s["failed_ops"]) == {"norm.rms", "linear"}
    fails = {r["key"]: r["message"] for r in rep["rows"] if r["status"] == "fail"}
    raised = [m for m in fails.values() if "K=64 is not a multiple of the 128-wide tile" in m]
    assert raised and all("linear [T=5 N=96 K=64" in m and "ValueError" in m and "broken_backend.py" in m
                          for m in raised)
    wrong = [m for k, m in fails.items() if k.startswith("norm.rms")]
    assert wrong and all("D=640" in m and "out of tolerance" in m for m in wrong)
    # cases the bug does not touch pass: the failures are specific
    assert any(r["status"] == "pass" for r in rep["rows"] if r["op"] == "norm.rms")
    paths = report_mod.write(rep, tmp_path / "out")
    html = paths["html"].read_text()
    assert "K=64 is not a multiple of the 128-wide tile" in html and "T=7 D=640" in html
    assert json.loads(paths["json"].read_text())["summary"]["failed_ops"] == s["failed_ops"]


def test_reference_runs_real_determinism_and_batch_checks(qualify, tmp_path):
    rep = qualify("reference", batch_invariant=True, ops=("norm.rms", "kv.write", "sample"), reruns=2)
    rows = rep["rows"]
    assert len(rows) == sum(len(op_cases(op, "quick")) for op in ("norm.rms", "kv.write", "sample"))
    assert all(r["status"] == "pass" and r["level"] == "device" for r in rows), [r["message"] for r in rows]
    assert all(r["determinism"]["reruns"] == 2 and "other" in r["determinism"]["order"] for r in rows)
    norm = [r for r in rows if r["op"] == "norm.rms"]
    assert all(r["batch_invariance"]["status"] == "pass" for r in norm)
    assert all(r["perf"]["status"] == "not measured" and "declares no peak" in r["perf"]["message"] for r in rows)
    assert any("trivially exact" in n for n in rep["summary"]["notes"])
    plain = qualify("reference", ops=("norm.rms",), reruns=1, output_dir=str(tmp_path / "plain"))
    assert all(r["batch_invariance"]["status"] == "not claimed" for r in plain["rows"])


def test_perf_measured_with_peaks_and_baseline_regression(qualify, tmp_path):
    rep = qualify("timed", ops=("embed",))
    perf = [r["perf"] for r in rep["rows"]]
    assert all(p["status"] == "measured" and p["seconds"] > 0 and p["bw_fraction"] > 0 for p in perf)
    assert rep["summary"]["verdict"] == "pass"
    paths = report_mod.write(rep, tmp_path / "first")
    base = json.loads(paths["baseline"].read_text())
    assert set(base["cases"]) == {r["key"] for r in rep["rows"]}
    # a baseline a million times faster than anything possible: every case regresses
    fast = {k: {"seconds": v["seconds"] * 1e-6} for k, v in base["cases"].items()}
    (tmp_path / "fast.json").write_text(json.dumps({"cases": fast}))
    rep2 = qualify("timed", ops=("embed",), baseline=str(tmp_path / "fast.json"), output_dir=str(tmp_path / "b"))
    assert rep2["summary"]["verdict"] == "fail"
    assert all(r["perf"]["status"] == "regression" and "vs baseline" in r["message"] for r in rep2["rows"])
    slow = {k: {"seconds": v["seconds"] * 1e6} for k, v in base["cases"].items()}
    (tmp_path / "slow.json").write_text(json.dumps({"cases": slow}))
    rep3 = qualify("timed", ops=("embed",), baseline=str(tmp_path / "slow.json"), output_dir=str(tmp_path / "c"))
    assert rep3["summary"]["verdict"] == "pass"


def test_wired_unrun_ops_are_reported_never_passed(qualify):
    rep = qualify("unrun")
    assert rep["ops"]["norm.rms"] == {"level": "wired-unrun", "claimed": True, "status": "not-run",
                                      "cases": len(op_cases("norm.rms", "quick")), "failed": 0}
    assert all(r["status"] == "not-run" and r["level"] == "wired-unrun" for r in rep["rows"])
    assert rep["summary"]["verdict"] == "incomplete" and rep["summary"]["exit_status"] == 3
    assert rep["ops"]["linear"]["status"].startswith("fallback")


def test_killed_run_resumes_from_the_journal(qualify, tmp_path):
    out = str(tmp_path / "resume")
    first = qualify("reference", ops=("rope.apply",), output_dir=out)
    journal = tmp_path / "resume" / "journal.jsonl"
    lines = journal.read_text().splitlines()
    assert len(lines) == 1 + len(first["rows"])
    journal.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])  # header, 2 cases, a torn line
    second = qualify("reference", ops=("rope.apply",), output_dir=out)
    assert second["resumed_cases"] == 2
    assert [r["key"] for r in second["rows"]] == [r["key"] for r in first["rows"]]
    assert len(journal.read_text().splitlines()) == 1 + len(first["rows"])
    # another seed is another run: nothing is reused
    third = qualify("reference", ops=("rope.apply",), output_dir=out, seed=1)
    assert third["resumed_cases"] == 0


def test_per_call_fallbacks_are_reported_at_level_fallback(qualify, tmp_path):
    rep = qualify("percall", ops=("norm.rms",), reruns=1)
    rows = rep["rows"]
    fell = [r for r in rows if int(r["shape"].split("D=")[1].split()[0]) >= 512]
    native = [r for r in rows if r not in fell]
    assert fell and native
    assert all(r["level"] == "fallback" and r["status"] == "not-run" and "fell back" in r["message"]
               and "the operator takes D < 512" in r["message"] and "numerics" not in r for r in fell)
    assert all(r["level"] == "device" and r["status"] == "pass" and "fallbacks" not in r for r in native)
    op = rep["ops"]["norm.rms"]
    assert op["status"] == "not-run" and op["fallback"] == len(fell) and op["level"] == "device"
    s = rep["summary"]
    assert s["verdict"] == "incomplete" and s["exit_status"] == 3 and s["not_qualified_ops"] == ["norm.rms"]
    assert "fallback" in s["levels"] and any(f"norm.rms {len(fell)}" in n for n in s["notes"])
    html = report_mod.write(rep, tmp_path / "out")["html"].read_text()
    assert "fell back" in html
