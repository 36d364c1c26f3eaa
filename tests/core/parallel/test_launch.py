from types import SimpleNamespace

import pytest

from inferhal.core.errors import UserError
from inferhal.core.parallel.launch import free_port, launch, layout_from_env


def par(**kw):
    base = dict(tp=1, ep=2, dp=1, launcher="local", master_addr="127.0.0.1", master_port=0)
    base.update(kw)
    return SimpleNamespace(**base)


def test_torchrun_environment_gives_the_layout():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    lay = layout_from_env(par(launcher="torchrun"), env)
    assert (lay.rank, lay.world_size, lay.ep, lay.master_addr, lay.master_port) == (1, 2, 2, "10.0.0.1", 1234)
    assert layout_from_env(par(), {}) is None


def test_torchrun_environment_must_match_the_layout():
    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(UserError, match="WORLD_SIZE=4 but parallel.tp x parallel.ep = 2"):
        layout_from_env(par(), env)
    with pytest.raises(UserError, match="MASTER_ADDR, MASTER_PORT is not"):
        layout_from_env(par(), {"RANK": "0", "WORLD_SIZE": "2"})


def test_launch_under_torchrun_runs_this_rank_only():
    seen = []
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    launch(lambda lay, tag: seen.append((lay.rank, tag)), par(launcher="torchrun"), "x", env=env)
    assert seen == [(1, "x")]
    with pytest.raises(UserError, match="RANK/WORLD_SIZE are not set"):
        launch(lambda lay: None, par(launcher="torchrun"), env={})
    with pytest.raises(UserError, match="launcher must be local|torchrun"):
        launch(lambda lay: None, par(launcher="mpirun"), env={})


def test_dp_equal_to_ep_is_a_layout_of_ep_ranks(monkeypatch):
    from inferhal.core.parallel.launch import check_layout

    assert check_layout(par(dp=2), env={}) == 2  # dep2: one attention rank per EP rank
    assert check_layout(par(ep=8, dp=8), env={}) == 8  # dep8 = DP8 x EP8: 8 processes


def test_single_rank_runs_in_process():
    seen = []
    launch(lambda lay: seen.append(lay.world_size), par(ep=1), env={})
    assert seen == [1] and 1024 < free_port() < 65536


@pytest.mark.parametrize("kw,needle", [
    (dict(tp=4), "parallel.tp=4: tensor parallelism is not supported yet"),
    (dict(dp=4), "parallel.dp=4 with parallel.ep=2: data-parallel attention runs one attention rank per EP rank"),
    (dict(master_addr=""), "parallel.master_addr is empty: the 2 ranks need a rendezvous address"),
    (dict(master_port=70000), "parallel.master_port=70000 is not a TCP port"),
    (dict(role="prefill"), "parallel.role='prefill': prefill/decode disaggregation"),
    (dict(ep=0), "must be >= 1"),
    (dict(dp=0), "parallel.dp must be >= 1"),
    (dict(launcher="mpirun"), "launcher must be local|torchrun"),
    (dict(launcher="torchrun"), "RANK/WORLD_SIZE are not set"),
])
def test_a_layout_is_refused_before_any_process_starts(kw, needle, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: pytest.fail("spawned processes for a refused layout"))
    with pytest.raises(UserError, match=needle):
        launch(lambda lay: pytest.fail("ran a rank of a refused layout"), par(**kw), env={})
