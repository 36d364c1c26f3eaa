"""One prefill or decode instance of disaggregated serving: load the model, listen for the router, serve it.

``inferhal serve parallel.role=prefill`` (or ``decode``) runs :func:`serve_instance` in the foreground on
any host; ``inferhal serve parallel.role=pd`` spawns one of each with :func:`spawned`. An instance serves
one router at a time (:func:`.workers.serve_router`). When its router goes away, every request it held is
aborted and every KV link dropped, and it waits for the next router: a router can be restarted, or moved,
without reloading any weights.

At connect the instance says hello (:func:`hello`): its role, its KV description
(:func:`~.handoff.describe`: model, block size, every KV group's format), the port of its KV link store
(decode), its limits and its tokenizer, so the router validates and tokenizes requests without loading
the model.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from typing import Any, Callable, Optional

log = logging.getLogger("inferhal.disagg")


def load(role: str, cfg: Any) -> Any:
    """This role's engine over the model loaded here."""
    from inferhal.core.config import schema
    from inferhal.core.disagg.handoff import side
    from inferhal.core.engine.engine import Engine
    from inferhal.core.engine.llm import LLM, _to

    llm = LLM.from_config(cfg)
    e = llm.engine
    return Engine(e.loaded, e.backend, e.scheduler.cfg, _to(schema.CacheConfig, cfg.cache), e.max_model_len,
                  seed=int(cfg.seed), spec=_to(schema.SpecConfig, cfg.spec), transfer=side(role))


def capacity_tokens(eng: Any) -> int:
    """The longest request (prompt + max_tokens, at most ``max_model_len``) whose KV fits this pool."""
    def fits(total: int) -> bool:
        return not eng.scheduler.kv_short(total)

    lo, hi = 0, int(eng.max_model_len)
    if fits(hi):
        return hi
    while lo + 1 < hi:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def hello(role: str, eng: Any, kv_port: Optional[int]) -> dict:
    from inferhal.core.disagg.handoff import describe

    s = eng.scheduler.cfg
    return {"role": role, "pid": os.getpid(), "describe": describe(eng), "kv_port": kv_port,
            "tokenizer": eng.tokenizer, "limits": {
                "max_model_len": int(eng.max_model_len), "vocab_size": int(eng.model.vocab_size),
                "eos_token_ids": list(eng.eos_token_ids), "chunked_prefill": bool(s.chunked_prefill),
                "max_num_batched_tokens": int(s.max_num_batched_tokens), "capacity_tokens": capacity_tokens(eng)}}


def serve_instance(role: str, cfg: Any, key: bytes, announce: Callable[[str, Any], None],
                   once: bool = False, alive: Callable[[], bool] = lambda: True) -> None:
    """Load, listen on ``disagg.listen``, and serve routers one after another (``once``: the first only,
    as a spawned instance does). ``announce(kind, arg)`` says ``("listening", (port, kv_port))`` when the
    router may connect."""
    from multiprocessing import AuthenticationError

    from inferhal.core.disagg.link import Locked, kv_store, listen, parse_address, reader
    from inferhal.core.disagg.workers import serve_router
    from inferhal.core.config.values import timeout_of

    timeout_s = timeout_of(cfg.parallel)
    host, port = parse_address(cfg.disagg.listen, "disagg.listen")
    listener = listen((host, port), key)  # before the load: a taken port fails at once
    try:
        store = kv_store(host, int(cfg.disagg.kv_port), timeout_s) if role == "decode" else None
        eng = load(role, cfg)
        kv_port = int(store.port) if store is not None else None
        announce("listening", (int(listener.address[1]), kv_port))
        while alive():
            try:
                conn = listener.accept()
            except AuthenticationError:
                log.warning("a connection to this %s instance was refused: it did not hold the shared key", role)
                continue
            except (EOFError, OSError) as exc:  # a client gone before its handshake (e.g. a router that gave up)
                log.warning("a connection to this %s instance ended before its handshake: %s", role, exc)
                time.sleep(0.05)
                continue
            conn = Locked(conn)
            ctl: "queue.Queue" = queue.Queue()
            try:
                conn.send(("hello", hello(role, eng, kv_port)))
            except OSError:
                conn.close()
                continue
            reader(conn, ctl, f"inferhal-{role}-router")
            try:
                why = serve_router(role, eng, store, ctl, conn, heartbeat_s=timeout_s / 4, alive=alive)
            except OSError:  # a send to a router that went away (its requests were aborted on the way out)
                why = "router_gone"
            conn.close()
            if once or why == "stop":
                return
            print(f"[serve] {role} instance: the router went away; its requests here were aborted; waiting for a "
                  f"router", file=sys.stderr, flush=True)
    finally:
        listener.close()


def end_with_parent() -> None:
    """End this spawned process (``os._exit(0)``) when its parent is gone (a thread polls twice a second)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="inferhal-parent-watch", daemon=True).start()


def spawned(role: str, cfg_dict: dict, key: bytes, out: Any) -> None:
    """The body of a process spawned by the router of ``parallel.role=pd``: an instance on a loopback port that
    serves its parent's router once. ``out`` (a pipe end) carries ``("listening", ports)`` or ``("error",
    why)``; the process ends with its parent and with ``os._exit`` (gloo's threads can abort an
    interpreter's finalization after the work succeeded)."""
    from omegaconf import OmegaConf

    end_with_parent()
    try:
        serve_instance(role, OmegaConf.create(cfg_dict), key, lambda kind, arg: out.send((kind, arg)), once=True)
    except BaseException as exc:  # noqa: BLE001 - said to the router, which fails with it
        try:
            out.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        os._exit(0)
