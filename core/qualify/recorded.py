"""Recorded device results in a qualification report: ``inferhal qualify qualify.recorded=FILE``.

``FILE`` is a device check JSON (``docs/hardware/*.json``, written by a backend's device check on a lent
machine). Its rows join the report in their own section, each at its recorded execution level (e.g.
``device: <chip> (<arch>)``) with the run and commit it came from; each op's summary
gains a ``recorded`` entry. They never change the verdict or the exit status: those say what ran on this
host. A file that cannot be read, is not a device check, or belongs to another backend is a UserError.
"""

from __future__ import annotations

import json
from pathlib import Path

from inferhal.core.errors import UserError

SECTIONS = ("kernels", "v4_shapes", "e2e", "gemma", "graphs", "perf")


def load(path: str, backend: str) -> dict:
    """The recorded JSON at ``path``, checked to be a device check of ``backend``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"qualify.recorded={path!r} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != 1 or not isinstance(data.get("kernels"), list):
        raise UserError(f"qualify.recorded={path!r} is not a device check report (schema 1 with a 'kernels' list)")
    if data.get("backend", backend) != backend:
        raise UserError(f"qualify.recorded={path!r} was recorded for backend {data['backend']!r}, not {backend!r}")
    return data


def _case_row(r: dict) -> dict:
    n, d, bi = r.get("numerics") or {}, r.get("determinism") or {}, r.get("batch_invariance") or {}
    return {"key": r.get("key"), "op": r.get("op"), "shape": r.get("shape"), "dtype": r.get("dtype"),
            "level": r.get("execution_level", "?"), "status": r.get("status", "?"), "max_abs": n.get("max_abs"),
            "cosine": n.get("cosine"), "deterministic": d.get("ok"), "batch_invariant": bi.get("ok"),
            "reference": r.get("reference"), "run": r.get("run"), "commit": r.get("commit"), "message": r.get("message", "")}


def merge(report: dict, data: dict, path: str) -> None:
    """Add ``data``'s rows to ``report`` (in place) as its ``recorded`` section and per-op ``recorded`` entries."""
    rows = [_case_row(r) for r in data["kernels"]]
    per_op: dict[str, dict] = {}
    for r in rows:
        o = per_op.setdefault(r["op"], {"level": r["level"], "cases": 0, "failed": 0})
        o["cases"] += 1
        o["failed"] += r["status"] == "fail"
    for o in per_op.values():
        o["status"] = "fail" if o["failed"] else "pass"
    for op, o in report.get("ops", {}).items():
        if op in per_op:
            o["recorded"] = per_op[op]
    report["recorded"] = {
        "path": str(path), "execution_level": data.get("execution_level", "?"), "note": data.get("note", ""),
        "env": data.get("env", {}), "runs": data.get("runs", []), "ops": per_op, "rows": rows,
        **{sec: data.get(sec, []) for sec in SECTIONS if sec != "kernels"}}
    s = report.setdefault("summary", {})
    passed = sum(o["status"] == "pass" for o in per_op.values())
    s.setdefault("notes", []).append(
        f"recorded device results from {path} ({data.get('execution_level', '?')}): {passed} of {len(per_op)} "
        f"ops passed every recorded case; they are listed apart and do not change this run's verdict")


def summary_lines(report: dict) -> list[str]:
    """Plain lines for the CLI: per-op recorded status, end-to-end rows and measured performance."""
    rec = report.get("recorded")
    if not rec:
        return []
    lines = [f"recorded ({rec['execution_level']}, {rec['path']}):"]
    for op, o in sorted(rec["ops"].items()):
        lines.append(f"  {op:<18} {o['status']:<5} {o['cases'] - o['failed']}/{o['cases']} cases")
    for r in rec.get("e2e", []) + rec.get("gemma", []):
        lines.append(f"  e2e {r.get('model')} {r.get('dtype', '')}: {r.get('status')} {r.get('matched', '')}")
    for r in rec.get("perf", []):
        if "ms" in r:
            lines.append(f"  perf {r['name'][:64]:<64} {r['ms']:.3f} ms  {r['GBps']:.0f} GB/s {_pct(r.get('bandwidth_fraction'))}"
                         f"  {r['TFLOPps']:.1f} TFLOP/s {_pct(r.get('flops_fraction'))}")
    return lines


def _pct(frac) -> str:
    return "(-)" if frac is None else f"({frac:.1%} of peak)"
