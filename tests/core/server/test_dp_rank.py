"""core/server/dp_rank.py: a rank the DEP serve front spawns knows its place on the host (``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, as torchrun would tell it) before it builds its engine, so a device backend puts each rank
on its own accelerator (``backend.device_index + LOCAL_RANK``: core/parallel/launch.py's device_index)."""

from __future__ import annotations

import multiprocessing as mp
import os

from inferhal.core.backend import ParallelLayout
from inferhal.core.server import dp_rank


def _rank(layout: ParallelLayout, conn) -> None:
    def build(layout, cfg):  # what the rank's backend would read, said back instead of building an engine
        raise RuntimeError(f"{os.environ.get('LOCAL_RANK')}/{os.environ.get('LOCAL_WORLD_SIZE')}")

    dp_rank.build = build
    dp_rank.rank_main(layout, {}, conn)


def _place(layout: ParallelLayout) -> str:
    ctx = mp.get_context("fork")  # a child of its own: rank_main ends with os._exit
    here, there = ctx.Pipe()
    p = ctx.Process(target=_rank, args=(layout, there))
    p.start()
    kind, msg = here.recv()
    p.join(30)
    assert kind == "error" and p.exitcode == 1, (kind, msg, p.exitcode)
    return msg.split(": ", 1)[1]


def test_a_spawned_rank_knows_its_place_on_the_host_before_it_builds(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _place(ParallelLayout(world_size=2, rank=1, dp=2, ep=2)) == "1/2"  # the local launcher: all on this host
    # under torchrun the layout carries torchrun's place (rank 3 of 4, second of two on its host): kept
    assert _place(ParallelLayout(world_size=4, rank=3, dp=4, ep=4, local_rank=1, local_world_size=2)) == "1/2"
