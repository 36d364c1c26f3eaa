"""core/server/dp_link.py alone (no model, no rank process): which config fields a torchrun-launched rank must share
with its front, how a difference is named, and what the front refuses; a remote rank reads as gone once its
connection ends; a rank with no front to join fails naming the address after parallel.timeout_s."""

from __future__ import annotations

import pytest

from inferhal.core.errors import UserError


def node(*over):
    from omegaconf import OmegaConf

    from inferhal.core.cli.main import compose

    return OmegaConf.to_container(compose(["model=deepseek_v4_tiny", "parallel=dep2", *over], command="serve"),
                                  resolve=True)


def test_the_fields_compared_are_those_that_change_what_a_rank_computes():
    from inferhal.core.server.dp_link import differences, numerics

    base = numerics(node())
    assert {"cache.num_blocks", "scheduler.max_num_seqs", "seed", "deterministic", "parallel.dp",
            "parallel.dp_balance", "model.name", "eplb.enabled", "spec.method"} <= set(base)
    assert not [k for k in base if k.startswith(("server.", "parallel.front", "parallel.master", "parallel.timeout"))]
    assert "model.path" not in base  # each host's copy of the weights
    assert numerics(node("server.port=1234", "parallel.timeout_s=5", "model.path=/elsewhere")) == base
    assert differences(base, numerics(node("cache.num_blocks=64", "scheduler.max_num_seqs=3"))) == [
        "cache.num_blocks=64 (the front has 0)", "scheduler.max_num_seqs=3 (the front has 64)"]
    assert differences({"a": 1}, {"b": 2}) == ["a=nothing (the front has 1)", "b=2 (the front has nothing)"]


@pytest.mark.parametrize("join, words", [
    (dict(world_size=4), "WORLD_SIZE=4 but the front serves parallel.dp=2 ranks"),
    (dict(rank=-1), "RANK=-1 is outside the front's 2 ranks"),
    (dict(rank=0), "RANK=0 is already connected (pid 7 on h); is another torchrun group"),
    (dict(config={"seed": 1}), "its config differs from the front's in what it computes: seed=1 (the front has 0)"),
    (dict(rank=1), None),
])
def test_refusal(join, words):
    from inferhal.core.server.dp_link import refusal

    msg = refusal({"rank": 1, "world_size": 2, "config": {"seed": 0}, **join}, 2, {"seed": 0}, {0: "pid 7 on h"})
    assert msg == words if words is None else words in msg
    assert "not a join" in refusal(None, 2, {}, {})


def test_a_remote_rank_is_gone_once_its_connection_ends():
    from multiprocessing import Pipe

    from inferhal.core.server.dp_link import RemoteRank

    front, rank = Pipe()
    remote = RemoteRank(front, {"pid": 3, "host": "h"})
    rank.send(("stepped", None))  # a message waiting to be read is no end
    assert remote.is_alive() and str(remote) == "pid 3 on h"
    front.recv()
    rank.close()
    assert not remote.is_alive()
    remote.kill()
    assert not remote.is_alive()


def test_a_rank_with_no_front_fails_naming_the_address():
    from inferhal.core.parallel.launch import free_port
    from inferhal.core.server.dp_link import join_front

    port = free_port()
    with pytest.raises(UserError, match=rf"no DP front answered at 127.0.0.1:{port} \(parallel.front\) within "
                                        r"parallel.timeout_s=1 s"):
        join_front(("127.0.0.1", port), b"k", {"rank": 0}, timeout_s=1.0)


def test_the_door_greets_a_rank_while_a_silent_peer_waits_and_cuts_that_peer_off(monkeypatch):
    """A connection that never answers the key check holds up no rank behind it, and is closed after JOIN_WAIT_S;
    a rank with another key is refused by the check; the rank's join arrives whole."""
    import socket
    import threading
    import time

    from inferhal.core.parallel.launch import free_port
    from inferhal.core.server import dp_link

    monkeypatch.setattr(dp_link, "JOIN_WAIT_S", 1.0)
    door = dp_link.Door(("127.0.0.1", free_port()), b"right")
    try:
        silent = socket.create_connection(door.address)
        with pytest.raises(UserError, match="refused this rank's key: set INFERHAL_DP_KEY"):
            dp_link.join_front(door.address, b"wrong", {"rank": 0}, timeout_s=5)
        got = []
        rank = threading.Thread(target=lambda: got.append(dp_link.join_front(door.address, b"right", {"rank": 1},
                                                                             timeout_s=10)))
        rank.start()
        deadline = time.monotonic() + 10
        while not door.waiting() and time.monotonic() < deadline:
            time.sleep(0.02)
        (conn, join), = door.take()
        assert join == {"rank": 1}
        conn.send(("welcome", ("10.0.0.2", 29600)))
        rank.join(10)
        assert got[0][1] == ("10.0.0.2", 29600)
        silent.settimeout(5)
        data = silent.recv(4096)  # the challenge, then the end: cut off after JOIN_WAIT_S
        while data:
            data = silent.recv(4096)
        assert not door.waiting()
    finally:
        door.close()
