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
    (["parallel.start_timeout_s=60"], r"parallel.start_timeout_s=60.0 is read by `inferhal serve` only with"),
    (["parallel=dep2", "parallel.start_timeout_s=0"], r"parallel.start_timeout_s must be > 0 \(seconds the front"),
    (["parallel=dep2", "parallel.dp_balance=least"], r"parallel.dp_balance must be one of tokens_cache, vllm, "
                                                      r"round_robin, got 'least'"),
    (["parallel=dep2", "parallel.dp_balance_margin=-1"], r"parallel.dp_balance_margin must be >= 0"),
    (["parallel=dep2", "parallel.restarts=-1"], r"parallel.restarts must be >= 0"),
    (["parallel.front=10.0.0.1:7100"], r"parallel.front='10.0.0.1:7100' is read by `inferhal serve` only with"),
    (["parallel=dep2", "parallel.launcher=torchrun"], r"parallel.launcher=torchrun: set parallel.front=HOST:PORT"),
    (["parallel=dep2", "parallel.launcher=torchrun", "parallel.front=10.0.0.1"],
     r"parallel.front: '10.0.0.1' is not an address \(write host:port"),
    (["parallel=dep2", "parallel.launcher=torchrun", "parallel.front=10.0.0.1:0"],
     r"parallel.front='10.0.0.1:0': the ranks need a fixed port"),
    (["parallel=dep2", "parallel.front=10.0.0.1:7100"], r"parallel.front='10.0.0.1:7100' is read with "
                                                        r"parallel.launcher=torchrun only"),
    (["parallel=dep2", "parallel.launcher=torchrun", "parallel.front=h:1", "parallel.master_port=0"],
     r"parallel.master_port=0 is read with parallel.launcher=local only: under torchrun the ranks meet"),
    (["parallel=dep2", "scheduler.async_scheduling=true"], r"scheduler.async_scheduling=true does not run with "
                                                           r"data-parallel attention"),
    (["parallel=dep16"], r"8 physical expert slots \(routed experts\) do not divide among parallel.ep=16 ranks"),
    (["parallel=dep2", "parallel.ep=4"], r"parallel.dp=2 with parallel.ep=4"),
    (["parallel=dep2", "model=smollm2_135m_instruct"], r"is dense: parallel.ep=2 needs a model with routed experts"),
    # elastic EP: the tiny model's yaml declares 8 routed experts, so a redundancy below 8 is refused before any rank
    (["parallel=dep2", "eplb=default", "eplb.survive_rank_loss=true", "eplb.num_redundant_experts=4"],
     r"eplb.survive_rank_loss=true needs eplb.num_redundant_experts >= 8 \(the model's routed experts, its "
     r"n_routed_experts, so each is on two ranks; got 4\)"),
    (["parallel=dep2", "eplb.survive_rank_loss=true"], r"eplb.survive_rank_loss=true needs EPLB on \(eplb=default\)"),
    (["parallel=dep2", "eplb=default", "eplb.survive_rank_loss=true", "eplb.num_redundant_experts=8",
      "eplb.num_nodes=2"], r"eplb.survive_rank_loss=true needs eplb.num_nodes=1"),
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


def test_serve_under_torchrun_needs_the_key_and_checks_the_world_size_on_a_rank_only(monkeypatch):
    """The front (no RANK in the environment) needs no torchrun environment; a rank's WORLD_SIZE must be the layout's;
    both need INFERHAL_DP_KEY."""
    from inferhal.core.server.serve import check_dp

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "INFERHAL_DP_KEY"):
        monkeypatch.delenv(var, raising=False)
    cfg = cfg_of("parallel=dep2", "parallel.launcher=torchrun", "parallel.front=10.0.0.1:7100")
    with pytest.raises(UserError, match=r"set the environment variable INFERHAL_DP_KEY to the same secret"):
        check_dp(cfg)
    monkeypatch.setenv("INFERHAL_DP_KEY", "k")
    assert check_dp(cfg) == 2  # the front
    for var, value in (("RANK", "1"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "10.0.0.2"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(var, value)
    with pytest.raises(UserError, match=r"WORLD_SIZE=4 but parallel.tp x parallel.ep = 2"):
        check_dp(cfg)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert check_dp(cfg) == 2  # a rank


def test_the_dp_fields_are_refused_by_generate():
    from inferhal.core.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"parallel.dp_balance='vllm' is refused by `inferhal generate`"):
        cfg_of("parallel=dep2", "parallel.dp_balance=vllm", command="generate")
    with pytest.raises(ConfigError, match=r"parallel.front='h:1' is refused by `inferhal generate`"):
        cfg_of("parallel=dep2", "parallel.front=h:1", command="generate")


def test_the_cli_refuses_before_anything_spawns(capsys):
    from inferhal.core.cli.main import main

    assert main(["serve", "model=deepseek_v4_tiny", "parallel=dep2", "parallel.dp_balance=least"]) == 2
    err = capsys.readouterr().err
    assert "parallel.dp_balance must be one of" in err and "Traceback" not in err


def test_the_cli_refuses_too_few_redundant_experts_for_elastic_ep_from_config_json(tmp_path, monkeypatch, capsys):
    """An HF checkpoint's config.json declares its routed experts: too small an eplb.num_redundant_experts for
    eplb.survive_rank_loss is refused by the CLI before any DP rank is spawned (it was refused by the ranks)."""
    from inferhal.core.cli.main import main
    from inferhal.core.server import dp_serve

    def no_group(*a, **k):
        raise AssertionError("a DP group was started")

    monkeypatch.setattr(dp_serve.DPGroup, "__init__", no_group)
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4", "n_routed_experts": 16}')
    over = ["serve", "model=deepseek_v4_flash", f"model.path={tmp_path}", "parallel=dep2", "eplb=default",
            "eplb.survive_rank_loss=true"]
    assert main([*over, "eplb.num_redundant_experts=2"]) == 2
    err = capsys.readouterr().err
    assert "eplb.num_redundant_experts >= 16 (the model's routed experts, its n_routed_experts" in err
    assert "got 2" in err and "Traceback" not in err
    assert check_dp_of([*over[1:], "eplb.num_redundant_experts=16"]) == 2  # 32 slots: passes the checks


def check_dp_of(over):
    from inferhal.core.cli.main import compose
    from inferhal.core.server.serve import check_dp

    return check_dp(compose(over, command="serve"))


@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_the_front_waits_parallel_start_timeout_s_for_its_ranks(launcher, monkeypatch):
    """DPGroup gives up on ranks that did not start within parallel.start_timeout_s, under either launcher: local
    ranks that never say hello (stand-ins: the tiny model's real ranks can start within the 0.5 s), or no rank
    connected to parallel.front (torchrun). Nothing is spawned."""
    import time
    from multiprocessing import Pipe

    from inferhal.core.parallel.launch import free_port
    from inferhal.core.server import dp_serve

    class Silent:  # a spawned rank still loading: alive, no hello
        exitcode = None

        def __init__(self):
            self.alive = True

        def is_alive(self):
            return self.alive

        def kill(self):
            self.alive = False

        def join(self, timeout=None):
            pass

    pipes = []

    def spawn(self):
        pipes[:] = [Pipe() for _ in range(self.dp)]  # both ends kept: no EOF reads as an exit
        self.ranks = [dp_serve._Rank(Silent(), mine) for mine, _ in pipes]
        self.state, self._started = "starting", time.monotonic()

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("INFERHAL_DP_KEY", "k")
    over = ["parallel=dep2", "parallel.start_timeout_s=0.5"]
    if launcher == "torchrun":
        over += ["parallel.launcher=torchrun", f"parallel.front=127.0.0.1:{free_port()}"]
        words = r"0/2 DP ranks connected to parallel.front within parallel.start_timeout_s=0.5 s"
    else:
        monkeypatch.setattr(dp_serve.DPGroup, "_spawn", spawn)
        words = r"the DP ranks did not start within parallel.start_timeout_s=0.5 s"
    cfg = cfg_of(*over)
    assert check_dp_of(["model=deepseek_v4_tiny", *over]) == 2
    t0 = time.monotonic()
    with pytest.raises(UserError, match=words):
        dp_serve.DPGroup(cfg)
    assert 0.5 <= time.monotonic() - t0 < 30  # not the 600 s default
