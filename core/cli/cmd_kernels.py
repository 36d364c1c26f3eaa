"""``inferhal kernels compile target=NAME``: compile every kernel ahead of time for a target that some
backend declares (its ``aot_targets`` extra), without the device. Reports per kernel: compiled or not,
registers, shared memory, and the matrix-instruction family found in the assembly."""

from __future__ import annotations

import json
import pathlib
import tempfile

from inferhal.core.errors import UserError
from inferhal.core.registry import BackendRegistry


def targets(reg: BackendRegistry) -> dict[str, tuple[str, object]]:
    """target name → (backend, compile function), over every registered backend."""
    out: dict[str, tuple[str, object]] = {}
    for name in reg.names():
        for target, fn in (reg.extra(name, "aot_targets") or {}).items():
            out[target] = (name, fn)
    return out


def run(cfg, words) -> int:
    if words != ["compile"]:
        raise UserError("usage: inferhal kernels compile target=NAME")
    reg = BackendRegistry.discover()
    known = targets(reg)
    if not cfg.target:
        raise UserError(f"give a target: inferhal kernels compile target=NAME (declared: {', '.join(sorted(known)) or 'none'})")
    if cfg.target not in known:
        raise UserError(f"no backend declares the ahead-of-time target {cfg.target!r}; declared: {', '.join(sorted(known)) or 'none'}")
    backend, compile_fn = known[cfg.target]
    with tempfile.TemporaryDirectory() as tmp:
        rows = list(compile_fn(tmp))
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ahead-of-time compile for {cfg.target} (backend {backend}): compiled only, not run")
    for col in ("kernel", "compiled", "registers", "shared bytes", "mma", "ok", "error"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r["kernel"], "yes" if r["compiled"] else "NO", str(r.get("registers", "")), str(r.get("shared_bytes", "")),
                  r.get("mma", "") + (" (required)" if r.get("mma_required") else ""), "ok" if r["ok"] else "FAIL",
                  str(r.get("error", ""))[:200])
    Console().print(t)
    out = pathlib.Path(cfg.output or f"kernels-{cfg.target}.json")
    out.write_text(json.dumps({"target": cfg.target, "backend": backend, "exec_level": "compiled", "kernels": rows}, indent=2))
    print(f"wrote {out}")
    return 0 if rows and all(r["ok"] for r in rows) else 1
