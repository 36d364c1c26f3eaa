"""Shared test setup. Tests never put the repository root on sys.path (see pyproject: --import-mode=importlib);
helpers shared across test directories live in tests/fixtures, importable by module name."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))  # e.g. serve_process.py

TESTS = Path(__file__).parent

# --- running on every core (pytest-xdist: the README's command runs `-n auto`, pyproject; groups by path below) ---
#: most workers `-n auto` starts: each one beside the real-model worker holds a tiny model or kernels (~0.5 GB)
MAX_WORKERS = 4
#: test paths that load real models (Gemma 3 270M, SmolLM2) or start model servers: they share one worker and run
#: one after another there, as in a single process, while the other workers take the tiny models and kernels.
#: Each package loads its model once for its tests (package-scoped fixtures; transformers' answers are stored,
#: tests/fixtures/transformers_oracle.py): two such at once would add their peaks, and one package on two workers
#: would load its model twice
ONE_WORKER = {path: "real_models" for path in (
    "models/gemma3", "models/llama", "models/gguf", "backends/reference/test_batch_invariant_gemma3.py",
    "core/server", "core/disagg/test_router.py", "core/bench/test_serve_bench.py",
    "core/bench/test_structured_bench.py", "core/structured/test_engine.py", "core/engine/test_cli.py",
    "core/bench/test_soak.py", "core/config/test_context.py", "core/spec/test_suffix_smollm.py",
    "core/bench/test_agent.py")}  # its SmolLM2 server child: 1.0 GB of PSS beside the group's worker at this run's peak
#: other test paths whose tests share an expensive module- or package-scoped fixture, kept on one worker so that it
#: runs once (xdist makes every test its own unit here: a module's tests spread over the workers, each worker
#: building the module's fixtures again): the tiny DeepSeek-V4's greedy run on cuda_sm100's kernels in the
#: interpreter (backends/cuda_sm100/conftest.py); the spawned ranks (and single-process references) of
#: test_dp_engine.py, test_tbo.py, test_dp_graphs.py and test_elastic.py (6-19 s each, built on both workers before)
SHARED_RUNS = {"backends/cuda_sm100/test_e2e_tiny_v4.py": "cuda_sm100_tiny_v4",
               "backends/cuda_sm100/test_host_reads.py": "cuda_sm100_tiny_v4",
               **{f"core/parallel/test_{name}.py": f"parallel_{name}"
                  for name in ("dp_engine", "tbo", "dp_graphs", "elastic")}}


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core, at most :data:`MAX_WORKERS`."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def pytest_configure(config):
    """In an xdist worker, torch and OpenMP (the CPU kernels, and the servers and ranks tests spawn, which
    inherit the environment) use this worker's share of the cores: two workers with two threads each on two
    cores would make every product wait for the other worker's."""
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if count:
        threads = str(max(1, (os.cpu_count() or 1) // int(count)))
        os.environ["OMP_NUM_THREADS"] = threads
        import torch

        torch.set_num_threads(int(threads))


# --- two tiers: the README's `pytest` runs every test but those marked slow; `pytest -m slow` runs those ---
#: the second tier's marker (pyproject.toml says what it covers); CI (.ci/run) runs the README's command, then it
SLOW = "slow"


def default_run(config) -> bool:
    """The README's command: no test path named (pyproject's ``testpaths``) and no ``-m``. A run that names paths
    or node ids runs every test it names, slow ones included; ``-m`` chooses by itself (``-m slow``: the second
    tier, ``-m "slow or not slow"``: both)."""
    return config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.markexpr


def pytest_collection_modifyitems(config, items):
    """The default run leaves out the tests marked slow (reported as deselected)."""
    if not default_run(config):
        return
    keep, slow = [], []
    for item in items:
        (slow if item.get_closest_marker(SLOW) else keep).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep


def pytest_terminal_summary(terminalreporter, config):
    if default_run(config):
        terminalreporter.write_line(f"the tests marked {SLOW} (the second tier: servers, process groups and real models "
                                    f"run end to end) did not run: `.venv/bin/pytest -m {SLOW}` runs them; CI runs "
                                    f"both tiers")


def group_of(rel: str):
    """The ONE_WORKER (or SHARED_RUNS) group of a test path relative to tests/ (``models/gemma3/test_bf16.py``),
    or None."""
    return next((g for prefix, g in (ONE_WORKER | SHARED_RUNS).items()
                 if rel == prefix or rel.startswith(prefix + "/")), None)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # xdist's hook: unknown (not an error) without it
def pytest_xdist_make_scheduler(config, log):
    """Keep each ONE_WORKER group on one worker, every other test its own unit (xdist's ``loadgroup``, reading the
    group from the path). xdist's own loadgroup appends ``@group`` to ``item._nodeid`` from ``xdist_group`` marks;
    pytest 9.2 derives ``nodeid`` from elsewhere, so the suffix never reached the scheduler and the real models'
    tests spread over every worker, each loading its own model and transformers oracle at once (this session's run:
    Gemma 3's fidelity oracle set up on both workers, 9.8 GB of PSS in all at the peak)."""
    from xdist.scheduler import LoadScopeScheduling

    class PathGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            group = group_of(path[len("tests/"):]) if path.startswith("tests/") else None
            return group or nodeid

    return PathGroups(config, log)


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


def pytest_collection_finish(session):
    """Freeze what collection made (the test items, every module imported so far) out of the cyclic garbage
    collector's reach: it lives as long as the session, and every full collection walked it again, the module
    teardown's below (246 in a suite run) and the interpreter's own. py-spy on a whole suite run (loaded host) put
    11 % of the workers' sampled time in the teardown's gc.collect(); on five heavy modules a collection walks 75k
    objects instead of 344k and takes 0.05 s instead of 0.2 s. Reference counting still frees frozen objects; only
    cycles among them would stay."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """Give the frozen objects back to the collector before the interpreter ends, so its last collection frees
    them as before (extension objects left frozen are reported as leaks at exit)."""
    import gc

    gc.unfreeze()


def _stop_forkserver() -> None:
    """Stop this process's multiprocessing forkserver, if a test started one (core/procs.py: ranks, instances and
    servers fork from it, torch preloaded): about 170 MB of PSS per worker that stayed for the rest of the session
    (measured at the suite's peak: the two workers' idle forkservers were 337-345 MB of its 3.9-4.0 GB). The next
    module that starts a process starts it again (about 2 s of CPU)."""
    fs = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = getattr(fs, "_forkserver_pid", None)
    if pid is None or not hasattr(fs, "_stop"):
        return
    try:  # its children hold its liveness pipe: stopping it would wait for them, forever for one that hangs
        if Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            return
    except OSError:
        pass
    fs._stop()


#: the resident set (bytes) after the last malloc_trim: trimming walks the whole heap (about 0.1 s on the
#: real-model worker; py-spy put 1.7 % of a suite's sampled worker time in it at every module's end), so a module
#: that grew the process by less than _TRIM_AFTER since then is not trimmed
_TRIMMED = [0]
_TRIM_AFTER = 64 << 20


def _rss() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 1 << 62  # unknown: always trim


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (trylast: after pytest finalised its fixtures): collect garbage and give the freed
    heap back to the OS, and stop an idle forkserver, so the suite's peak memory is the largest module's, not the
    sum of all."""
    if nextitem is None or nextitem.module is not item.module:
        _stop_forkserver()
        if _TRIM is not None and _rss() - _TRIMMED[0] > _TRIM_AFTER:
            import gc

            gc.collect()
            _TRIM(0)
            _TRIMMED[0] = _rss()
