"""Shared test setup. Tests never put the repository root on sys.path (see pyproject: --import-mode=importlib);
helpers shared across test directories live in tests/fixtures, importable by module name."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))  # e.g. serve_process.py


def _kit_plugin() -> list[str]:
    """The backend conformance kit (``--inferhal-backend``), unless the installed package already registers it
    as a pytest11 entry point (registering it twice would be an error)."""
    import importlib.metadata as md

    mod = "inferhal.core.qualify.pytest_plugin"
    return [] if any(ep.value == mod for ep in md.entry_points(group="pytest11")) else [mod]


pytest_plugins = _kit_plugin()


def _malloc_trim():
    """glibc's ``malloc_trim``, or None elsewhere. glibc raises its mmap threshold after large frees, so the
    big tensors of a dropped model end up in heap arenas that are never given back on their own; a test
    process that loads several real models one module after another would keep every one's footprint."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (trylast: after pytest finalised its fixtures): collect garbage and give the freed
    heap back to the OS, so the suite's peak memory is the largest module's, not the sum of all."""
    if _TRIM is not None and (nextitem is None or nextitem.module is not item.module):
        import gc

        gc.collect()
        _TRIM(0)
