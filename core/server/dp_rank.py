"""One DP rank process of ``inferhal serve`` with data-parallel attention (``parallel=dep2``; the front is
:mod:`.dp_serve`).

The rank builds the configured engine, joins the ranks' gloo group through the backend's communicator and
becomes a DP attention × EP MoE rank (:func:`~inferhal.core.parallel.dp_engine.attach_dp`) behind a
:class:`~inferhal.core.parallel.dp_serve_engine.ServeDPEngine`. It then says hello on its pipe (rank 0 adds
what the front needs to validate and tokenize without weights: :func:`~inferhal.core.disagg.instance.hello`)
and serves the front, one message at a time:

- ``("step", (adds, aborts))``, sent to every rank alike: add the new requests ``(id, prompt ids, params,
  session key)``
  (each rank checks and queues them all; they are placed at the step), abort ``aborts`` (freed on the rank
  holding them), then run one step of the group when any rank has work (a rank without requests joins the
  step's MoE exchanges empty). Answer ``("stepped", (outputs, gauges, busy, failed))``: rank 0 every rank's
  outputs of the step, every rank its own gauges; ``busy``: some rank still has work; ``failed``: ``(id,
  why)`` of requests the checks refused.
- ``("probe", None)``: answer ``("probe", accounting)`` (this rank's KV accounting, no collective).
- ``("shrink", (lost, master_addr, master_port))``: go on without the ``lost`` ranks when their experts are
  covered (:func:`~inferhal.core.server.dp_elastic.rank_shrink`); answer ``("shrink", {"ok": ..., ...})``.
- ``("stop", None)``: leave the group together and exit (status 0); ``("stop", why)``: the group is broken (a
  peer died): exit with status 1 at once.

A step that fails at a collective (a peer died) is sent as ``("error", why)`` and the rank waits for the
front's ``shrink`` or ``stop``; anything else a step raises is sent the same way and the process exits with
status 1: the front restarts the whole group. The process also ends when its parent does.

Under ``parallel.launcher=torchrun`` (:func:`torchrun_main`) torchrun starts the rank, on any host, and the
"pipe" is a TCP connection to the front at ``parallel.front`` (:mod:`.dp_link`: the rank joins with its
``RANK``, ``WORLD_SIZE`` and config before it loads anything); a restart of the group is torchrun's (its
``--max-restarts``), and the new ranks connect again.
"""

from __future__ import annotations

import os
from typing import Any

from inferhal.core.backend import ParallelLayout
from inferhal.core.errors import UserError


def build(layout: ParallelLayout, cfg: Any) -> Any:
    """This rank's :class:`~inferhal.core.parallel.dp_serve_engine.ServeDPEngine` from the composed ``cfg``."""
    from inferhal.core.engine.llm import LLM
    from inferhal.core.parallel.dp_engine import attach_dp
    from inferhal.core.parallel.dp_serve_engine import ServeDPEngine

    llm = LLM.from_config(cfg)
    eng = llm.engine
    hook = attach_dp(eng, eng.backend.communicator(layout), cfg.eplb, tbo=bool(cfg.parallel.tbo))
    return ServeDPEngine(eng, hook, str(cfg.parallel.dp_balance), int(cfg.parallel.dp_balance_margin))


def serve_front(dpe: Any, conn: Any) -> Any:
    """Answer the front's messages (module docstring) until ``stop``; → the stop's reason (None: a clean end)."""
    from inferhal.core.disagg.workers import accounting
    from inferhal.core.parallel.sync import RankDivergenceError
    from inferhal.core.server.dp_elastic import rank_shrink

    eng, me = dpe.engine, dpe.comm.layout.rank
    while True:
        kind, arg = conn.recv()
        if kind == "stop":
            return arg
        if kind == "probe":
            conn.send(("probe", accounting(eng)))
            continue
        if kind == "shrink":  # a peer died: go on without it if its experts are covered (core/server/dp_elastic.py)
            conn.send(("shrink", rank_shrink(dpe, arg)))
            me = dpe.comm.layout.rank
            continue
        adds, aborts = arg
        failed = []
        for rid, prompt, params, session in adds:
            try:
                req = eng.make_request(prompt, params, request_id=rid)
                req.session = session  # placement keeps a session on its rank (dp_balance.Sessions)
                dpe.add(req)
            except (UserError, ValueError) as exc:  # the same on every rank: no rank queues it
                failed.append((rid, str(exc)))
        if aborts:
            dpe.abort(aborts)
        try:
            outs = dpe.step() if dpe.has_unfinished() else []
        except RankDivergenceError as exc:  # a peer is gone: the front shrinks the group or restarts it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("stepped", (outs if me == 0 else [], dpe.gauges(), dpe.has_unfinished(), failed)))


def rank_main(layout: ParallelLayout, cfg_node: dict, conn: Any) -> None:
    """The body of a spawned rank (see the module docstring); ends with ``os._exit`` (gloo's threads can
    abort an interpreter's finalization after the work succeeded)."""
    import torch
    from omegaconf import OmegaConf

    from inferhal.core.disagg.instance import end_with_parent
    from inferhal.core.parallel.launch import enter_rank

    end_with_parent()
    enter_rank(layout)  # LOCAL_RANK / LOCAL_WORLD_SIZE before the backend is chosen: its device (as torchrun says them)
    here = int(os.environ["LOCAL_WORLD_SIZE"])  # ranks on this host
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // here))  # the ranks share the cores this process may run on
    code = 0
    try:
        cfg = OmegaConf.create(cfg_node)
        dpe = build(layout, cfg)
        hello: dict = {"pid": os.getpid()}
        if layout.rank == 0:
            from inferhal.core.disagg.instance import hello as instance_hello

            hello = dict(instance_hello("any", dpe.engine, None), family=dpe.engine.loaded.family)
        conn.send(("hello", hello))
        if serve_front(dpe, conn) is not None:
            code = 1  # the group is broken: no barrier with the peers; torchrun restarts the group
        else:
            from inferhal.core.parallel.launch import teardown

            teardown()
    except BaseException as exc:  # noqa: BLE001 - said to the front, which restarts the group
        code = 1
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except (OSError, ValueError):
            pass
    finally:
        os._exit(code)


def torchrun_main(cfg: Any) -> int:
    """``inferhal serve parallel=depN parallel.launcher=torchrun`` run by torchrun (``RANK`` set): join the front
    at ``parallel.front``, then serve it as :func:`rank_main` does (the process ends there). A refused join
    raises a :class:`UserError` naming why (the CLI exits 2)."""
    import dataclasses
    import socket

    from omegaconf import OmegaConf

    from inferhal.core.config.values import timeout_of
    from inferhal.core.parallel.launch import free_port, layout_from_env
    from inferhal.core.server.dp_link import front_address, join_front, key_of, numerics

    layout = layout_from_env(cfg.parallel)
    node = OmegaConf.to_container(cfg, resolve=True)
    master = (layout.master_addr, free_port("")) if layout.rank == 0 else None
    join = {"rank": layout.rank, "world_size": layout.world_size, "config": numerics(node), "pid": os.getpid(),
            "host": socket.gethostname(), "master": master}
    conn, (addr, port) = join_front(front_address(cfg.parallel), key_of(), join, timeout_of(cfg.parallel))
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 hosts a new store at (addr, port): dp_link says why
    rank_main(dataclasses.replace(layout, master_addr=addr, master_port=port), node, conn)
    return 1  # not reached: rank_main ends the process
