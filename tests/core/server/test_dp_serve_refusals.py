"""``inferhal serve`` over DP ranks (``parallel=dep2``): every layout or DP setting it cannot run is refused
before anything loads or spawns, naming the field (core/server/serve.py: check_dp)."""

from __future__ import annotations

import pytest

from inferhal.core.errors import UserError


def cfg_of(*over, command="serve"):
    from inferhal.core.cli.main import compose

    return compose(["model=deepseek_v4_tiny", *over], command=command)


@pytest.mark.parametrize("over, words", [
    (["parallel=ep2"], r"parallel.ep=2 with parallel.dp=1: `inferhal serve` runs expert parallelism with data-parallel"),
    (["parallel.dp_balance=vllm"], r"parallel.dp_balance='vllm' is read by `inferhal serve` only with data-parallel"),
    (["parallel.restarts=1"], r"parallel.restarts=1 is read by `inferhal serve` only with"),
    (["parallel.master_port=0"], r"parallel.master_port=0 is read by `inferhal serve` only with"),
    (["eplb.window_size=5"], r"eplb.window_size=5 is read by `inferhal serve` only with data-parallel attention"),
    (["parallel=dep2", "parallel.dp_balance=least"], r"parallel.dp_balance must be one of tokens_cache, vllm, "
                                                      r"round_robin, got 'least'"),
    (["parallel=dep2", "parallel.dp_balance_margin=-1"], r"parallel.dp_balance_margin must be >= 0"),
    (["parallel=dep2", "parallel.restarts=-1"], r"parallel.restarts must be >= 0"),
    (["parallel=dep2", "parallel.launcher=torchrun"], r"parallel.launcher=torchrun: `inferhal serve` spawns its DP"),
    (["parallel=dep2", "scheduler.async_scheduling=true"], r"scheduler.async_scheduling=true does not run with "
                                                           r"data-parallel attention"),
    (["parallel=dep16"], r"8 physical expert slots \(routed experts\) do not divide among parallel.ep=16 ranks"),
    (["parallel=dep2", "parallel.ep=4"], r"parallel.dp=2 with parallel.ep=4"),
    (["parallel=dep2", "model=smollm2_135m_instruct"], r"is dense: parallel.ep=2 needs a model with routed experts"),
])
def test_serve_refuses_a_dp_layout_it_cannot_run(over, words):
    from inferhal.core.server.serve import check_dp

    with pytest.raises(UserError, match=words):
        check_dp(cfg_of(*over))


def test_dep2_and_dep4_pass_the_checks():
    from inferhal.core.server.serve import check_dp

    assert check_dp(cfg_of("parallel=dep2")) == 2
    assert check_dp(cfg_of("parallel=dep4", "parallel.dp_balance=round_robin", "parallel.restarts=0")) == 4
    assert check_dp(cfg_of()) == 1


def test_the_dp_fields_are_refused_by_generate():
    from inferhal.core.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel.dp_balance='vllm' is refused by `inferhal generate`"):
        cfg_of("parallel=dep2", "parallel.dp_balance=vllm", command="generate")


def test_the_cli_refuses_before_anything_spawns(capsys):
    from inferhal.core.cli.main import main

    assert main(["serve", "model=deepseek_v4_tiny", "parallel=dep2", "parallel.dp_balance=least"]) == 2
    err = capsys.readouterr().err
    assert "parallel.dp_balance must be one of" in err and "Traceback" not in err
