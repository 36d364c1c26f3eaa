"""Output in a log: tables are never cut at 80 columns, long work prints plain progress lines."""

from __future__ import annotations

import io
import subprocess
import sys

from inferhal.core import console as C


def test_piped_plan_table_is_whole():
    out = subprocess.run([sys.executable, "-m", "inferhal.core.cli.main", "plan", "kv", "model=deepseek_v4_flash"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "…" not in out.stdout and "200,416.0" in out.stdout  # the total, as wide as it is
    assert "\x1b[" not in out.stdout  # no colour codes in a log
    assert all(len(line) < C.LOG_WIDTH for line in out.stdout.splitlines())


def test_console_off_a_terminal_is_wide_and_plain(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    con = C.console()
    assert con.width == C.LOG_WIDTH and not con.is_terminal
    con.print("x" * 300)
    assert buf.getvalue() == "x" * 300 + "\n"  # one line, not wrapped at 80


def test_progress_off_a_terminal_prints_plain_lines(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    with C.Progress("qualify", 3, every=0.0) as p:
        p.advance("case a", n=0)
        p.advance("case b")
        p.note("7 tok/s")
        p.advance("case c", n=2)
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("[qualify] 0/3") and lines[0].endswith("case a")
    assert any(line.startswith("[qualify] 1/3") and "case b" in line for line in lines)
    assert lines[-1].startswith("[qualify] 3/3") and "7 tok/s" in lines[-1] and lines[-1].endswith("done")


def test_progress_lines_are_rate_limited(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    with C.Progress("bench", 100, every=3600.0) as p:
        for i in range(100):
            p.advance(f"item {i}")
    assert len(buf.getvalue().splitlines()) == 2  # the first line and the final one


def test_disabled_progress_is_silent(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    with C.Progress("x", 2, enabled=False) as p:
        p.advance("a")
    assert buf.getvalue() == ""
