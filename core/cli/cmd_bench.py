"""``inferhal bench KIND``: run the benchmark module ``inferhal.core.bench.KIND`` (its ``run(cfg) -> int``).

Benchmarks are not timed tests: they measure and report (a rich table and a JSON file), and their exit
status says only whether they ran.
"""

from __future__ import annotations

import importlib
import pkgutil

from inferhal.core.errors import UserError


def kinds() -> list[str]:
    """The benchmark modules: those of inferhal.core.bench with a ``run`` (helpers such as ``host`` have none)."""
    import inferhal.core.bench as pkg

    names = (m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))
    return sorted(n for n in names if callable(getattr(importlib.import_module(f"{pkg.__name__}.{n}"), "run", None)))


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
    module = importlib.import_module(f"inferhal.core.bench.{words[0]}")
    return int(module.run(cfg) or 0)
