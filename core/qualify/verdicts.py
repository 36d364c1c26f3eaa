"""The top of a backend's report page: one verdict per area (ops, batch invariance, golden outputs, each audit,
recorded device results), each with the level it ran at, then the audits' details and the environment
manifest. Rows are plain data (:func:`verdict_rows`) so the JSON and the page say the same."""

from __future__ import annotations

import html
import json

STATUS_COLOR = {"pass": "#1a7f37", "fail": "#cf222e", "not-run": "#9a6700", "skipped": "#57606a",
                "no-case": "#9a6700", "incomplete": "#9a6700", "refused": "#57606a", "unavailable": "#9a6700",
                "not claimed": "#57606a"}


def _e(x) -> str:
    return html.escape(str(x))


def badge(status: str) -> str:
    return f'<span class="b" style="background:{STATUS_COLOR.get(status, "#57606a")}">{_e(status)}</span>'


def _ops_row(report: dict) -> dict:
    claimed = {op: o for op, o in report.get("ops", {}).items() if o.get("claimed")}
    counts: dict[str, int] = {}
    for o in claimed.values():
        counts[o["status"]] = counts.get(o["status"], 0) + 1
    levels = sorted({o["level"] for o in claimed.values()})
    status = ("fail" if counts.get("fail") else "not-run" if counts.get("not-run") or counts.get("no-case")
              else "pass" if claimed else "not-run")
    what = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no op claimed"
    return {"area": "ops against the reference (numerics, determinism, batch invariance, performance)",
            "status": status, "level": ", ".join(levels) or "-", "summary": f"{len(claimed)} claimed ops: {what}"}


def _invariance_row(report: dict) -> dict:
    checked = passed = 0
    failed = []
    for r in report.get("rows", []):
        bi = r.get("batch_invariance") or {}
        if bi.get("ok") is not None:
            checked += 1
            passed += bool(bi["ok"])
            if bi["ok"] is False:
                failed.append(r["key"])
    levels = sorted({r["level"] for r in report.get("rows", []) if (r.get("batch_invariance") or {}).get("ok")
                     is not None})
    if not checked:
        return {"area": "batch invariance per op (a row alone = the row in a batch, bitwise)", "status": "not claimed",
                "level": "-", "summary": "no case of an op declaring batch invariance (as selected) ran"}
    return {"area": "batch invariance per op (a row alone = the row in a batch, bitwise)",
            "status": "fail" if failed else "pass", "level": ", ".join(levels),
            "summary": f"{passed}/{checked} cases" + (f"; failed: {', '.join(failed[:5])}" if failed else "")}


def verdict_rows(report: dict) -> list[dict]:
    """One row per area: ``area``, ``status``, ``level``, ``summary``."""
    rows = [_ops_row(report), _invariance_row(report)]
    for g in report.get("golden", []):
        rows.append({"area": f"golden tokens end to end: {g['name']}", "status": g.get("status", "?"),
                     "level": g.get("level", "-"), "summary": g.get("matched") or g.get("message", "")})
    for a in report.get("audits", {}).get("checks", []):
        rows.append({"area": f"{a['name']}: {a['title']}", "status": a["status"], "level": a["level"],
                     "summary": a.get("message") or _audit_summary(a)})
    rec = report.get("recorded")
    if rec:
        bad = sum(o["status"] == "fail" for o in rec["ops"].values())
        rows.append({"area": "recorded device results (not this run's verdict)", "status": "fail" if bad else "pass",
                     "level": rec["execution_level"], "summary": f"{len(rec['ops'])} ops recorded, {bad} failed"})
    return rows


def _audit_summary(a: dict) -> str:
    d = a.get("details", {})
    if a["name"] == "TEST01":
        return f"{d.get('prompts')} prompts x {d.get('tokens_each')} tokens equal; max |d logprob| {d.get('max_logprob_diff', 0):.2g}"
    if a["name"] == "TEST04":
        return (f"{d.get('repeats')} identical requests equal ({d.get('compared')}); fastest decode step ratio "
                f"{d.get('timing_ratio', 0):.2f} (bound {d.get('timing_bound')})")
    if a["name"] == "TEST06":
        return f"{d.get('requests')} streamed requests consistent"
    if a["name"] == "determinism":
        return f"{len(d.get('cases', []))} cases bitwise equal to the prompt run alone"
    return ""


def verdict_table(report: dict) -> str:
    s = report["summary"]
    out = [f"<table id='verdicts'><caption>Verdict: {badge(s['verdict'])} exit status {s['exit_status']}</caption>"
           "<tr><th>area</th><th>verdict</th><th>level</th><th>summary</th></tr>"]
    for r in verdict_rows(report):
        out.append(f"<tr><td>{_e(r['area'])}</td><td>{badge(r['status'])}</td><td>{_e(r['level'])}</td>"
                   f"<td class='m'>{_e(r['summary'])}</td></tr>")
    out.append("</table><p class='note'>Levels: device = ran on the backend's device; interpreter = emulated on "
               "the CPU, correctness only (timings there are no hardware result); compiled = compiled, never run; "
               "wired-unrun = wired to a device operator, never run; fallback = the reference stood in.</p>")
    return "".join(out)


def audits_html(report: dict) -> str:
    au = report.get("audits")
    if not au:
        return ""
    out = [f"<h2 id='audits'>Audits (MLPerf-style, end to end on {_e(au.get('model', ''))})</h2><table>"
           "<tr><th>check</th><th>verdict</th><th>level</th><th>seconds</th><th>message</th><th>details</th></tr>"]
    for a in au["checks"]:
        d = json.dumps(a.get("details", {}), default=str, indent=1)
        out.append(f"<tr><td><b>{_e(a['name'])}</b><br>{_e(a['title'])}</td><td>{badge(a['status'])}</td>"
                   f"<td>{_e(a['level'])}</td><td>{_e(a.get('seconds', ''))}</td><td class='m'>{_e(a.get('message', ''))}"
                   f"</td><td><details><summary>details</summary><pre class='m'>{_e(d)}</pre></details></td></tr>")
    return "".join(out) + "</table>"


def manifest_html(report: dict) -> str:
    m = report.get("manifest")
    if not m:
        return ""
    b, cpu = m.get("backend", {}), m.get("host", {}).get("cpu", {})
    rows = [("torch", m.get("torch")), ("inferhal", m.get("inferhal")), ("python", m.get("python")),
            ("backend", f"{b.get('name')} from {b.get('distribution')} {b.get('version')}"
                        + (f" at {b['commit']}" if b.get("commit") else ""))]
    rows += [(f"backend toolchain: {k}", v) for k, v in m.get("toolchain", {}).items()]
    rows += [(f"backend probe: {k}", v) for k, v in m.get("probe", {}).items()]
    rows += [("config sha256", m.get("config_sha256")), ("host", m.get("host", {}).get("os")),
            ("CPU", f"{cpu.get('model')} ({cpu.get('logical_cpus')} logical)"),
            ("CPU SIMD flags", " ".join(cpu.get("simd_flags", [])) or "(none read)")]
    out = ["<h2 id='manifest'>Environment</h2><table>"]
    out += [f"<tr><th>{_e(k)}</th><td class='m'>{_e(v)}</td></tr>" for k, v in rows]
    out.append(f"</table><details><summary>all CPU flags ({len(cpu.get('flags', []))})</summary><p class='m'>"
               f"{_e(' '.join(cpu.get('flags', [])))}</p></details>")
    return "".join(out)
