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
    (dict(timeout_s=0), "parallel.timeout_s=0 must be > 0"),
])
def test_a_layout_is_refused_before_any_process_starts(kw, needle, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: pytest.fail("spawned processes for a refused layout"))
    with pytest.raises(UserError, match=needle):
        launch(lambda lay: pytest.fail("ran a rank of a refused layout"), par(**kw), env={})


NEVER_JOINS = """
import time
from inferhal.backends.reference.comm import TorchDistCommunicator
from inferhal.core.backend import ParallelLayout
from inferhal.core.errors import UserError
from inferhal.core.parallel.launch import free_port
for rank in (0, 1):  # rank 0 waits for a rank 1 that never comes; rank 1 looks for a master that is not there
    t0 = time.monotonic()
    try:
        TorchDistCommunicator(ParallelLayout(world_size=2, rank=rank, master_port=free_port(), timeout_s=2))
        print("joined?!")
    except UserError as exc:
        print(f"{time.monotonic() - t0:.1f}", exc)
"""


def test_a_rank_that_never_joins_is_a_clear_error_within_the_timeout():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", NEVER_JOINS], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        secs, msg = line.split(" ", 1)
        assert float(secs) < 30
        assert msg.startswith(f"rank {rank} of 2: the gloo process group at tcp://127.0.0.1:")
        assert "did not form within parallel.timeout_s=2 s: a rank never joined" in msg


def test_generate_under_torchrun_with_a_node_that_never_joins_exits_2_with_the_message(tmp_path):
    """One torchrun-started rank of two (the other node never comes): a message and exit 2, no traceback."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    exe = os.path.join(os.path.dirname(sys.executable), "inferhal")
    p = subprocess.run([exe, "generate", "model=deepseek_v4_tiny", "prompt_ids=[1,2,3]", "parallel=ep2",
                        "parallel.launcher=torchrun", "parallel.timeout_s=3"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "rank 0 of 2: the gloo process group at tcp://127.0.0.1:" in p.stderr
    assert "parallel.timeout_s=3 s: a rank never joined" in p.stderr and "Traceback" not in p.stderr
