"""``python -m inferhal.core.qualify.device_run.cli --backend NAME``: the run's order, its workers and its budget.

Numerics first, in parallel worker processes (the conformance cases split over ``--workers`` processes, the
V4 shapes, the e2e models, the kernels' compile resources); then each timing section alone on the device, in
its own process (a device error in one cannot take the others' context with it), in the order of
:data:`TIMING`, each with what is left of ``--budget-s``. A worker still running past its share is stopped
(its rows are already on disk) and a ``timeout`` row says so. Exit 0 when nothing failed, 1 when something
did, 2 without a device (the report then says ``absent`` and why).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from inferhal.core.qualify.device_run import record
from inferhal.core.qualify.device_run.common import Context, error_text, log

NUMERICS = ("kernels", "v4_shapes", "e2e", "gemma", "resources")
TIMING = ("perf", "graphs", "speed", "layer", "serve", "peer")
#: the most seconds a timing section may take (it also stops at the run's deadline)
CAPS = {"perf": 90, "graphs": 40, "speed": 90, "layer": 60, "serve": 90, "peer": 45}
#: share of the budget the numerics phase may take
NUMERICS_SHARE = 0.35
GRACE = 20.0
#: how much longer every section may take in an interpreter than on a device
INTERPRETER_SLOWDOWN = 4


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m inferhal.core.qualify.device_run.cli", description=__doc__.split("\n")[0])
    ap.add_argument("--backend", help="the backend under test (an installed inferhal backend's name)")
    ap.add_argument("--out", default="device_run.json", help="the report (rows stream to <out>.rows.jsonl)")
    ap.add_argument("--interpret", action="store_true", help="dry run in the backend's interpreter (not a hardware result)")
    ap.add_argument("--sections", default=",".join(NUMERICS + TIMING))
    ap.add_argument("--ops", default="", help="comma-separated op IDs for the kernels section (default: every op claimed)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--level", default="quick", choices=("quick", "full"))
    ap.add_argument("--reruns", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock seconds for the whole run (default 390; 4 x that with --interpret)")
    ap.add_argument("--scale", default="", choices=("", "full", "reduced"),
                    help="sizes (default: full on a device, reduced in an interpreter)")
    ap.add_argument("--gemma", default=os.environ.get("INFERHAL_GEMMA_GGUF"), help="a Gemma 3 270M GGUF on this machine")
    ap.add_argument("--collect", action="store_true", help="rebuild --out from its rows file (after a kill) and stop")
    ap.add_argument("--digest", action="store_true", help="print the source digest of this tree and stop")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rows", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    slow = INTERPRETER_SLOWDOWN if args.interpret else 1
    args.budget_s = args.budget_s or 390.0 * slow
    args.caps = {k: v * slow for k, v in CAPS.items()}
    if args.digest:
        print(record.source_digest())
        return 0
    if args.collect:
        report = record.collect(args.out)
        print_table(report)
        return 0 if report["summary"]["ok"] else 1
    if not args.backend:
        print("device_run: --backend NAME is required", file=sys.stderr)
        return 2
    secs = [s for s in args.sections.split(",") if s]
    unknown = [s for s in secs if s not in NUMERICS + TIMING]
    if unknown:
        print(f"device_run: unknown section(s) {unknown}; known: {', '.join(NUMERICS + TIMING)}", file=sys.stderr)
        return 2
    if args.worker:
        return worker(args)
    return run(args, secs)


def worker(args) -> int:
    """One section's rows, appended to ``--rows`` as each is measured."""
    rec = record.Recorder(args.rows)
    ctx = Context(args.backend, args.interpret, args.deadline, args.gemma, args.scale)
    emit = rec.add
    try:
        if args.worker == "resources":
            resource_rows(ctx, emit)
        elif args.worker == "kernels":
            from inferhal.core.qualify.device_run.numerics import kernel_rows

            kernel_rows(ctx, [o for o in args.ops.split(",") if o], args.level, args.reruns, emit)
        else:
            from inferhal.core.qualify.device_run import layer, numerics, shapes, speed, timing

            table = {"v4_shapes": shapes.v4_rows, "e2e": numerics.e2e_rows, "gemma": numerics.gemma_rows,
                     "perf": timing.perf_rows, "graphs": speed.graph_rows, "speed": speed.speed_rows,
                     "layer": layer.layer_rows, "peer": speed.peer_rows,
                     "serve": lambda c, e: speed.serve_rows(c, e, str(Path(args.rows).parent))}
            table[args.worker](ctx, emit)
    except Exception as exc:  # a section that cannot start is a row, never a lost run
        emit({"section": args.worker, "name": f"{args.worker} (section)", "status": "fail", "message": error_text(exc, 1200)})
        return 1
    return 0


def resource_rows(ctx: Context, emit) -> None:
    """Registers, spill stack, local and shared memory of every kernel, from the backend's ``aot_compiler`` extra
    run for this device's target (a compile, not a run: level ``compiled``)."""
    from inferhal.core.registry import BackendRegistry

    aot = BackendRegistry.discover().extra(ctx.backend, "aot_compiler")
    if aot is None:
        emit({"section": "resources", "status": "not-run", "message": f"{ctx.backend} offers no aot_compiler extra"})
        return
    target = "" if ctx.interpret else str(ctx.active.profile.extra.get("arch", ""))  # never select in an interpreter
    on = "interpreter dry run" if ctx.interpret else ctx.label
    if target not in aot.targets:
        target = aot.targets[0]
    for r in aot.compile(target):
        emit(dict(r, section="resources", execution_level="compiled", target=target, compiled_on=on,
                  spills=bool(r.get("spill_stack_bytes") or r.get("local_bytes")),
                  status="compiled" if r.get("compiled") else "fail"))


def _spawn(section: str, args, rows: Path, deadline: float, ops: list[str] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "inferhal.core.qualify.device_run.cli", "--worker", section, "--backend", args.backend,
           "--rows", str(rows), "--deadline", repr(deadline), "--level", args.level, "--reruns", str(args.reruns)]
    if ops:
        cmd += ["--ops", ",".join(ops)]
    if args.interpret:
        cmd.append("--interpret")
    if args.gemma:
        cmd += ["--gemma", args.gemma]
    if args.scale:
        cmd += ["--scale", args.scale]
    return subprocess.Popen(cmd)


def run_workers(jobs, args, rec: record.Recorder, deadline: float) -> None:
    """Each job (section, ops) in its own process, all at once; one still running at ``deadline`` + grace is
    stopped and gets a ``timeout`` row (what it wrote stays)."""
    procs = [(sec, ops, time.time(), _spawn(sec, args, rec.rows_path, deadline, ops)) for sec, ops in jobs]
    for sec, ops, t0, p in procs:
        try:
            rc = p.wait(timeout=max(1.0, deadline + GRACE - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rec.add({"section": sec, "name": f"{sec} {','.join(ops)}".strip(), "status": "timeout",
                     "message": f"stopped after {time.time() - t0:.0f} s (the run's budget); its rows above are kept"})
            continue
        rec.add({"section": "run", "worker": sec, "ops": list(ops), "exit": rc, "seconds": round(time.time() - t0, 1)})


def env_row(ctx: Context) -> dict:
    """Versions and the device: torch, the backend's toolchain (``environment`` extra), what the device
    object describes of itself (``describe()``, optional), its profile, and the optional packages' versions."""
    import torch

    from inferhal.core.qualify.manifest import manifest, package_version

    active, prof = ctx.active, ctx.active.profile
    try:
        toolchain = active.extra("environment")
    except KeyError:
        toolchain = None
    man = manifest(ctx.backend, {}, None, toolchain)
    describe = getattr(active.device, "describe", None)
    return {"section": "env", "torch": torch.__version__, "device": prof.device_name, "execution_level": ctx.label,
            "toolchain": man["toolchain"], "backend_version": man["backend"], "host": man["host"]["cpu"]["model"],
            "describe": describe() if describe else "", "compute_units": prof.compute_units,
            "memory_bytes": prof.memory_bytes, "peak_bandwidth": prof.peak_bandwidth, "peak_flops": dict(prof.peak_flops),
            "profile_extra": {k: str(v) for k, v in prof.extra.items()},
            "packages": {p: package_version(p) for p in ("transformers", "fastapi", "uvicorn", "gguf",
                                                         "hydra-core", "xgrammar")}}


def run(args, secs: list[str]) -> int:
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.qualify.runner import claimed_ops
    from inferhal.core.registry import BackendRegistry

    t0 = time.time()
    end = t0 + args.budget_s
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rec = record.Recorder(record.rows_path(out))
    rec.rows_path.unlink(missing_ok=True)
    probe = BackendRegistry.discover().probe(args.backend, BackendConfig(name=args.backend, interpret=args.interpret))
    head = record.header(args.backend, probe)
    rec.add({"section": "head", **head})
    if not probe.available:
        head["execution_level"] = "absent"
        record.save(out, head, rec)
        print(f"device_run: no device to check: {probe.reason}", file=sys.stderr)
        return 2
    ctx = Context(args.backend, args.interpret, end, args.gemma, args.scale)
    head["execution_level"] = ctx.label
    rec.add(env_row(ctx))
    record.save(out, head, rec)
    jobs = []
    if "kernels" in secs:
        from inferhal.core.qualify.device_run.numerics import split_ops

        ops = [o for o in args.ops.split(",") if o] or list(claimed_ops(ctx.active))
        jobs += [("kernels", g) for g in split_ops(ops, args.workers)]
    jobs += [(s, []) for s in NUMERICS[1:] if s in secs]
    if jobs:
        log(f"numerics: {len(jobs)} worker(s): {jobs}")
        run_workers(jobs, args, rec, t0 + args.budget_s * NUMERICS_SHARE)
        record.save(out, head, rec)
    for sec in (s for s in TIMING if s in secs):
        if time.time() > end - 5:
            rec.add({"section": sec, "name": sec, "status": "not-run", "message": "no time left in the run's budget"})
            continue
        log(f"timing: {sec}")
        run_workers([(sec, [])], args, rec, min(end, time.time() + args.caps[sec]))
        record.save(out, head, rec)
    report = record.save(out, head, rec)
    print_table(report)
    print(f"device_run: {time.time() - t0:.0f} s, {'all passed' if report['summary']['ok'] else 'FAILED: ' + '; '.join(report['summary']['failed'])}; "
          f"report {out} and {record.markdown_path(out)}", flush=True)
    return 0 if report["summary"]["ok"] else 1


def print_table(report: dict) -> None:
    """A short plain summary last (the end of the output is what a lent machine's call returns)."""
    lines = [f"execution level: {report.get('execution_level')}; commit {report.get('commit')}"]
    by_op: dict[str, list[int]] = {}
    for row in report.get("kernels", []):
        c = by_op.setdefault(row.get("op", "?"), [0, 0])
        c[0] += row.get("status") == "pass"
        c[1] += 1
    lines += [f"  kernels {op:<18} {p}/{n} pass" for op, (p, n) in sorted(by_op.items())]
    for row in report.get("v4_shapes", []):
        lines.append(f"  v4      {str(row.get('shape'))[:56]:<56} {row.get('variant', '')[:10]:<10} {row['status']} "
                     f"err={row.get('max_abs_err', '-')}")
    for row in report.get("e2e", []) + report.get("gemma", []):
        lines.append(f"  e2e     {row.get('model')} {row.get('dtype')}: {row['status']} {row.get('matched', row.get('message', ''))[:80]}")
    res = report.get("resources", [])
    if res:
        spill = [r.get("kernel") for r in res if r.get("spills")]
        lines.append(f"  compile {len(res)} kernels for {res[0].get('target')}; spilling: {', '.join(map(str, spill)) or 'none'}")
    for row in report.get("graphs", []):
        lines.append(f"  graphs  {row.get('name')}: {row['status']} eager {row.get('eager_ms', '-')} ms graph "
                     f"{row.get('graph_ms', '-')} ms; {str(row.get('first_host_sync', row.get('graphs_disabled', '')))[:120]}")
    for row in report.get("perf", []):
        if "ms" in row:
            of = row.get("of_ceiling")
            lines.append(f"  perf    {row['name'][:64]:<64} {row.get('variant', ''):<8} {row['ms']:.4f} ms {row['GBps']:.0f} GB/s "
                         f"{row['TFLOPps']:.1f} TF/s" + (f" {of:.1%} of {row.get('ceiling')}" if of is not None else ""))
        elif row.get("status") not in ("measured", "dry-run"):
            lines.append(f"  perf    {str(row.get('name'))[:64]:<64} {row.get('status')}: {str(row.get('message', ''))[:80]}")
    for row in report.get("layer", []):
        if "share" in row:
            lines.append(f"  layer   ctx{row.get('context')} {row.get('op'):<18} {row['share']:.1%} ({row.get('ms_per_step', 0):.3f} ms/step)")
    for row in report.get("speed", []) + report.get("peer", []) + report.get("serve", []):
        lines.append(f"  {row.get('section'):<7} {row.get('model', '')} {row.get('mode', row.get('engine', ''))} "
                     f"c={row.get('concurrency', '-')}: {row.get('status')} {row.get('tok_s', 0) or 0:.1f} tok/s "
                     f"{str(row.get('message', ''))[:80]}")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
