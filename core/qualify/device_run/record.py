"""Where a device run's results go, row by row, so that a run cut short keeps what it measured.

Every row is appended to ``<out>.rows.jsonl`` the moment it exists (one ``os.write`` of one line on a file
opened with ``O_APPEND``, so worker processes can share the file), and the report ``<out>`` (JSON, schema 1:
``inferhal qualify qualify.recorded=FILE`` reads it) with its markdown summary ``<out minus .json>.md`` is
rebuilt from those lines at every section's end. After a kill, :func:`collect` rebuilds both from the lines.

The report carries what a later reader needs to trust it: the commit (``INFERHAL_COMMIT`` or the checkout's
git HEAD) and a digest of the source files (:func:`source_digest`: the same digest on a checkout of that
commit proves the run's code), the device, torch, the backend's toolchain (its ``environment`` extra) and what
the device object describes of itself, and every row's execution level.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any, Iterable

#: report sections in the order they are shown (a row's ``section`` names its list)
SECTIONS = ("kernels", "v4_shapes", "e2e", "gemma", "resources", "graphs", "perf", "layer", "speed", "peer", "serve")
#: statuses that count as a failure of the backend (a ceiling torch lacks, a skipped section, do not)
FAILED = ("fail", "timeout")
ROOT = Path(__file__).resolve().parents[3]  # the repository root (the ``inferhal`` package)


def source_digest(root: Path = ROOT) -> str:
    """sha256 over the path and bytes of every ``.py`` and ``.yaml`` file under core/, backends/, kernels/ and
    conf/ (sorted): equal digests, the same code."""
    h = hashlib.sha256()
    for top in ("core", "backends", "kernels", "conf"):
        for p in sorted((root / top).rglob("*")):
            if p.suffix in (".py", ".yaml") and p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def commit() -> str:
    """``INFERHAL_COMMIT`` when set (a lent machine's copy of the tree has no .git), else the checkout's."""
    if os.environ.get("INFERHAL_COMMIT"):
        return os.environ["INFERHAL_COMMIT"]
    from inferhal.core.qualify.manifest import _git_commit

    return _git_commit(ROOT)


class Recorder:
    """Rows of one run in ``rows_path`` (JSON lines, appended as measured)."""

    def __init__(self, rows_path: str | Path) -> None:
        self.rows_path = Path(rows_path)

    def add(self, row: dict) -> dict:
        line = (json.dumps(row, default=str) + "\n").encode()
        fd = os.open(self.rows_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        return row

    def rows(self) -> list[dict]:
        """Every complete line written so far (a line cut by a kill is skipped)."""
        if not self.rows_path.exists():
            return []
        out = []
        for line in self.rows_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


def rows_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.stem + ".rows.jsonl")


def markdown_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.stem + ".md")


def header(backend: str, probe: Any) -> dict:
    """The report's fixed part, before any row: what ran, where and from which code."""
    return {"schema": 1, "kind": "inferhal device run", "backend": backend,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "source_digest": source_digest(), "python": platform.python_version(),
            "probe": {"available": probe.available, "reason": probe.reason, **{k: str(v) for k, v in dict(probe.details).items()}}}


def build(head: dict, rows: Iterable[dict]) -> dict:
    """The report: ``head`` plus every row in its section's list, and a summary."""
    report = dict(head)
    for sec in SECTIONS:
        report[sec] = []
    for row in rows:
        if row.get("section") == "head":
            continue
        if row.get("section") == "env":
            report["env"] = {k: v for k, v in row.items() if k != "section"}
        elif row.get("section") == "run":
            report.setdefault("timeline", []).append({k: v for k, v in row.items() if k != "section"})
        else:
            report.setdefault(row.get("section", "other"), []).append(row)
    report["summary"] = summarize(report)
    return report


def summarize(report: dict) -> dict:
    counts: dict[str, dict[str, int]] = {}
    failed = []
    for sec in SECTIONS:
        for row in report.get(sec, []):
            st = row.get("status", "?")
            counts.setdefault(sec, {}).setdefault(st, 0)
            counts[sec][st] += 1
            if st in FAILED:
                failed.append(f"{sec}: {row.get('key') or row.get('shape') or row.get('name') or row.get('model') or row.get('op')}")
    return {"counts": counts, "failed": failed, "ok": not failed}


def save(out: str | Path, head: dict, rec: Recorder) -> dict:
    report = build(head, rec.rows())
    Path(out).write_text(json.dumps(report, indent=1, default=str))
    markdown_path(out).write_text(markdown(report))
    return report


def collect(out: str | Path) -> dict:
    """Rebuild ``out`` and its markdown from ``<out>.rows.jsonl`` (after a run was killed): the header is the
    one the run wrote first (``section: "head"``)."""
    rec = Recorder(rows_path(out))
    rows = rec.rows()
    head = next((r for r in rows if r.get("section") == "head"), {"schema": 1, "kind": "inferhal device run"})
    head = {k: v for k, v in head.items() if k != "section"}
    head["collected_after_stop"] = True
    report = build(head, rows)
    Path(out).write_text(json.dumps(report, indent=1, default=str))
    markdown_path(out).write_text(markdown(report))
    return report


# ------------------------------------------------------------------------------------------------ markdown

def _f(v: Any, spec: str = ".3g") -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _pct(v: Any) -> str:
    return "" if v is None else f"{v:.1%}"


def markdown(report: dict) -> str:
    """A short summary a person reads: one table per section that has rows."""
    env = report.get("env", {})
    lines = [f"# Device run: {report.get('backend')} on {env.get('device', '?')}", "",
             f"- execution level: **{env.get('execution_level', report.get('execution_level', '?'))}**",
             f"- commit `{report.get('commit', '?')}`, source digest `{str(report.get('source_digest', ''))[:16]}`, "
             f"{report.get('created', '')}",
             f"- torch {env.get('torch', '?')}, python {report.get('python', '?')}; toolchain: "
             + ", ".join(f"{k} {v}" for k, v in (env.get("toolchain") or {}).items()),
             f"- {env.get('describe', '')}".rstrip("- "),
             f"- summary: {json.dumps(report.get('summary', {}).get('counts', {}))}", ""]
    k = report.get("kernels", [])
    if k:
        by_op: dict[str, list[int]] = {}
        for r in k:
            c = by_op.setdefault(r.get("op", "?"), [0, 0])
            c[0] += r.get("status") == "pass"
            c[1] += 1
        lines += ["## Conformance cases against the reference on the same device", "", "| op | passed |", "|---|---|"]
        lines += [f"| `{op}` | {p}/{n} |" for op, (p, n) in sorted(by_op.items())] + [""]
    tables = {
        "v4_shapes": ("V4-shaped cases", ["shape", "variant", "status", "max_abs_err"]),
        "e2e": ("End to end against the reference", ["model", "dtype", "status", "matched"]),
        "gemma": ("Gemma 3 270M against the reference", ["model", "dtype", "status", "matched"]),
        "resources": ("Registers, spills and shared memory per kernel", ["kernel", "op", "arch", "registers",
                                                                          "spill_stack_bytes", "shared_bytes", "status"]),
        "graphs": ("Graphs", ["name", "status", "eager_ms", "graph_ms", "replayed_steps", "first_host_sync",
                               "core_host_reads"]),
        "perf": ("Kernels beside ceilings at the same shapes", ["name", "variant", "kind", "status", "ms", "GBps",
                                                                "TFLOPps", "of_ceiling", "ceiling"]),
        "layer": ("Decode layer under the profiler: each op's share", ["context", "op", "share", "ms_per_step", "status"]),
        "speed": ("Decode tok/s end to end", ["model", "mode", "concurrency", "tok_s", "status", "graphs_replayed"]),
        "peer": ("transformers eager generate, same device", ["model", "concurrency", "tok_s", "status"]),
        "serve": ("inferhal serve under bench serve", ["concurrency", "tok_s", "ttft_p50_ms", "ttft_p99_ms",
                                                       "tpot_p50_ms", "tpot_p99_ms", "status"]),
    }
    for sec, (title, cols) in tables.items():
        rows = report.get(sec, [])
        if not rows:
            continue
        lines += [f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            cells = [(_pct(r.get(c)) if c in ("share", "of_ceiling") else _f(r.get(c))) for c in cols]
            lines.append("| " + " | ".join(x.replace("|", "/").replace("\n", " ")[:90] for x in cells) + " |")
        lines.append("")
    failed = report.get("summary", {}).get("failed", [])
    if failed:
        lines += ["## Failed", ""] + [f"- {f}" for f in failed] + [""]
    return "\n".join(lines)
