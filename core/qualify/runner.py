"""The qualification run: every case of every op the backend claims, journalled, into one report dict.

``run(active, reference, options)`` needs the selected backend and the reference backend (the
oracle; the same object when qualifying the reference itself). It returns the report as plain data;
:mod:`.report` writes it as JSON and HTML. Exit status: 0 when every claimed op passed every check,
1 when anything claimed failed, 3 when nothing failed but something claimed was not run here
(compiled only, wired to a device operator, without a conformance case, or computed by the reference).

A native op may still hand a call to the reference (an operator's documented limits, a missing library):
an op implementation that keeps a ``fallback_log`` (a list to which it appends ``(op_id, reason)`` for every
such call; see ``inferhal_provide_ops``) gets each case whose call fell back reported at level ``fallback``,
status ``not-run``, with the reasons, never under the op's own level.
"""

from __future__ import annotations

import datetime as _dt
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from inferhal.core.ops.table import FallbackLog
from inferhal.core.ops.vocabulary import OPS
from inferhal.core.profile import ExecLevel
from inferhal.core.qualify import checks
from inferhal.core.qualify.cases import op_cases
from inferhal.core.qualify.cases.base import CaseEnv
from inferhal.core.qualify.journal import Journal

RUNNABLE = (ExecLevel.DEVICE, ExecLevel.INTERPRETER)
EXIT_PASS, EXIT_FAIL, EXIT_INCOMPLETE = 0, 1, 3


#: determinism reruns per case unless ``--inferhal-reruns`` says otherwise (a backend in a kernel interpreter: 1)
DEFAULT_RERUNS = 2


def reruns_for(backend, asked: int | None = None) -> int:
    """The determinism reruns of ``backend``'s cases: ``asked`` (``--inferhal-reruns``) when given, else
    :data:`DEFAULT_RERUNS`, or 1 where the backend runs in a kernel interpreter (its programs run serially on the
    CPU, so a second rerun repeats the first; the interleaved call on other inputs, which shows state carried
    between calls, still runs)."""
    if asked is not None:
        return asked
    return 1 if backend.profile.exec_level == ExecLevel.INTERPRETER else DEFAULT_RERUNS


@dataclass(frozen=True)
class QualifyOptions:
    level: str = "quick"
    reruns: int = 3
    seed: int = 0
    ops: tuple[str, ...] = ()  # empty = every op the backend claims
    output_dir: str = "qualify-report"
    baseline: str | None = None
    regression_threshold: float = 0.1
    resume: bool = True
    progress: bool = True
    warmup: int = 2
    repeats: int = 10
    extra_fingerprint: dict = field(default_factory=dict)


def claimed_ops(active) -> dict[str, ExecLevel]:
    """op ID → execution level of every op the backend implements natively (not a reference fallback)."""
    out = {}
    for op_id, level in active.ops.provenance().items():
        if level not in (ExecLevel.FALLBACK.value, "absent"):
            out[op_id] = ExecLevel(level)
    return out


def load_baseline(path: str | None) -> dict[str, float]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        from inferhal.core.errors import UserError

        raise UserError(f"qualify.baseline={path!r} cannot be read as JSON: {exc}") from None
    return {k: float(v["seconds"] if isinstance(v, dict) else v) for k, v in data.get("cases", data).items()}


def _measure_reason(active, level: ExecLevel, dtype: str) -> str:
    if level != ExecLevel.DEVICE:
        return f"not measured: a {level.value} run is not a hardware result"
    prof = active.profile
    if not prof.peak_bandwidth and not prof.peak_flops.get(dtype):
        return f"not measured: the device profile declares no peak bandwidth or FLOP/s for {dtype}"
    return ""


def op_invariant(active, op_id: str) -> bool:
    """Whether ``op_id`` of ``active`` is batch invariant as selected, so qualify checks it bitwise: its own
    declaration (``inferhal_op_batch_invariance``: always, or in the batch-invariant mode when that is on), or,
    for a backend without per-op declarations, its profile's ``batch_invariant`` feature."""
    ask = getattr(active, "batch_invariance", None)  # an ActiveBackend-like object without it declares nothing
    declared = ask() if ask is not None else None
    mode_on = active.profile.supports("batch_invariant")
    if declared is None:
        return mode_on
    from inferhal.core.ops.invariance import UNDECLARED

    return declared.get(op_id, UNDECLARED).holds(mode_on)


def _row_base(case, level: ExecLevel) -> dict:
    return {"key": case.key, "op": case.op_id, "shape": case.label, "dtype": case.dtype, "level": level.value,
            "tolerance": case.tol.to_dict(), "notes": case.notes}


def fallback_log(fn: Any) -> list | None:
    """The per-call fallback log an op implementation keeps, if any (``fallback_log``: a list of
    ``(op_id, reason)``, one entry appended per call the reference computed instead)."""
    log = getattr(fn, "fallback_log", None)
    return log if isinstance(log, list) else None


def _mark(log: list | None) -> int:
    """Where ``log`` stands now: a :class:`~inferhal.core.ops.table.FallbackLog`'s mark, a plain list's length."""
    return 0 if log is None else log.mark() if isinstance(log, FallbackLog) else len(log)


def _fell_back(log: list | None, start: int, op_id: str) -> list[str]:
    """The distinct reasons ``op_id`` fell back since ``start`` (:func:`_mark`) of ``log``, in order."""
    if log is None:
        return []
    new = log.since(start) if isinstance(log, FallbackLog) else log[start:]
    return list(dict.fromkeys(reason for op, reason in new if op == op_id))


def run_case(case, active, reference, level: ExecLevel, opts: QualifyOptions, baseline: dict,
             measure: str | None = None) -> dict:
    """All checks of one case → its report row. ``measure`` overrides why performance is not measured.
    A case whose first call the op handed to the reference is reported at level ``fallback`` (not run); a
    later call of the checks that fell back is listed in the row's ``fallbacks``."""
    row = _row_base(case, level)
    if level not in RUNNABLE:
        row.update(status="not-run", message=f"{level.value}: never executed here, so not qualified")
        return row
    if not active.profile.supports_dtype(case.dtype):
        row.update(status="skipped", message=f"the device profile does not list dtype {case.dtype}")
        return row
    prof = active.profile
    ctx = checks.CaseContext(
        fn=active.ops.entry(case.op_id).fn, ref_fn=reference.ops.entry(case.op_id).fn,
        torch_device=prof.torch_device, seed=opts.seed, reruns=opts.reruns,
        batch_invariant=op_invariant(active, case.op_id), peak_bandwidth=prof.peak_bandwidth,
        peak_flops=float(prof.peak_flops.get(case.dtype, 0.0)), measure=measure if measure is not None else _measure_reason(active, level, case.dtype),
        synchronize=getattr(active.device, "synchronize", lambda: None), warmup=opts.warmup, repeats=opts.repeats,
        env=CaseEnv(active), ref_env=CaseEnv(reference))
    stage = "run"
    log = fallback_log(ctx.fn)
    start = _mark(log)
    try:
        first = checks.call(case, ctx.fn, ctx.seed, ctx.torch_device, ctx.env)
        fell = _fell_back(log, start, case.op_id)
        if fell:
            row.update(level=ExecLevel.FALLBACK.value, status="not-run", fallbacks=fell,
                       message=f"{case.op_id} [{case.label}, {case.dtype}] fell back: the reference computed this "
                               f"call, not the backend's {level.value} op ({'; '.join(fell)}), so not qualified")
            return row
        stage = "numerics"
        row["numerics"] = checks.numerics(case, ctx, first)
        stage = "determinism"
        row["determinism"] = checks.determinism(case, ctx, first)
        stage = "batch invariance"
        row["batch_invariance"] = checks.batch_invariance(case, ctx, first)
        stage = "performance"
        row["perf"] = checks.performance(case, ctx, baseline, opts.regression_threshold)
    except Exception as exc:  # OpError from the op, or a bug in a case: either way a readable failure
        msg = str(exc) if isinstance(exc, checks.OpError) else checks.describe_exception(exc)
        row.update(status="fail", message=f"{case.op_id} [{case.label}, {case.dtype}] raised during {stage}: {msg}")
        return row
    failed = [name for name in ("numerics", "determinism", "batch_invariance", "perf") if row[name].get("ok") is False]
    row["status"] = "fail" if failed else "pass"
    where = f"{case.op_id} [{case.label}, {case.dtype}]"
    row["message"] = "; ".join(f"{where} {n.replace('_', ' ')}: {row[n]['message']}" for n in failed)
    later = _fell_back(log, start, case.op_id)
    if later:  # e.g. a batch-invariance sub-batch outside the operator's limits: that comparison saw the reference
        row["fallbacks"] = later
    return row


def fingerprint(active, opts: QualifyOptions) -> dict:
    cfg = active.config
    return {"backend": active.name, "interpret": bool(cfg.interpret), "strict": bool(cfg.strict),
            "batch_invariant": bool(cfg.batch_invariant), "features": sorted(active.profile.features),
            "level": opts.level, "seed": opts.seed, "reruns": opts.reruns, "ops": list(opts.ops),
            "provenance": active.ops.provenance(), **opts.extra_fingerprint}


def run(active, reference, opts: QualifyOptions, extra_sections: Callable[[], dict] | None = None) -> dict:
    """Qualify ``active``; returns the report dict (rows, per-op summary, verdict, exit status)."""
    out_dir = Path(opts.output_dir)
    claimed = claimed_ops(active)
    unknown = [op for op in opts.ops if op not in OPS]
    if unknown:
        from inferhal.core.errors import UserError

        raise UserError(f"qualify.ops names unknown op(s) {unknown}; known: {', '.join(OPS)}")
    selected = [op for op in OPS if op in claimed and (not opts.ops or op in opts.ops)]
    baseline = load_baseline(opts.baseline)
    journal = Journal(out_dir / "journal.jsonl", fingerprint(active, opts), resume=opts.resume)
    todo = [c for op in selected for c in op_cases(op, opts.level)]
    order = list(todo)
    random.Random(opts.seed).shuffle(order)  # random case order: state leaking between ops shows up
    pending = [c for c in order if c.key not in journal.done]
    resumed = len(todo) - len(pending)
    with _progress(opts.progress, len(pending), resumed) as advance:
        for case in pending:
            advance(case.key)
            journal.record(run_case(case, active, reference, claimed[case.op_id], opts, baseline))
        advance(None)
    rows = [journal.done[c.key] for c in todo]
    report = {
        "schema": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "backend": _backend_info(active),
        "options": {k: v for k, v in asdict(opts).items() if k not in ("progress", "extra_fingerprint")},
        "resumed_cases": resumed,
        "rows": rows,
        "ops": _op_summary(active, claimed, selected, rows, opts),
    }
    if extra_sections is not None:
        report.update(extra_sections())
    report["summary"] = summarize(report)
    if active.name == reference.name:
        report["summary"]["notes"].append(
            "the reference qualifies against itself: numerics are trivially exact; determinism and batch "
            "invariance are real checks")
    return report


def _backend_info(active) -> dict:
    p = active.profile
    return {"name": active.name, "device_name": p.device_name, "torch_device": p.torch_device,
            "exec_level": p.exec_level.value, "features": sorted(p.features), "dtypes": sorted(p.dtypes),
            "peak_bandwidth": p.peak_bandwidth, "peak_flops": dict(p.peak_flops), "sources": dict(p.sources),
            "config": {"interpret": active.config.interpret, "strict": active.config.strict},
            "provenance": active.ops.provenance()}


def _op_summary(active, claimed, selected, rows, opts) -> dict:
    out = {}
    for op_id, level in active.ops.provenance().items():
        mine = [r for r in rows if r["op"] == op_id]
        if op_id not in claimed:
            status = "fallback (not claimed)" if level == ExecLevel.FALLBACK.value else "absent"
        elif op_id not in selected:
            status = "not selected"
        elif not mine:
            status = "no-case"
        elif any(r["status"] == "fail" for r in mine):
            status = "fail"
        elif any(r["status"] == "not-run" for r in mine):
            status = "not-run"
        elif all(r["status"] == "skipped" for r in mine):
            status = "skipped"
        else:
            status = "pass"
        out[op_id] = {"level": level, "claimed": op_id in claimed, "status": status, "cases": len(mine),
                      "failed": sum(r["status"] == "fail" for r in mine)}
        fell = sum(r["level"] == ExecLevel.FALLBACK.value for r in mine)
        if fell:
            out[op_id]["fallback"] = fell
    return out


def summarize(report: dict) -> dict:
    ops = report["ops"]
    counts: dict[str, int] = {}
    for r in report["rows"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    golden = report.get("golden", [])
    failed_ops = [op for op, s in ops.items() if s["status"] == "fail"]
    failed_golden = [g["name"] for g in golden if g.get("status") == "fail"]
    failed_audits = [a["name"] for a in report.get("audits", {}).get("checks", []) if a.get("status") == "fail"]
    incomplete = [op for op, s in ops.items() if s["status"] in ("no-case", "not-run")]
    if failed_ops or failed_golden or failed_audits:
        verdict, rc = "fail", EXIT_FAIL
    elif incomplete:
        verdict, rc = "incomplete", EXIT_INCOMPLETE
    else:
        verdict, rc = "pass", EXIT_PASS
    fell = {op: s["fallback"] for op, s in ops.items() if s.get("fallback")}
    notes = [f"{sum(fell.values())} cases fell back per call to the reference (level fallback, not run: "
             f"{', '.join(f'{op} {n}' for op, n in fell.items())}); backend.strict=true makes them fail instead"
             ] if fell else []
    return {"verdict": verdict, "exit_status": rc, "case_counts": counts, "failed_ops": failed_ops,
            "failed_golden": failed_golden, "failed_audits": failed_audits, "not_qualified_ops": incomplete,
            "levels": sorted({r["level"] for r in report["rows"]}), "notes": notes}


class _progress:
    """Progress on stderr (a no-op when disabled): a bar on a terminal, plain lines in a log;
    ``advance(key)`` starts the next case (``None`` after the last)."""

    def __init__(self, enabled: bool, total: int, resumed: int) -> None:
        from inferhal.core.console import Progress

        label = f"qualify (resumed: {resumed} done before)" if resumed else "qualify"
        self._p = Progress(label, total, enabled=enabled and total > 0)
        self._started = False

    def __enter__(self):
        self._p.__enter__()

        def advance(key: Any) -> None:
            self._p.advance(str(key) if key is not None else "", n=1 if self._started else 0)
            self._started = key is not None

        return advance

    def __exit__(self, *exc) -> None:
        self._p.__exit__(*exc)
