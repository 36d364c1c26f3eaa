"""Test backends registered in-process, and a helper that qualifies one."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def _load(name: str):
    if str(HERE) not in sys.path:  # the backends import their shared hooks (cpu_hooks.py) from here
        sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(f"inferhal_test_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def registry():
    from inferhal.core.registry import BackendRegistry

    extra = {n: _load(f"{n}_backend") for n in ("broken", "timed", "unrun", "percall")}
    return BackendRegistry.discover(extra=extra)


@pytest.fixture
def qualify(registry, tmp_path):
    """qualify(name, **options) -> report dict (no progress bar, output under tmp_path)."""
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.qualify import runner

    def go(name: str, batch_invariant: bool = False, **kw):
        active = registry.select(BackendConfig(name=name, batch_invariant=batch_invariant))
        ref = registry.select(BackendConfig(name="reference"))
        kw.setdefault("output_dir", str(tmp_path / name))
        kw.setdefault("progress", False)
        return runner.run(active, ref, runner.QualifyOptions(**kw))

    return go
