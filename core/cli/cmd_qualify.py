"""``inferhal qualify backend=X qualify=quick|full``: qualify a backend's ops against the reference.

Writes ``report.json``, ``report.html`` (and ``perf-baseline.json`` when anything was timed) under
``qualify.output_dir/<backend>[-interpret]-<level>/``; under ``-m`` each job adds its other overrides to
that name, so sweeps never share a directory. A killed run resumes from the directory's journal.
Exit status: 0 pass, 1 a claimed op failed, 2 bad config or the backend is unavailable, 3 nothing
failed but some claimed op was not run here (see :mod:`inferhal.core.qualify.runner`).
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from inferhal.core.config.schema import BackendConfig
from inferhal.core.errors import UserError

_DIR_KEYS = {"backend", "backend.name", "backend.interpret", "qualify", "qualify.level", "command"}


def report_dir(cfg) -> Path:
    b, q = cfg.backend, cfg.qualify
    leaf = f"{b.name}{'-interpret' if b.interpret else ''}-{q.level}"
    suffix = _sweep_suffix()
    return Path(str(q.output_dir)) / (f"{leaf}__{suffix}" if suffix else leaf)


def _sweep_suffix() -> str:
    """Under a Hydra multirun: this job's overrides other than backend and level, as a directory name."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except Exception:  # not inside a Hydra job: a plain run
        return ""
    if hc.mode != RunMode.MULTIRUN:
        return ""
    swept = _swept_keys()
    keep = [o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") in swept - _DIR_KEYS]
    return re.sub(r"[^A-Za-z0-9_.=,-]+", "_", ",".join(sorted(keep)))[:120]


def _swept_keys() -> set[str]:
    """Keys the multirun command line sweeps (``a=1,2``); constant overrides do not name directories."""
    import sys

    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in sys.argv[1:] if not a.startswith("-") and "=" in a]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except Exception:
        return set()
    return {o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()}


def run(cfg, words, registry=None) -> int:
    """``registry``: a prebuilt :class:`~inferhal.core.registry.BackendRegistry` (tests register extra
    backends in-process); default: every installed backend."""
    from inferhal.core.qualify import recorded
    from inferhal.core.qualify import report as report_mod
    from inferhal.core.qualify import runner
    from inferhal.core.registry import BackendRegistry, BackendSelectionError

    if words:
        raise UserError(f"inferhal qualify takes no subcommand, got {' '.join(words)!r}")
    q = cfg.qualify
    if q.level not in ("quick", "full"):
        raise UserError(f"qualify.level must be quick or full, got {q.level!r}")
    bcfg = BackendConfig(**OmegaConf.to_container(cfg.backend, resolve=True))
    out_dir = report_dir(cfg)
    recorded_data = recorded.load(str(q.recorded), bcfg.name) if q.recorded else None  # a bad file fails first
    reg = registry if registry is not None else BackendRegistry.discover()
    try:
        # select first: a kernel backend prepares its process (e.g. an interpreter switch) before its ops load
        active = reg.select(bcfg)
        reference = active if active.name == "reference" else reg.select(BackendConfig(name="reference"))
    except BackendSelectionError as exc:
        rep = unavailable_report(reg, bcfg, str(exc), q.level)
        from inferhal.core.qualify.manifest import manifest

        rep["manifest"] = manifest(bcfg.name, {}, cfg, _toolchain(reg, bcfg.name))
        if recorded_data is None:
            paths = report_mod.write(rep, out_dir)
            raise UserError(f"{exc}\nnothing was qualified; report: {paths['html']}") from None
        recorded.merge(rep, recorded_data, str(q.recorded))  # nothing runs here: the report is the recording
        paths = report_mod.write(rep, out_dir)
        print_summary(rep, paths)
        return int(rep["summary"]["exit_status"])
    opts = runner.QualifyOptions(
        level=q.level, reruns=int(q.reruns), seed=int(q.seed), ops=tuple(q.ops), output_dir=str(out_dir),
        baseline=q.baseline, regression_threshold=float(q.regression_threshold), resume=bool(q.resume),
        progress=bool(q.progress), repeats=int(q.perf_repeats))
    from inferhal.core.qualify import audits, golden
    from inferhal.core.qualify.manifest import manifest

    def extra() -> dict:
        out = {"manifest": manifest(bcfg.name, reg.probe(bcfg.name, bcfg).details, cfg, _toolchain(reg, bcfg.name))}
        if q.golden:
            out["golden"] = golden.run(cfg, active)
        out["audits"] = (audits.run(active, q.level) if q.audits else
                         audits.not_run("qualify.audits=false: the audits were not run", "not run"))
        return out

    rep = runner.run(active, reference, opts, extra_sections=extra)
    if recorded_data is not None:
        recorded.merge(rep, recorded_data, str(q.recorded))
    paths = report_mod.write(rep, out_dir)
    print_summary(rep, paths)
    return int(rep["summary"]["exit_status"])


def _toolchain(reg, name: str):
    """The backend's ``environment`` extra (no device touched), or None; a failing extra is reported, not fatal."""
    try:
        return reg.extra(name, "environment")
    except Exception as exc:  # a broken extra must not cost the report
        return {"(error)": f"the 'environment' extra raised {type(exc).__name__}: {exc}"}


def audits_not_run(reason: str) -> dict:
    from inferhal.core.qualify.audits import not_run

    return not_run(f"the backend is unavailable here: {reason}", "absent")


def unavailable_report(reg, bcfg: BackendConfig, reason: str, level: str) -> dict:
    """A report for a backend that cannot run here: its declared ops, each at its declared level, none run."""
    from inferhal.core.qualify.runner import EXIT_INCOMPLETE

    cov = reg.coverage().get(bcfg.name, {})
    ops = {op: {"level": lvl, "claimed": lvl not in ("fallback", "absent"), "status": "not-run" if lvl not in
                ("fallback", "absent") else lvl, "cases": 0, "failed": 0} for op, lvl in cov.items()}
    return {"schema": 1, "created": "", "options": {"level": level},
            "backend": {"name": bcfg.name, "device_name": "(unavailable)", "exec_level": "absent", "peak_flops": {},
                        "peak_bandwidth": 0.0},
            "rows": [], "ops": ops, "audits": audits_not_run(reason),
            "summary": {"verdict": "unavailable", "exit_status": EXIT_INCOMPLETE, "failed_ops": [], "case_counts": {},
                        "not_qualified_ops": [op for op, o in ops.items() if o["claimed"]], "levels": [],
                        "notes": [reason]}}


def print_summary(rep: dict, paths: dict) -> None:
    from inferhal.core.console import console as make_console
    from rich.markup import escape
    from rich.table import Table

    con = make_console()
    colors = {"pass": "green", "fail": "red", "not-run": "yellow", "no-case": "yellow", "skipped": "dim"}
    t = Table(title=f"inferhal qualify: {rep['backend']['name']} ({rep['options']['level']})")
    for col in ("op", "level", "status", "cases", "failed"):
        t.add_column(col)
    for op, o in rep["ops"].items():
        if not o["claimed"]:
            continue
        c = colors.get(o["status"], "")
        t.add_row(op, o["level"], f"[{c}]{escape(o['status'])}[/]" if c else escape(o["status"]), str(o["cases"]),
                  str(o["failed"]))
    con.print(t)
    fallbacks = [op for op, o in rep["ops"].items() if o["status"].startswith("fallback")]
    if fallbacks:
        con.print(f"not claimed (the reference stands in, not qualified): {', '.join(fallbacks)}")
    for r in rep["rows"]:
        if r["status"] == "fail":
            con.print(f"[red]FAIL[/] {escape(r['message'])}")
    for g in rep.get("golden", []):
        con.print(f"golden {escape(g['name'])}: {escape(g['status'])} {escape(g.get('message', ''))}")
    for a in rep.get("audits", {}).get("checks", []):
        con.print(f"audit {a['name']} ({escape(a['title'])}) at level {escape(a['level'])}: {escape(a['status'])} "
                  f"{escape(a.get('message', ''))}", soft_wrap=True)
    s = rep["summary"]
    from inferhal.core.qualify.recorded import summary_lines

    for line in summary_lines(rep):
        con.print(escape(line), soft_wrap=True)
    for note in s["notes"]:
        con.print(f"note: {escape(note)}")
    con.print(f"verdict: [bold]{s['verdict']}[/] (exit status {s['exit_status']}); levels run: "
              f"{', '.join(s['levels']) or 'none'}; resumed cases: {rep.get('resumed_cases', 0)}")
    con.print(f"report: {paths['html']}  data: {paths['json']}")
