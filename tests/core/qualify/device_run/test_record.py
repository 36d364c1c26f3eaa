"""The device run's record: each row on disk as it is measured, a cut last line skipped, the report and its
markdown rebuilt from the rows (also after a kill), failures counted, and a digest that names the code."""

from __future__ import annotations

import json
import os
import shutil

from inferhal.core.qualify.device_run import record


def _rows(tmp_path):
    out = tmp_path / "run.json"
    rec = record.Recorder(record.rows_path(out))
    rec.add({"section": "head", "schema": 1, "backend": "b", "commit": "abc", "source_digest": "d" * 64})
    rec.add({"section": "env", "device": "Dev 1", "torch": "2.x", "toolchain": {"kit": "1.0"}})
    rec.add({"section": "kernels", "op": "norm.rms", "key": "norm.rms[a]", "status": "pass", "execution_level": "device: Dev 1"})
    rec.add({"section": "kernels", "op": "norm.rms", "key": "norm.rms[b]", "status": "fail", "execution_level": "device: Dev 1"})
    rec.add({"section": "perf", "name": "ceiling copy: 1 B", "kind": "ceiling", "status": "unavailable"})
    rec.add({"section": "perf", "name": "k", "kind": "kernel", "status": "measured", "ms": 1.5, "GBps": 10.0,
             "TFLOPps": 0.5, "of_ceiling": 0.25, "ceiling": "copy", "variant": "default"})
    rec.add({"section": "run", "worker": "kernels", "exit": 0, "seconds": 1.0})
    return out, rec


def test_rows_are_appended_as_measured_and_a_cut_line_is_skipped(tmp_path):
    out, rec = _rows(tmp_path)
    assert rec.rows_path == tmp_path / "run.rows.jsonl" and len(rec.rows()) == 7
    with open(rec.rows_path, "a") as f:
        f.write('{"section": "perf", "name": "cut sho')  # the process died inside a write
    assert len(rec.rows()) == 7


def test_the_report_puts_rows_in_sections_and_counts_failures(tmp_path):
    out, rec = _rows(tmp_path)
    head = {"schema": 1, "backend": "b", "commit": "abc"}
    report = record.save(out, head, rec)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    assert [r["key"] for r in report["kernels"]] == ["norm.rms[a]", "norm.rms[b]"]
    assert report["env"]["device"] == "Dev 1" and report["timeline"][0]["worker"] == "kernels"
    assert "head" not in report
    s = report["summary"]
    assert s["counts"]["kernels"] == {"pass": 1, "fail": 1} and s["failed"] == ["kernels: norm.rms[b]"]
    assert not s["ok"]  # an unavailable ceiling is not a failure, a failed case is
    md = record.markdown_path(out).read_text()
    assert "| `norm.rms` | 1/2 |" in md and "| k | default | kernel | measured | 1.5 | 10 | 0.5 | 25.0% | copy |" in md
    assert "- kernels: norm.rms[b]" in md


def test_collect_rebuilds_the_report_from_the_rows_after_a_kill(tmp_path):
    out, rec = _rows(tmp_path)
    assert not out.exists()  # killed before any save
    report = record.collect(out)
    assert report["collected_after_stop"] and report["commit"] == "abc" and len(report["kernels"]) == 2
    assert json.loads(out.read_text())["summary"]["failed"] == ["kernels: norm.rms[b]"]
    assert record.markdown_path(out).exists()


def test_the_source_digest_names_the_code(tmp_path):
    for top in ("core", "backends", "kernels", "conf"):
        (tmp_path / top).mkdir()
        (tmp_path / top / "a.py").write_text(f"x = '{top}'\n")
    (tmp_path / "core" / "notes.txt").write_text("not code")
    first = record.source_digest(tmp_path)
    assert first == record.source_digest(tmp_path) and len(first) == 64
    (tmp_path / "core" / "notes.txt").write_text("still not code")
    assert record.source_digest(tmp_path) == first
    (tmp_path / "kernels" / "a.py").write_text("x = 'changed'\n")
    assert record.source_digest(tmp_path) != first
    shutil.rmtree(tmp_path / "conf")
    os.makedirs(tmp_path / "conf")
    assert record.source_digest(tmp_path) != first


def test_commit_comes_from_the_environment_first(monkeypatch):
    monkeypatch.setenv("INFERHAL_COMMIT", "deadbeef (at --prepare)")
    assert record.commit() == "deadbeef (at --prepare)"
    monkeypatch.delenv("INFERHAL_COMMIT")
    assert record.commit()  # the checkout's HEAD (or why none)
