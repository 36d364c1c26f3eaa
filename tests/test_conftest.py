"""tests/conftest.py's worker groups: a test module that loads a real model in the test process (or starts a server
child with one) belongs to the real-model worker (ONE_WORKER), or the suite holds that model on both workers at once
(test_suffix_smollm.py did: +0.69 GB on the other worker at the end of a suite run, beside the real-model worker's
own; test_agent.py's server child +1.0 GB at another run's peak)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
#: an LLM of a real model (a GGUF from PyPI) built in the test process
REAL = re.compile(r'LLM\(\s*"(smollm2_135m_instruct|gemma3_270m)"')
#: the CLI run on a real model in the test process: it loads the model, or a bench starts a server child with it
#: (test_agent.py's SmolLM2 child, 1.0 GB of PSS, ran beside the real-model worker at a suite run's peak)
CLI = re.compile(r'main\(\[\s*"(?:bench|serve|generate)"[^\]]*?"model=(?:smollm2_135m_instruct|gemma3_270m)"')
#: modules whose CLI runs of a real model are refused before anything loads (the test makes loading fail)
REFUSED_ONLY = {"models/deepseek_v4/test_kv_dtype.py"}
#: opt-in modules (skipped unless INFERHAL_LONG=1): never in the README's run
OPT_IN = {"backends/cuda_sm100/test_e2e_gemma3.py"}


def _suite(config):
    """The loaded tests/conftest.py (under --import-mode=importlib it is no importable module)."""
    return next(p for p in config.pluginmanager.get_plugins() if getattr(p, "ONE_WORKER", None) is not None)


def real_model_modules() -> list[str]:
    """The test modules (paths relative to tests/) that build an LLM of a real model in the test process, or run
    the CLI on one there (a bench's server child included)."""
    out = []
    for f in sorted(TESTS.rglob("test_*.py")):
        rel, text = f.relative_to(TESTS).as_posix(), f.read_text()
        if REAL.search(text) or (CLI.search(text) and rel not in REFUSED_ONLY):
            out.append(rel)
    return out


def test_every_module_that_loads_a_real_model_runs_on_the_real_model_worker(pytestconfig):
    suite = _suite(pytestconfig)
    loose = [rel for rel in real_model_modules() if rel not in OPT_IN and suite.group_of(rel) is None]
    assert not loose, f"load a real model outside tests/conftest.py's ONE_WORKER groups: {loose}"


def test_the_pattern_finds_the_known_real_model_modules():
    """The check above sees what it looks for (a negative control on today's tree)."""
    assert {"core/spec/test_suffix_smollm.py", "backends/cuda_sm100/test_e2e_gemma3.py",
            "core/bench/test_agent.py", "core/bench/test_serve_bench.py"} <= set(real_model_modules())
    assert "models/deepseek_v4/test_kv_dtype.py" not in real_model_modules()


def test_the_readme_command_leaves_out_the_slow_tier_and_everything_else_chooses(pytestconfig):
    """The README's `pytest` (testpaths, no -m) deselects the tests marked slow; naming paths or a -m keeps them."""
    from types import SimpleNamespace

    suite, source = _suite(pytestconfig), pytest.Config.ArgsSource

    def config(args_source, markexpr=""):
        deselected = []
        return SimpleNamespace(args_source=args_source, option=SimpleNamespace(markexpr=markexpr),
                               hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)),
                               deselected=deselected)

    def item(slow):
        return SimpleNamespace(slow=slow, get_closest_marker=lambda name: "mark" if slow and name == "slow" else None)

    for cfg, keeps_slow in ((config(source.TESTPATHS), False), (config(source.TESTPATHS, "slow"), True),
                            (config(source.ARGS), True), (config(source.TESTPATHS, "slow or not slow"), True)):
        items = [item(False), item(True), item(False)]
        suite.pytest_collection_modifyitems(cfg, items)
        assert [i.slow for i in items] == ([False, True, False] if keeps_slow else [False, False])
        assert [i.slow for i in cfg.deselected] == ([] if keeps_slow else [True])


def test_ci_runs_the_readme_command_then_the_slow_tier():
    root = TESTS.parent
    readme, ci = (root / "README.md").read_text(), (root / ".ci" / "run").read_text()
    command = "bash .ci/bootstrap test && .venv/bin/pytest\n"
    assert command in readme and command in ci
    assert ci.index(command) < ci.index(".venv/bin/pytest -m slow\n")
    assert "`.venv/bin/pytest -m slow`" in readme
