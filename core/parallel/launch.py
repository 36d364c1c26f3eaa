"""Launching EP ranks: ``parallel.launcher=local`` spawns ``world_size`` processes itself (gloo on
127.0.0.1, a free port); ``launcher=torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) means this process is already one rank.

Each rank of a host runs on its own device: ``backend.device_index + LOCAL_RANK`` (:func:`device_index`).
torchrun sets ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; the local launcher sets them in each rank it spawns
(:func:`enter_rank`), as torchrun does, because a rank selects its backend (and so its device) before its
layout reaches the backend's communicator.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Mapping

from inferhal.core import procs
from inferhal.core.backend import ParallelLayout
from inferhal.core.config.values import timeout_of
from inferhal.core.errors import UserError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LOCAL_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")  # this rank's place on its host (torchrun's names)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def world_size_of(parallel: Any) -> int:
    """Processes a layout needs: EP ranks (attention replicated on them, or one DP attention rank each)
    times TP."""
    tp, ep = int(parallel.tp), int(parallel.ep)
    if tp < 1 or ep < 1:
        raise UserError(f"parallel.tp and parallel.ep must be >= 1, got tp={tp}, ep={ep}")
    return tp * ep


def check_layout(parallel: Any, env: Mapping[str, str] | None = None, front: bool = False) -> int:
    """Refuse, before any process starts, every layout this build cannot run; returns the world size.

    Checked: tp, ep, dp >= 1; tp = 1 (no tensor parallelism); dp = 1 (attention replicated on every EP
    rank) or dp = ep (DP attention × EP MoE, one attention rank per EP rank, as ``dep8`` = DP8 × EP8);
    role = any (no prefill/decode disaggregation); ``timeout_s`` > 0; the launcher; under torchrun, that the
    environment is complete and its ``WORLD_SIZE`` matches the layout. ``front``: this process is the front
    ``inferhal serve`` puts before torchrun-launched ranks (core/server/dp_link.py), itself no rank: no
    torchrun environment is needed.
    """
    env = os.environ if env is None else env
    world = world_size_of(parallel)
    dp = int(getattr(parallel, "dp", 1))
    if dp < 1:
        raise UserError(f"parallel.dp must be >= 1, got {dp}")
    if int(parallel.tp) != 1:
        raise UserError(f"parallel.tp={parallel.tp}: tensor parallelism is not supported yet (use parallel.tp=1)")
    if dp != 1 and dp != int(parallel.ep):
        raise UserError(f"parallel.dp={dp} with parallel.ep={parallel.ep}: data-parallel attention runs one "
                        f"attention rank per EP rank (parallel.dp = parallel.ep, e.g. parallel=dep8 is DP8 x EP8) "
                        f"or none (parallel.dp=1: attention replicated on the EP ranks)")
    role = str(getattr(parallel, "role", "any"))
    if role != "any":
        raise UserError(f"parallel.role={role!r}: prefill/decode disaggregation is not supported yet (use parallel.role=any)")
    timeout_of(parallel)
    launcher = str(parallel.launcher)
    if launcher not in ("local", "torchrun"):
        raise UserError(f"parallel.launcher must be local|torchrun, got {launcher!r}")
    if launcher == "local" and world > 1:  # the rendezvous the spawned ranks meet at
        addr, port = str(getattr(parallel, "master_addr", "") or ""), int(getattr(parallel, "master_port", 0))
        if not addr:
            raise UserError(f"parallel.master_addr is empty: the {world} ranks need a rendezvous address "
                            f"(127.0.0.1 on one host)")
        if not 0 <= port <= 65535:
            raise UserError(f"parallel.master_port={port} is not a TCP port (0 = any free port, else 1..65535)")
    from_env = layout_from_env(parallel, env)  # checks WORLD_SIZE against the layout
    if launcher == "torchrun" and from_env is None and not front:
        raise UserError("parallel.launcher=torchrun but RANK/WORLD_SIZE are not set: run under torchrun, "
                        "or use parallel.launcher=local")
    return world


def layout_from_env(parallel: Any, env: Mapping[str, str] | None = None) -> ParallelLayout | None:
    """The layout torchrun describes in the environment, or None when ``RANK`` is not set."""
    env = os.environ if env is None else env
    if "RANK" not in env:
        return None
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise UserError(f"RANK is set but {', '.join(missing)} is not: launch with torchrun or set all of "
                        f"{', '.join(TORCHRUN_VARS)}")
    world = int(env["WORLD_SIZE"])
    want = world_size_of(parallel)
    if world != want:
        raise UserError(f"WORLD_SIZE={world} but parallel.tp x parallel.ep = {want}; start {want} processes "
                        f"(torchrun --nproc-per-node {want}) or change parallel=")
    local, here = host_place(env)
    return ParallelLayout(world_size=world, rank=int(env["RANK"]), tp=int(parallel.tp), ep=int(parallel.ep),
                          dp=int(parallel.dp), master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
                          timeout_s=timeout_of(parallel), local_rank=local, local_world_size=here)


def host_place(env: Mapping[str, str] | None = None) -> tuple[int | None, int | None]:
    """(``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) from the environment, or None for each that is not set; a value
    that is no index is a :class:`UserError` naming the variable."""
    env = os.environ if env is None else env
    got: list[int | None] = []
    for var in LOCAL_VARS:
        raw = env.get(var)
        try:
            got.append(None if raw is None else int(raw))
        except ValueError:
            raise UserError(f"{var}={raw!r} is not an integer (torchrun sets it: the rank's place on its host)") from None
    local, here = got
    if local is not None and not 0 <= local < (here or local + 1):
        raise UserError(f"LOCAL_RANK={local} is outside LOCAL_WORLD_SIZE={here}")
    return local, here


def device_index(base: int, count: Callable[[], int], kind: str, env: Mapping[str, str] | None = None) -> int:
    """The device this process runs on: ``base`` (``backend.device_index``) plus its rank's place on this host
    (``LOCAL_RANK``); ``base`` itself in a single process. ``count()``: the devices this process sees (asked only
    when ranks share the host). A host with fewer devices than ``base`` + its ranks is a :class:`UserError`
    naming the fields: collective libraries refuse two ranks on one device."""
    env = os.environ if env is None else env
    local, here = host_place(env)
    if local is None:
        world = env.get("WORLD_SIZE", "1")
        if world.isdigit() and int(world) > 1:  # a launcher that told the rank its place in the world, not on its host
            raise UserError(f"WORLD_SIZE={world} is set but LOCAL_RANK is not: each rank of a host needs its own "
                            f"{kind} device (backend.device_index + LOCAL_RANK); launch with torchrun, or set "
                            f"LOCAL_RANK and LOCAL_WORLD_SIZE for each rank")
        return base
    here = here or local + 1
    have = int(count())
    if base + here > have:
        raise UserError(f"this host runs {here} ranks (LOCAL_WORLD_SIZE; parallel.tp x parallel.ep ranks in all), "
                        f"each on its own {kind} device from backend.device_index={base}: devices {base}..{base + here - 1} "
                        f"are needed, but {kind} reports {have}. Run fewer ranks on this host (a smaller parallel.ep / "
                        f"parallel.dp, or torchrun --nproc-per-node), or lower backend.device_index")
    return base + local


def enter_rank(layout: ParallelLayout) -> None:
    """Tell this (spawned) process its place on the host as torchrun would (``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE`` from ``layout.on_host()``), before it selects a backend: the backend reads its device
    from them (:func:`device_index`)."""
    local, here = layout.on_host()
    os.environ.update({"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(here)})


def rank_layout(layout: ParallelLayout, rank: int) -> ParallelLayout:
    """Rank ``rank`` of ``layout`` as the local launcher spawns it: every rank on this host."""
    from dataclasses import replace

    return replace(layout, rank=rank, local_rank=rank, local_world_size=layout.world_size)


def teardown() -> None:
    """End this rank's process group cleanly: wait for the peers, then destroy it. A rank that exits with
    its group alive can abort at interpreter exit ("terminate called without an active exception") while
    its collective threads are still joinable, failing a run that had succeeded."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _exit_now() -> None:
    """End a spawned rank that finished cleanly without the interpreter's finalization: gloo's worker threads
    may still hold work objects whose tensors need the GIL while the interpreter is torn down, which aborts
    the process (SIGABRT, "terminate called without an active exception") after its work succeeded, about one
    spawn in five here. Output is flushed first; nothing of a rank is left for exit handlers."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)


def _entry(rank: int, fn: Callable, layout: ParallelLayout, args: tuple) -> None:
    layout = rank_layout(layout, rank)
    enter_rank(layout)
    fn(layout, *args)
    teardown()
    _exit_now()


def launch(fn: Callable[..., Any], parallel: Any, *args: Any, env: Mapping[str, str] | None = None) -> None:
    """Run ``fn(layout, *args)`` on every rank.

    :func:`check_layout` first. torchrun (``parallel.launcher == "torchrun"`` or ``RANK`` in the
    environment): call ``fn`` once here.
    local: spawn ``tp * ep`` processes (``fn`` and ``args`` must be picklable), wait for all; a rank that
    fails makes the launch raise with its traceback. ``world_size == 1`` runs ``fn`` in this process.
    """
    world = check_layout(parallel, env)  # every refusal comes before a process starts
    from_env = layout_from_env(parallel, env)
    if from_env is not None:
        fn(from_env, *args)
        teardown()
        return
    port = int(parallel.master_port) or free_port()
    layout = ParallelLayout(world_size=world, rank=0, tp=int(parallel.tp), ep=int(parallel.ep),
                            dp=int(parallel.dp), master_addr=str(parallel.master_addr), master_port=port,
                            timeout_s=timeout_of(parallel))
    if world == 1:
        fn(layout, *args)
        return
    import torch.multiprocessing as mp

    mp.start_processes(procs.entry(_entry), args=(fn, layout, args), nprocs=world, join=True,
                       start_method=procs.method())


def _file_entry(rank: int, path: str, name: str, layout: ParallelLayout, args: tuple) -> None:
    import importlib.util

    layout = rank_layout(layout, rank)
    enter_rank(layout)
    spec = importlib.util.spec_from_file_location(f"_inferhal_worker_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    getattr(mod, name)(layout, *args)
    teardown()
    _exit_now()


def spawn_from_file(path: str, name: str, world_size: int, *args: Any, port: int = 0) -> None:
    """Spawn ``world_size`` local ranks running ``name(layout, *args)`` from the Python file ``path``
    (for tests and tools whose modules are not importable by name in a child process)."""
    import torch.multiprocessing as mp

    layout = ParallelLayout(world_size=world_size, rank=0, ep=world_size, master_port=port or free_port())
    mp.start_processes(procs.entry(_file_entry), args=(path, name, layout, args), nprocs=world_size, join=True,
                       start_method=procs.method())
