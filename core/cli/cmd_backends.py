"""``inferhal backends``: every backend found, available or not and why, and the op coverage matrix."""

from __future__ import annotations

from omegaconf import OmegaConf

from inferhal.core.config.schema import BackendConfig
from inferhal.core.registry import BackendRegistry

INVARIANCE_STYLE = {"always": "green", "in mode": "cyan", "fallback": "dim", "no": "red", "undeclared": "yellow",
                    "invalid": "red"}

LEVEL_STYLE = {
    "device": "green",
    "interpreter": "cyan",
    "compiled": "blue",
    "wired-unrun": "yellow",
    "fallback": "dim",
    "absent": "red",
}


def report(reg: BackendRegistry, config: BackendConfig | None = None) -> dict:
    """The data behind the tables (also what ``--json``-style callers and tests read)."""
    from inferhal.core.paging.formats import backend_kv_dtypes

    probes, kv_dtypes = {}, {}
    names = reg.names()  # the selected backend first: its options (e.g. interpret) decide how kernels import
    if config is not None and config.name in names:
        names = [config.name] + [n for n in names if n != config.name]
    for name in names:
        cfg = config if config is not None and config.name == name else BackendConfig(name=name)
        probes[name] = reg.probe(name, cfg)
        if probes[name].available:  # the cache.kv_dtype values its ops read: capability data of its profile
            try:
                kv_dtypes[name] = backend_kv_dtypes(reg.call(name, "inferhal_device_profile", config=cfg))
            except Exception as exc:  # a profile that cannot be built here is reported, not fatal
                kv_dtypes[name] = (f"(no profile: {exc})",)
    return {"probes": probes, "coverage": reg.coverage(), "origins": {n: r.origin for n, r in reg.records.items()},
            "kv_dtypes": kv_dtypes, "batch_invariance": reg.invariance_matrix()}


def run(cfg, words) -> int:
    from inferhal.core.console import console as make_console
    from rich.markup import escape
    from rich.table import Table

    reg = BackendRegistry.discover()
    selected = BackendConfig(**OmegaConf.to_container(cfg.backend, resolve=True))
    data = report(reg, selected)
    console = make_console()
    t = Table(title="inferhal backends (entry-point group inferhal.backends)")
    for col in ("backend", "status", "reason", "registered from"):
        t.add_column(col, overflow="fold")
    for name, probe in sorted(data["probes"].items()):
        status = "[green]available[/]" if probe.available else "[red]unavailable[/]"
        t.add_row(name, status, escape(probe.reason), escape(data["origins"][name]))
    console.print(t)
    cov = data["coverage"]
    m = Table(title="op coverage: execution level of each op (fallback = reference stands in)")
    m.add_column("op")
    here = {b: b in data["probes"] and data["probes"][b].available for b in cov}
    for name in cov:
        m.add_column(name if here[name] else f"{name}\n(unavailable)")
    ops = next(iter(cov.values())).keys() if cov else []
    for op in ops:  # an unavailable backend's column: what it declares, dimmed (nothing of it runs here)
        m.add_row(op, *[f"[{LEVEL_STYLE.get(cov[b][op], '') if here[b] else 'dim'}]{cov[b][op]}[/]" for b in cov])
    console.print(m)
    print_invariance(console, data["batch_invariance"], ops)
    kv = "; ".join(f"{n}: {', '.join(v)}" for n, v in sorted(data["kv_dtypes"].items()))
    console.print(f"KV caches each available backend reads (cache.kv_dtype): {kv}", highlight=False)
    console.print("levels: device = runs on the backend's device; interpreter = emulated on the CPU; compiled = "
                  "compiled only; wired-unrun = wired to a device operator, never run here; fallback = reference. "
                  "An (unavailable) column is what that backend declares, not a result on this host (its reason "
                  "says whether another mode of it runs here).")
    return 0


def print_invariance(console, matrix: dict, ops) -> None:
    """The batch-invariance table (what ``deterministic=true`` needs of every op that runs), then, per backend,
    why each op that cannot honour it does not."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="batch invariance per op (deterministic=true needs it of every op a backend runs itself)")
    t.add_column("op")
    for name in matrix:
        t.add_column(name)
    for op in ops:
        cells = []
        for name in matrix:
            state = matrix[name].get(op, {}).get("state", "")
            cells.append(f"[{INVARIANCE_STYLE.get(state, '')}]{state}[/]" if state else "")
        t.add_row(op, *cells)
    console.print(t)
    for name, cells in matrix.items():
        bad: dict[str, list[str]] = {}
        for op, c in cells.items():
            if c["state"] in ("no", "undeclared", "invalid"):
                bad.setdefault(c["why"], []).append(op)
        for why, names in bad.items():
            console.print(f"  {name}: {', '.join(names)}: {escape(why)}", highlight=False)
    console.print("invariance: always = a row's result never depends on its batch; in mode = only with "
                  "backend.batch_invariant=true (deterministic=true turns it on); fallback = the reference's op, "
                  "invariant in its mode; no / undeclared: deterministic=true is refused, naming the op")
