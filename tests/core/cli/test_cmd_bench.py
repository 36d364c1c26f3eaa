"""``inferhal bench KIND``: the kinds it finds, and bench settings that cannot run refused before anything
loads, with the field named."""

from __future__ import annotations

import pytest

from inferhal.core.cli import cmd_bench
from inferhal.core.cli.main import main
from inferhal.core.errors import UserError


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    """Each test in a folder of its own: main's output check makes bench.output_dir (./bench-results) before the
    kind and the settings are read, and would leave it in the checkout."""
    monkeypatch.chdir(tmp_path)


def test_kinds_are_the_bench_modules_with_a_run():
    kinds = cmd_bench.kinds()
    assert {"e2e", "engine", "eplb", "greedy_head", "ops", "cpu_linear"} <= set(kinds)
    assert "host" not in kinds and "bounds" not in kinds
    # cpu_linear takes the backends as found (core imports none); a backend's own benchmark would come
    # through its "benchmarks" extra (test below)
    assert all(m.startswith("inferhal.core.bench.") for m in kinds.values())


def test_a_backend_benchmark_named_like_a_core_one_is_refused(monkeypatch):
    import types

    import inferhal.backends.reference.plugin as ref
    from inferhal.core.hookspecs import REQUIRED_HOOKS, hookimpl
    from inferhal.core.registry import BackendRegistry

    def inferhal_backend_extra(name):
        return {"e2e": "somewhere.else"} if name == "benchmarks" else None

    clash = types.ModuleType("clash")  # the reference's required hooks, and a benchmark named like core's
    for hook in REQUIRED_HOOKS:
        setattr(clash, hook, getattr(ref, hook))
    clash.inferhal_backend_extra = hookimpl(inferhal_backend_extra)
    real = BackendRegistry.discover
    monkeypatch.setattr(BackendRegistry, "discover", classmethod(lambda cls: real(extra={"clash": clash})))
    with pytest.raises(UserError, match="backend 'clash': its benchmark 'e2e' is already inferhal.core.bench.e2e"):
        cmd_bench.kinds()


@pytest.mark.parametrize("override,needle", [
    ("bench.concurrency=[]", "bench.concurrency: needs one or more levels, each >= 1; got []"),
    ("bench.concurrency=[1,0]", "bench.concurrency: needs one or more levels, each >= 1; got [1, 0]"),
    ("bench.num_prompts=0", "bench.num_prompts must be >= 1; got 0"),
    ("bench.max_tokens=-3", "bench.max_tokens must be >= 1; got -3"),
    ("bench.repeats=0", "bench.repeats must be >= 1; got 0"),
    ("bench.warmup=-1", "bench.warmup must be >= 0; got -1"),
])
@pytest.mark.parametrize("kind", ["ops", "e2e"])
def test_bench_settings_that_cannot_run_are_refused_with_the_field_named(kind, override, needle, capsys,
                                                                       monkeypatch):
    import inferhal.core.engine.llm as llm

    monkeypatch.setattr(llm.LLM, "from_config", lambda *a, **k: pytest.fail("loaded a model for bad settings"))
    assert main(["bench", kind, override]) == 2
    assert needle in capsys.readouterr().err


def test_an_unknown_kind_lists_the_kinds(capsys):
    assert main(["bench", "opz"]) == 2
    err = capsys.readouterr().err
    assert "got 'opz'" in err and "greedy_head" in err and "ops" in err
