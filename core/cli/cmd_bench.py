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


def run(cfg, words) -> int:
    available = kinds()
    if len(words) != 1 or words[0] not in available:
        got = " ".join(words) or "nothing"
        raise UserError(f"usage: inferhal bench KIND [overrides]; got {got!r}; kinds: {', '.join(available)}")
    module = importlib.import_module(f"inferhal.core.bench.{words[0]}")
    return int(module.run(cfg) or 0)
