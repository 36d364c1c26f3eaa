"""core/procs.py: worker processes start from a forkserver with torch preloaded (or spawn), and each child runs
under the caller's environment as it was at ``start()``, as a spawned child does."""

from __future__ import annotations

import os
import sys

import pytest

from inferhal.core import procs
from inferhal.core.errors import UserError


PROBE = """
import os, sys

PRELOADED = "torch" in sys.modules  # at import: before any target of this child ran


def probe(q, names):
    import torch

    q.put(({n: os.environ.get(n) for n in names}, PRELOADED, torch.get_num_threads()))


def ranked(index, q):
    q.put((index, os.environ.get("INFERHAL_PROCS_PROBE")))
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """The children's targets, in a module they import by name (a test module is not importable there)."""
    (tmp_path / "inferhal_procs_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import inferhal_procs_probe

    yield inferhal_procs_probe
    sys.modules.pop("inferhal_procs_probe", None)


def _start(ctx, probe, *names):
    q = ctx.Queue()
    p = ctx.Process(target=probe.probe, args=(q, names), daemon=True)
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    return got


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_child_sees_the_environment_of_its_start_and_its_thread_count(monkeypatch, probe, method):
    monkeypatch.setenv(procs.METHOD_ENV, method)
    ctx = procs.context()
    assert ctx.get_start_method() == method
    monkeypatch.setenv("INFERHAL_PROCS_PROBE", "first")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env, preloaded, threads = _start(ctx, probe, "INFERHAL_PROCS_PROBE", "OMP_NUM_THREADS")
    assert env == {"INFERHAL_PROCS_PROBE": "first", "OMP_NUM_THREADS": "1"} and threads == 1
    # a forkserver started with the first child keeps that environment: the second child still sees the new one
    monkeypatch.setenv("INFERHAL_PROCS_PROBE", "second")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env, preloaded, threads = _start(ctx, probe, "INFERHAL_PROCS_PROBE", "OMP_NUM_THREADS")
    assert env == {"INFERHAL_PROCS_PROBE": "second", "OMP_NUM_THREADS": "2"} and threads == 2
    monkeypatch.delenv("INFERHAL_PROCS_PROBE")
    env, _, _ = _start(ctx, probe, "INFERHAL_PROCS_PROBE")
    assert env == {"INFERHAL_PROCS_PROBE": None}  # a variable removed since is gone in the child too
    assert preloaded == (method == "forkserver")  # torch was imported before the target ran: the forkserver's


def test_entry_gives_start_processes_ranks_the_callers_environment(monkeypatch, probe):
    import torch.multiprocessing as tmp

    monkeypatch.setenv("INFERHAL_PROCS_PROBE", "ranks")
    method = procs.method()
    q = procs.context().Queue()
    tmp.start_processes(procs.entry(probe.ranked), args=(q,), nprocs=2, join=True, start_method=method)
    assert sorted(q.get(timeout=30) for _ in range(2)) == [(0, "ranks"), (1, "ranks")]


def test_an_unknown_method_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(procs.METHOD_ENV, "fork")
    with pytest.raises(UserError, match=f"{procs.METHOD_ENV}='fork'.*forkserver, spawn"):
        procs.context()
    monkeypatch.setenv(procs.METHOD_ENV, "")
    assert procs.method() == "forkserver"  # empty: the default
