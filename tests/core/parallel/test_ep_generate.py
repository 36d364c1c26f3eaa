"""``inferhal generate`` over EP ranks refuses, before any process starts or any weight loads, everything
the config alone shows a rank would refuse: the layout, an unavailable backend, a dense model, expert
slots that do not divide among the ranks."""

from __future__ import annotations

import time

import pytest

from inferhal.core.cli.main import compose, main
from inferhal.core.errors import UserError
from inferhal.core.parallel.ep_generate import check_before_spawn, generate_parallel


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if a rank process starts or a model loads."""
    import torch.multiprocessing as mp

    from inferhal.core.models import registry

    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: pytest.fail("spawned rank processes"))
    monkeypatch.setattr(registry, "load_model", lambda *a, **k: pytest.fail("loaded a model"))


def test_the_ascend_prefill_layout_is_refused_at_once_by_the_cli(no_spawn, capsys):
    t0 = time.perf_counter()
    assert main(["generate", "parallel=ascend_dsv4_prefill_dp4tp4", "model=deepseek_v4_tiny", "prompt_ids=[1,2]"]) == 2
    assert time.perf_counter() - t0 < 30  # was: 64 processes started on a 2-core host, then refused (> 5 min)
    err = capsys.readouterr().err
    assert "parallel.tp=4 is refused" in err and "parallel.dp=4" in err and "Traceback" not in err


@pytest.mark.parametrize("overrides,needle", [
    # composed without the config check: what launch itself refuses (a layout built by hand or by a tool)
    (["parallel=ascend_dsv4_prefill_dp4tp4"], "parallel.tp=4: tensor parallelism is not supported yet"),
    (["parallel=dep8"], "parallel.dp=8: data-parallel attention is not supported yet"),
    (["parallel=ep2", "parallel.role=decode"], "parallel.role='decode'"),
])
def test_generate_parallel_checks_the_layout_before_spawning(no_spawn, overrides, needle):
    cfg = compose(["model=deepseek_v4_tiny", "prompt_ids=[1,2]", *overrides], "generate", check=False)
    with pytest.raises(UserError, match=needle):
        generate_parallel(cfg)


@pytest.mark.parametrize("overrides,needle", [
    (["model=gemma3_270m"], "model 'gemma3_270m' \\(family gemma3\\) is dense: parallel.ep=2"),
    (["model=deepseek_v4_tiny", "backend=cuda_sm100"], "backend 'cuda_sm100' is unavailable"),
    (["model=deepseek_v4_tiny", "parallel.ep=3"], "8 physical expert slots \\(routed experts\\) do not divide among "
                                                  "parallel.ep=3"),
    (["model=deepseek_v4_tiny", "eplb=default", "eplb.num_redundant_experts=1"], "9 physical expert slots"),
    (["model=deepseek_v4_tiny", "spec=ngram", "spec.num_speculative_tokens=0"], "spec.num_speculative_tokens >= 1"),
])
def test_what_every_rank_would_refuse_is_refused_before_spawning(no_spawn, overrides, needle, capsys):
    cfg = compose(["parallel=ep2", "prompt_ids=[1,2]", *overrides], "generate")
    with pytest.raises(UserError, match=needle):
        check_before_spawn(cfg)
    assert main(["generate", "parallel=ep2", "prompt_ids=[1,2]", *overrides]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_runnable_layout_passes_the_checks(no_spawn):
    cfg = compose(["model=deepseek_v4_tiny", "parallel=ep2", "eplb=default", "eplb.num_redundant_experts=2"], "generate")
    assert check_before_spawn(cfg) == 2
