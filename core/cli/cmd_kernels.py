"""``inferhal kernels compile target=ARCH``: compile every kernel of a kernel backend ahead of time.

The backends are asked for their ``aot_compiler`` extra (no probing, no device): the one whose
``targets`` include ``target`` compiles its kernels and returns one row per kernel (compiled or not
with the error, registers, shared memory, the MMA instructions in its PTX). The rows print as a table
and are written as JSON to ``output`` (default ``kernels-<target>.json``). Exit status 1 when a kernel
fails to compile or a tensor-core kernel lacks the target's MMA instruction. Every row's execution
level is ``compiled``: nothing ran.
"""

from __future__ import annotations

import json

from inferhal.core.errors import UserError
from inferhal.core.registry import BackendRegistry

USAGE = "usage: inferhal kernels compile target=ARCH [output=FILE]"


def find_compiler(reg: BackendRegistry, target: str | None):
    """The backend whose ahead-of-time compiler offers ``target``; a UserError listing the targets otherwise."""
    offered = {}
    for name in reg.names():
        if not reg.records[name].registered:
            continue
        comp = reg.extra(name, "aot_compiler")
        if comp is None:
            continue
        offered[name] = tuple(comp.targets)
        if target in comp.targets:
            return name, comp
    listing = "; ".join(f"{n}: {', '.join(t)}" for n, t in offered.items()) or "no backend offers an AOT compiler"
    if target is None:
        raise UserError(f"target= is required ({listing}); {USAGE}")
    raise UserError(f"no backend compiles kernels for target={target!r} ({listing})")


def run(cfg, words) -> int:
    if words != ["compile"]:
        raise UserError(f"unknown kernels subcommand {' '.join(words) or '(none)'!r}; {USAGE}")
    target = None if cfg.target is None else str(cfg.target)
    backend, comp = find_compiler(BackendRegistry.discover(), target)
    rows = comp.compile(target)
    out = cfg.output or f"kernels-{target}.json"
    with open(out, "w") as f:
        json.dump({"target": target, "backend": backend, "execution_level": "compiled", "kernels": rows}, f, indent=1)
    _print(rows, target, backend, out)
    bad = [r for r in rows if not r["compiled"] or not r.get("mma_ok", True)]
    return 1 if bad else 0


def _traffic(r) -> str:
    """What a row's stack costs, where the backend counted its local loads and stores in the assembly."""
    loads, stores = r.get("local_loads"), r.get("local_stores")
    if loads is None or stores is None:
        return ""
    return ", never loaded or stored" if not loads and not stores else f", {loads} local loads / {stores} stores"


def _print(rows, target, backend, out) -> None:
    from inferhal.core.console import console as make_console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"{backend}: kernels compiled ahead of time for {target} (execution level: compiled, not run)")
    for col in ("kernel", "op", "compiled", "regs", "spill B", "smem B", "tmem cols", "MMA in PTX", "error"):
        t.add_column(col, overflow="fold")
    for r in rows:
        if r["compiled"]:
            mma = r.get("mma", "-")
            ok = "[green]yes[/]" if r.get("mma_ok", True) else "[red]yes, but no tensor-core MMA[/]"
            t.add_row(r["kernel"], r["op"], ok, str(r["registers"]), str(r["spill_stack_bytes"]), str(r["shared_bytes"]),
                      str(r["tmem_columns"]), mma, "")
        else:
            t.add_row(r["kernel"], r["op"], "[red]no[/]", "", "", "", "", "", escape(r["error"]))
    console = make_console()
    console.print(t)
    spilled = [f"{r['kernel']} ({r['spill_stack_bytes']} B{_traffic(r)})" for r in rows
               if r["compiled"] and r["spill_stack_bytes"]]
    console.print(f"spill stack in {len(spilled)} of {len(rows)} kernels: {', '.join(spilled)}" if spilled
                  else f"spill stack in none of the {len(rows)} kernels")
    console.print(f"JSON written to {out}")
