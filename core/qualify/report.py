"""Writing a qualification report: ``report.json`` (the data) and ``report.html`` (self-contained: tables,
an error-distribution chart per op and a roofline chart, all inline SVG; no network, no scripts)."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from inferhal.core.qualify import verdicts
from inferhal.core.qualify.numerics import HIST_LABELS

STATUS_COLOR = verdicts.STATUS_COLOR
LEVEL_NOTE = {"device": "ran on the device", "interpreter": "ran in an emulator on the CPU: not a hardware result",
              "compiled": "compiled only, never executed", "wired-unrun": "wired to a device operator, never executed",
              "fallback": "the reference stood in"}


def write(report: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "html": out / "report.html"}
    paths["json"].write_text(json.dumps(report, indent=1, default=str))
    paths["html"].write_text(render_html(report))
    measured = {r["key"]: {"seconds": r["perf"]["seconds"]} for r in report["rows"]
                if r.get("perf", {}).get("status") in ("measured", "regression")}
    if measured:  # promote with qualify.baseline=<this file> to guard later runs against regressions
        paths["baseline"] = out / "perf-baseline.json"
        paths["baseline"].write_text(json.dumps({"backend": report["backend"]["name"], "cases": measured}, indent=1))
    return paths


def _e(x) -> str:
    return html.escape(str(x))


def _fmt(x, spec=".3g") -> str:
    return "" if x is None else (format(x, spec) if isinstance(x, (int, float)) else _e(x))


def _badge(status: str) -> str:
    return f'<span class="b" style="background:{STATUS_COLOR.get(status, "#57606a")}">{_e(status)}</span>'


def render_html(report: dict) -> str:
    b, s = report["backend"], report["summary"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>inferhal qualify: {_e(b['name'])}</title>",
             "<style>body{font:14px system-ui,sans-serif;margin:24px;color:#1f2328}table{border-collapse:collapse;"
             "margin:8px 0 20px}td,th{border:1px solid #d0d7de;padding:3px 7px;text-align:left;vertical-align:top}"
             "th{background:#f6f8fa}.b{color:#fff;border-radius:4px;padding:1px 6px;font-size:12px;white-space:nowrap}"
             ".m{font-family:monospace;font-size:12px}.charts{display:flex;flex-wrap:wrap;gap:12px}"
             "caption{text-align:left;font-size:16px;font-weight:600;padding:4px 0}.note{color:#57606a;font-size:12px}"
             "</style></head><body>",
             f"<h1>inferhal qualify — {_e(b['name'])} ({_e(report['options']['level'])})</h1>",
             verdicts.verdict_table(report),
             f"<h2>Details</h2><p>{_e(report['created'])} · "
             f"device: {_e(b['device_name'])} · execution level of the profile: <b>{_e(b['exec_level'])}</b> "
             f"({_e(LEVEL_NOTE.get(b['exec_level'], ''))})</p>"]
    for note in s.get("notes", []):
        parts.append(f"<p><i>{_e(note)}</i></p>")
    if s["failed_ops"] or s.get("failed_golden") or s.get("failed_audits"):
        parts.append("<h2>Failures</h2><ul>")
        for r in report["rows"]:
            if r["status"] == "fail":
                parts.append(f"<li class='m'><b>{_e(r['op'])}</b> [{_e(r['shape'])}, {_e(r['dtype'])}]: "
                             f"{_e(r.get('message', ''))}</li>")
        for g in report.get("golden", []):
            if g.get("status") == "fail":
                parts.append(f"<li class='m'><b>golden {_e(g['name'])}</b>: {_e(g.get('message', ''))}</li>")
        for a in report.get("audits", {}).get("checks", []):
            if a.get("status") == "fail":
                parts.append(f"<li class='m'><b>audit {_e(a['name'])}</b>: {_e(a.get('message', ''))}</li>")
        parts.append("</ul>")
    parts.append(_ops_table(report))
    parts.append(verdicts.audits_html(report))
    parts.append(_golden_table(report))
    parts.append(_recorded_html(report))
    parts.append("<h2>Error distributions</h2><p>|result − reference| / rms(reference), every element of every "
                 "case of the op, by decade.</p><div class='charts'>")
    for op in report["ops"]:
        hist = [0] * len(HIST_LABELS)
        for r in report["rows"]:
            if r["op"] == op and r.get("numerics", {}).get("hist"):
                hist = [a + c for a, c in zip(hist, r["numerics"]["hist"])]
        if sum(hist):
            parts.append(_hist_svg(op, hist))
    parts.append("</div><h2>Roofline</h2>")
    parts.append(_roofline_svg(report))
    parts.append(_rows_table(report))
    parts.append("<h2>Tolerances</h2><p>Each is a multiple of the dtype's unit roundoff u; "
                 "pass when |y−r| ≤ rtol·|r| + atol·rms(r) everywhere and cosine ≥ 1 − atol²/2.</p><table>"
                 "<tr><th>op</th><th>dtype</th><th>rtol</th><th>atol·rms</th><th>why</th></tr>")
    seen = set()
    for r in report["rows"]:
        k = (r["op"], r["dtype"], r["tolerance"]["why"])
        if k not in seen:
            seen.add(k)
            t = r["tolerance"]
            parts.append(f"<tr><td>{_e(r['op'])}</td><td>{_e(r['dtype'])}</td><td>{'exact' if t['exact'] else _fmt(t['rtol'])}"
                         f"</td><td>{'' if t['exact'] else _fmt(t['atol_rms'])}</td><td>{_e(t['why'])}</td></tr>")
    parts.append("</table>" + verdicts.manifest_html(report) + "<h2>Backend profile</h2><pre class='m'>" +
                 _e(json.dumps(b, indent=1, default=str)) + "</pre></body></html>")
    return "".join(parts)


def _ops_table(report: dict) -> str:
    rows = ["<h2>Ops</h2><table><tr><th>op</th><th>execution level</th><th>claimed</th><th>status</th>"
            "<th>cases</th><th>failed</th></tr>"]
    for op, o in report["ops"].items():
        rows.append(f"<tr><td>{_e(op)}</td><td title='{_e(LEVEL_NOTE.get(o['level'], ''))}'>{_e(o['level'])}</td>"
                    f"<td>{'yes' if o['claimed'] else 'no'}</td><td>{_badge(o['status'].split()[0])} "
                    f"{_e(' '.join(o['status'].split()[1:]))}</td><td>{o['cases']}</td><td>{o['failed']}</td></tr>")
    return "".join(rows) + "</table>"


def _recorded_html(report: dict) -> str:
    """The recorded device results (``qualify.recorded``): per op, end to end, graphs, performance, cases."""
    rec = report.get("recorded")
    if not rec:
        return ""
    out = [f"<h2>Recorded device results</h2><p>From <span class='m'>{_e(rec['path'])}</span>, execution level "
           f"<b>{_e(rec['execution_level'])}</b>. {_e(rec.get('note', ''))} Recorded elsewhere: they do not change "
           "this run's verdict.</p><table><tr><th>run</th><th>commit</th><th>created</th><th>what</th></tr>"]
    for r in rec.get("runs", []):
        out.append(f"<tr><td>{_e(r.get('id', ''))}</td><td class='m'>{_e(r.get('commit', ''))}</td>"
                   f"<td>{_e(r.get('created', ''))}</td><td>{_e(r.get('what', ''))}</td></tr>")
    out.append("</table><table><tr><th>op</th><th>level</th><th>status</th><th>cases passed</th></tr>")
    for op, o in sorted(rec["ops"].items()):
        out.append(f"<tr><td>{_e(op)}</td><td>{_e(o['level'])}</td><td>{_badge(o['status'])}</td>"
                   f"<td>{o['cases'] - o['failed']}/{o['cases']}</td></tr>")
    out.append("</table><table><tr><th>end to end</th><th>dtype</th><th>status</th><th>tokens matched</th>"
               "<th>deterministic</th><th>max |Δ logprob|</th></tr>")
    for r in rec.get("e2e", []) + rec.get("gemma", []):
        out.append(f"<tr><td>{_e(r.get('model'))}</td><td>{_e(r.get('dtype', ''))}</td><td>{_badge(r.get('status', '?'))}"
                   f"</td><td>{_e(r.get('matched', r.get('message', '')))}</td><td>{_e(r.get('deterministic', ''))}</td>"
                   f"<td>{_fmt(r.get('max_logprob_diff'))}</td></tr>")
    for r in rec.get("graphs", []):
        out.append(f"<tr><td>device graph of a decode step ({_e(r.get('model'))})</td><td></td><td>{_badge(r.get('status', '?'))}"
                   f"</td><td colspan='3' class='m'>eager {_fmt(r.get('eager_ms'))} ms; "
                   f"{_e(r.get('first_host_sync', r.get('message', '')))}</td></tr>")
    out.append("</table><table><tr><th>measured</th><th>ms</th><th>GB/s</th><th>TFLOP/s</th><th>of peak bandwidth</th>"
               "<th>of peak FLOP/s</th></tr>")
    for r in rec.get("perf", []):
        if "ms" in r:
            out.append(f"<tr><td>{_e(r['name'])}</td><td>{_fmt(r['ms'])}</td><td>{_fmt(r['GBps'], '.0f')}</td>"
                       f"<td>{_fmt(r['TFLOPps'], '.1f')}</td><td>{_fmt(r.get('bandwidth_fraction'), '.1%')}</td>"
                       f"<td>{_fmt(r.get('flops_fraction'), '.1%')}</td></tr>")
    out.append("</table><details><summary>recorded cases</summary><table><tr><th>case</th><th>level</th><th>status</th>"
               "<th>max abs</th><th>deterministic</th><th>batch invariant</th><th>run</th></tr>")
    for r in rec["rows"]:
        out.append(f"<tr><td class='m'>{_e(r['key'])}</td><td>{_e(r['level'])}</td><td>{_badge(r['status'])}</td>"
                   f"<td>{_fmt(r['max_abs'])}</td><td>{_e(r['deterministic'])}</td><td>{_e(r['batch_invariant'])}</td>"
                   f"<td>{_e(r.get('run', ''))}</td></tr>")
    return "".join(out) + "</table></details>"


def _golden_table(report: dict) -> str:
    golden = report.get("golden")
    if not golden:
        return ""
    rows = ["<h2>End-to-end golden outputs</h2><table><tr><th>model</th><th>status</th><th>level</th>"
            "<th>tokens matched</th><th>message</th></tr>"]
    for g in golden:
        rows.append(f"<tr><td>{_e(g['name'])}</td><td>{_badge(g['status'])}</td><td>{_e(g.get('level', ''))}</td>"
                    f"<td>{_e(g.get('matched', ''))}</td><td class='m'>{_e(g.get('message', ''))}</td></tr>")
    return "".join(rows) + "</table>"


def _rows_table(report: dict) -> str:
    out = ["<h2>Cases</h2><table><tr><th>op</th><th>shape</th><th>dtype</th><th>level</th><th>status</th>"
           "<th>max abs</th><th>max rel</th><th>cosine</th><th>determinism</th><th>batch invariance</th>"
           "<th>performance</th><th>message</th></tr>"]
    for r in report["rows"]:
        n, d, bi, p = r.get("numerics", {}), r.get("determinism"), r.get("batch_invariance"), r.get("perf", {})
        det = "" if not d else (f"{_badge('pass')} ×{d['reruns']}" if d["ok"] else _badge("fail"))
        bic = "" if not bi else (_badge("pass") if bi.get("ok") else _badge("fail") if bi.get("ok") is False
                                 else _e(bi.get("status", "")))
        perf = (f"{p['gbps']:.1f} GB/s, {p['tflops']:.3f} TFLOP/s" if p.get("status") in ("measured", "regression")
                else _e(p.get("status", "")))
        out.append(f"<tr><td>{_e(r['op'])}</td><td class='m'>{_e(r['shape'])}</td><td>{_e(r['dtype'])}</td>"
                   f"<td>{_e(r['level'])}</td><td>{_badge(r['status'])}</td><td>{_fmt(n.get('max_abs'))}</td>"
                   f"<td>{_fmt(n.get('max_rel'))}</td><td>{_fmt(n.get('cosine'), '.8f')}</td><td>{det}</td>"
                   f"<td>{bic}</td><td>{perf}</td><td class='m'>{_e(r.get('message', ''))}</td></tr>")
    return "".join(out) + "</table>"


def _hist_svg(op: str, hist: list[int], w: int = 300, h: int = 140) -> str:
    top = max(hist) or 1
    bw = (w - 20) / len(hist)
    bars = []
    for i, c in enumerate(hist):
        bh = 0 if c == 0 else max(1.0, (h - 40) * math.log10(1 + c) / math.log10(1 + top))
        x = 10 + i * bw
        bars.append(f"<rect x='{x:.1f}' y='{h - 25 - bh:.1f}' width='{bw - 2:.1f}' height='{bh:.1f}' "
                    f"fill='{'#1a7f37' if i == 0 else '#0969da'}'><title>{_e(HIST_LABELS[i])}: {c}</title></rect>")
        if i % 2 == 0:
            bars.append(f"<text x='{x:.1f}' y='{h - 10}' font-size='8'>{_e(HIST_LABELS[i])}</text>")
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' style='border:1px solid #d0d7de'>"
            f"<text x='10' y='14' font-size='12' font-weight='bold'>{_e(op)}</text>"
            f"<text x='{w - 10}' y='14' font-size='9' text-anchor='end'>log-scaled counts</text>{''.join(bars)}</svg>")


def _roofline_svg(report: dict, w: int = 640, h: int = 360) -> str:
    b = report["backend"]
    pts = [r for r in report["rows"] if r.get("perf", {}).get("status") in ("measured", "regression")]
    bw = b.get("peak_bandwidth") or 0.0
    peaks = {k: v for k, v in (b.get("peak_flops") or {}).items() if v}
    if not pts and not (bw and peaks):
        reasons = sorted({r.get("perf", {}).get("message", "") for r in report["rows"]} - {""})
        return ("<p>No roofline: nothing was measured. " + _e(" / ".join(reasons[:3])) + "</p>")
    xs = [p["perf"]["intensity"] for p in pts if p["perf"]["intensity"] > 0] + [0.1, 1000.0]
    ys = [p["perf"]["flops"] / p["perf"]["seconds"] for p in pts if p["perf"]["flops"]] + list(peaks.values())
    ys = ys or [1e9, 1e12]
    x0, x1 = math.log10(min(xs)) - 0.5, math.log10(max(xs)) + 0.5
    y0, y1 = math.log10(min(ys)) - 1.5, math.log10(max(ys)) + 0.5

    def px(x):
        return 50 + (math.log10(x) - x0) / (x1 - x0) * (w - 70)

    def py(y):
        return h - 40 - (math.log10(max(y, 1e-30)) - y0) / (y1 - y0) * (h - 60)

    g = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' style='border:1px solid #d0d7de'>",
         f"<text x='{w / 2}' y='{h - 8}' text-anchor='middle' font-size='11'>arithmetic intensity (FLOP/byte)</text>",
         f"<text x='12' y='{h / 2}' font-size='11' transform='rotate(-90 12 {h / 2})' text-anchor='middle'>FLOP/s</text>"]
    for dtype, peak in peaks.items():
        knee = peak / bw if bw else None
        lo = 10 ** x0
        if knee:
            g.append(f"<polyline fill='none' stroke='#57606a' points='{px(lo):.1f},{py(lo * bw):.1f} "
                     f"{px(knee):.1f},{py(peak):.1f} {px(10 ** x1):.1f},{py(peak):.1f}'/>")
        g.append(f"<text x='{w - 20}' y='{py(peak) - 3:.1f}' font-size='9' text-anchor='end'>{_e(dtype)} peak</text>")
    for p in pts:
        perf = p["perf"]
        if perf["intensity"] > 0 and perf["flops"]:
            color = STATUS_COLOR.get(p["status"], "#0969da")
            g.append(f"<circle cx='{px(perf['intensity']):.1f}' cy='{py(perf['flops'] / perf['seconds']):.1f}' r='3' "
                     f"fill='{color}'><title>{_e(p['key'])}: {perf['tflops']:.3f} TFLOP/s</title></circle>")
    g.append("</svg>")
    return "".join(g)
