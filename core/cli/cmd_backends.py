"""``inferhal backends``: every backend found, available or not and why, and the op coverage matrix."""

from __future__ import annotations

from omegaconf import OmegaConf

from inferhal.core.config.schema import BackendConfig
from inferhal.core.registry import BackendRegistry

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
            "kv_dtypes": kv_dtypes}


def run(cfg, words) -> int:
    from inferhal.core.cli.console import console as make_console
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
    for name in cov:
        m.add_column(name)
    ops = next(iter(cov.values())).keys() if cov else []
    for op in ops:
        m.add_row(op, *[f"[{LEVEL_STYLE.get(cov[b][op], '')}]{cov[b][op]}[/]" for b in cov])
    console.print(m)
    kv = "; ".join(f"{n}: {', '.join(v)}" for n, v in sorted(data["kv_dtypes"].items()))
    console.print(f"KV caches each available backend reads (cache.kv_dtype): {kv}", highlight=False)
    console.print("levels: device = ran on the backend's device; interpreter = emulated on the CPU; compiled = "
                  "compiled only; wired-unrun = wired to a device operator, never run here; fallback = reference")
    return 0
