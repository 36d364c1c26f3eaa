"""``inferhal bench KIND``: run the benchmark module ``inferhal.core.bench.KIND``, or a backend's (its
``"benchmarks"`` extra), by its ``run(cfg) -> int``.

Benchmarks are not timed tests: they measure and report (a rich table and a JSON file), and their exit
status says only whether they ran.
"""

from __future__ import annotations

import importlib
import pkgutil

from inferhal.core.errors import UserError


def kinds() -> dict[str, str]:
    """Benchmark name → module: inferhal.core.bench's modules with a ``run`` (helpers such as ``host`` have none),
    then each registered backend's ``"benchmarks"`` extra (a backend's own benchmark lives with it)."""
    import inferhal.core.bench as pkg
    from inferhal.core.registry import BackendRegistry

    names = (m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))
    found = {n: f"{pkg.__name__}.{n}" for n in sorted(names)
             if callable(getattr(importlib.import_module(f"{pkg.__name__}.{n}"), "run", None))}
    reg = BackendRegistry.discover()
    for backend in reg.names():
        for name, module in (reg.extra(backend, "benchmarks") or {}).items():
            if name in found:
                raise UserError(f"backend {backend!r}: its benchmark {name!r} is already {found[name]}; rename it")
            found[name] = module
    return dict(sorted(found.items()))


def check(bench) -> None:
    """The ``bench`` settings every benchmark reads, refused with the field named when they cannot run."""
    levels = list(bench.concurrency)
    if not levels or any(int(c) < 1 for c in levels):
        raise UserError(f"bench.concurrency: needs one or more levels, each >= 1; got {levels}")
    for name in ("num_prompts", "max_tokens", "repeats"):
        if int(bench[name]) < 1:
            raise UserError(f"bench.{name} must be >= 1; got {bench[name]}")
    if int(bench.warmup) < 0:
        raise UserError(f"bench.warmup must be >= 0; got {bench.warmup}")


def run(cfg, words) -> int:
    available = kinds()
    if len(words) != 1 or words[0] not in available:
        got = " ".join(words) or "nothing"
        raise UserError(f"usage: inferhal bench KIND [overrides]; got {got!r}; kinds: {', '.join(available)}")
    check(cfg.bench)
    module = importlib.import_module(available[words[0]])
    return int(module.run(cfg) or 0)
