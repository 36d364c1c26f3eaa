"""``inferhal serve``: load the model, start the engine loop thread, serve HTTP with uvicorn until SIGTERM
or SIGINT.

Settings come from the ``server`` group (:class:`~inferhal.core.config.schema.ServerConfig`): the bind
address (``127.0.0.1`` unless ``server.host`` says otherwise), the served model name, the API key (or the
environment variable ``INFERHAL_API_KEY``), the body-size and admission limits (``max_queued_requests``,
``max_queued_tokens``), the default per-request deadline (``request_timeout_s``) and the reasoning parser.
``parallel.dp = parallel.ep > 1`` (``parallel=dep2``): the same server in front of DP attention x EP MoE rank
processes (:mod:`.dp_serve`), spawned here, or with ``parallel.launcher=torchrun`` started by torchrun on any
hosts with the same command line: there (``RANK`` set) the process is one rank, which connects to the front at
``parallel.front`` (:mod:`.dp_link`); without ``RANK`` it is the front, waiting for them.
On SIGTERM the server drains (:mod:`.drain`): new requests get 503 while admitted ones finish for up to
``server.shutdown_timeout_s`` (0: aborted at once), then the rest are aborted (their streams end), the
engine loop stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from contextlib import asynccontextmanager

from inferhal.core.errors import UserError
from inferhal.core.server.tools.formats import REASONING_PARSERS

API_KEY_ENV = "INFERHAL_API_KEY"


def settings_of(cfg, model_name: str):
    from inferhal.core.server.service import ServerSettings

    s = cfg.server
    if int(s.max_body_bytes) < 1024:
        raise UserError(f"server.max_body_bytes must be >= 1024, got {s.max_body_bytes}")
    if int(s.max_queued_requests) < 1:
        raise UserError(f"server.max_queued_requests must be >= 1, got {s.max_queued_requests}")
    if float(s.shutdown_timeout_s) < 0:
        raise UserError(f"server.shutdown_timeout_s must be >= 0, got {s.shutdown_timeout_s}")
    if s.max_queued_tokens is not None and int(s.max_queued_tokens) < 1:
        raise UserError(f"server.max_queued_tokens must be >= 1 (or null: no bound), got {s.max_queued_tokens}")
    if s.request_timeout_s is not None and float(s.request_timeout_s) <= 0:
        raise UserError(f"server.request_timeout_s must be > 0 (or null: no deadline), got {s.request_timeout_s}")
    if s.reasoning_parser is not None and str(s.reasoning_parser) not in REASONING_PARSERS:
        raise UserError(f"server.reasoning_parser must be one of {', '.join(REASONING_PARSERS)} (or null: the model "
                        f"family's own), got {s.reasoning_parser!r}")
    if not 0 <= int(s.port) < 65536:
        raise UserError(f"server.port must be in [0, 65535], got {s.port}")
    key = s.api_key if s.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        from importlib.metadata import version

        ver = version("inferhal")
    except Exception:
        ver = "0"
    return ServerSettings(model_name=str(s.served_model_name or model_name), api_key=key,
                          max_body_bytes=int(s.max_body_bytes), version=ver,
                          reasoning_parser=None if s.reasoning_parser is None else str(s.reasoning_parser))


def make_app(llm, cfg):
    """(FastAPI app, AsyncEngine) over a built :class:`~inferhal.core.engine.llm.LLM`; the engine loop
    starts and stops with the app's lifespan."""
    if llm.tokenizer is None:
        raise UserError("inferhal serve needs a model with a tokenizer (text in, text out)")
    app, engine = _app(llm.engine, cfg, str(cfg.model.name))
    llm.served_by = engine  # its generate/stream/chat are refused while the server's loop thread runs the engine
    return app, engine


def make_router_app(cfg, router=None):
    """``parallel.role=pd`` or ``router``: (FastAPI app, AsyncEngine) over a
    :class:`~inferhal.core.disagg.router.Router` (built here unless given), which loads no weights; the
    served model is the instances' (their hello names it). ``cfg`` as :func:`check_roles` passed it (`serve`
    checks it first)."""
    from inferhal.core.disagg.router import Router

    if router is None:
        router = Router(cfg, spawn=str(cfg.parallel.role) == "pd")
    if router.tokenizer is None:
        router.close()
        raise UserError("inferhal serve needs a model with a tokenizer (text in, text out)")
    model = next(i.hello["describe"]["model"] for i in router.insts.values() if i.hello is not None)
    return _app(router, cfg, str(model))


def make_dp_app(cfg, group=None):
    """``parallel.dp > 1`` (``parallel=dep2``): (FastAPI app, AsyncEngine) over a
    :class:`~inferhal.core.server.dp_serve.DPGroup` of DP rank processes (spawned here unless given; this
    process loads no weights). ``cfg`` as :func:`check_dp` passed it."""
    from inferhal.core.server.dp_serve import DPGroup

    if group is None:
        group = DPGroup(cfg)
    if group.tokenizer is None:
        group.close()
        raise UserError("inferhal serve needs a model with a tokenizer (text in, text out)")
    from inferhal.core.server.dp_metrics import DPMetrics

    app, engine = _app(group, cfg, str(group.loaded.name))
    group.metrics = DPMetrics(engine.metrics.registry, app.state.model_name, group.dp)
    return app, engine


#: the parallel fields `inferhal serve` reads only with data-parallel attention (parallel.dp > 1)
DP_FIELDS = ("parallel.launcher", "parallel.master_addr", "parallel.master_port", "parallel.tbo",
             "parallel.dp_balance", "parallel.dp_balance_margin", "parallel.restarts", "parallel.front",
             "parallel.start_timeout_s")


def check_dp(cfg) -> int:
    """Refuse, before anything loads or spawns, a parallel layout `serve` cannot run; → ``parallel.dp``.
    ``parallel.dp = parallel.ep > 1`` (DP attention x EP MoE) runs; the DP fields are refused otherwise."""
    from omegaconf import OmegaConf

    from inferhal.core.config.refusals import default_of
    from inferhal.core.parallel.dp_balance import POLICIES

    p = cfg.parallel
    dp, ep = int(p.dp), int(p.ep)
    if dp <= 1:
        if ep > 1:
            raise UserError(f"parallel.ep={ep} with parallel.dp={dp}: `inferhal serve` runs expert parallelism with "
                            f"data-parallel attention (parallel.dp = parallel.ep, e.g. parallel=dep2); attention "
                            f"replicated on the EP ranks (parallel=ep2) runs in `inferhal generate` only")
        for name in (*DP_FIELDS, *(f"eplb.{f}" for f in cfg.eplb)):
            value = OmegaConf.select(cfg, name)
            if value != default_of(name):
                raise UserError(f"{name}={value!r} is read by `inferhal serve` only with data-parallel attention "
                                f"(parallel.dp > 1, e.g. parallel=dep2); got parallel.dp={dp}")
        return max(dp, 1)
    launcher = str(p.launcher)
    if launcher == "torchrun":  # the front (no RANK) or one rank: both need the front's address and the key
        from inferhal.core.server.dp_link import front_address, key_of

        front_address(p)
        for name in ("parallel.master_addr", "parallel.master_port"):
            value = OmegaConf.select(cfg, name)
            if value != default_of(name):
                raise UserError(f"{name}={value!r} is read with parallel.launcher=local only: under torchrun the ranks "
                                f"meet at a store rank 0 opens on its host (torchrun's MASTER_ADDR)")
        key_of()
    elif str(p.front):
        raise UserError(f"parallel.front={p.front!r} is read with parallel.launcher=torchrun only (the ranks torchrun "
                        f"starts connect there); parallel.launcher={launcher} spawns the ranks on this host")
    if str(p.dp_balance) not in POLICIES:
        raise UserError(f"parallel.dp_balance must be one of {', '.join(POLICIES)}, got {p.dp_balance!r}")
    if int(p.dp_balance_margin) < 0:
        raise UserError(f"parallel.dp_balance_margin must be >= 0 (tokens), got {p.dp_balance_margin}")
    if int(p.restarts) < 0:
        raise UserError(f"parallel.restarts must be >= 0, got {p.restarts}")
    if not float(p.start_timeout_s) > 0:
        raise UserError(f"parallel.start_timeout_s must be > 0 (seconds the front waits for the DP ranks to start), "
                        f"got {p.start_timeout_s}")
    from inferhal.core.parallel.ep_generate import check_ranks

    # the layout, the spec config, the backend, experts that divide, synchronous scheduling
    check_ranks(cfg, front=launcher == "torchrun" and "RANK" not in os.environ)
    return dp


def _app(inner, cfg, model_name: str):
    from inferhal.core.server.app import build_app
    from inferhal.core.server.async_engine import AsyncEngine
    from inferhal.core.server.metrics import ServerMetrics

    settings = settings_of(cfg, model_name)
    metrics = ServerMetrics(settings.model_name)
    s = cfg.server
    engine = AsyncEngine(inner, int(s.max_queued_requests), metrics,
                         max_queued_tokens=None if s.max_queued_tokens is None else int(s.max_queued_tokens),
                         request_timeout_s=None if s.request_timeout_s is None else float(s.request_timeout_s))
    app = with_lifespan(build_app(engine, settings, metrics), engine)
    app.state.model_name = settings.model_name
    return app, engine


#: ``parallel.role`` values of ``inferhal serve``; the ``disagg`` fields each reads (any other non-default
#: ``disagg`` field is refused, naming the role that reads it)
ROLES = {"any": (), "pd": ("restarts",), "prefill": ("listen", "authkey"), "decode": ("listen", "kv_port", "authkey"),
         "router": ("prefill", "decode", "authkey", "reconnect_s")}


def check_roles(cfg) -> None:
    """Refuse, before anything loads, spawns or connects, a role or a ``disagg`` setting `serve` cannot honour."""
    from inferhal.core.config.refusals import default_of
    from inferhal.core.config.values import timeout_of

    role = str(cfg.parallel.role)
    if role not in ROLES:
        raise UserError(f"parallel.role={role!r}: `inferhal serve` runs {', '.join(ROLES)} (any = one engine; pd = one "
                        f"launch: a router here, a prefill and a decode process spawned; prefill | decode = one "
                        f"instance; router = a router in front of disagg.prefill and disagg.decode)")
    for name in ("prefill", "decode", "listen", "kv_port", "authkey", "restarts", "reconnect_s"):
        value = cfg.disagg[name]
        if name not in ROLES[role] and value != default_of(f"disagg.{name}"):
            readers = [r for r, fields in ROLES.items() if name in fields]
            raise UserError(f"disagg.{name}={value!r} is read by parallel.role={'|'.join(readers)} only, not by "
                            f"parallel.role={role}")
    if role == "any":
        return
    if bool(cfg.scheduler.async_scheduling) and role in ("pd", "prefill", "decode"):
        raise UserError(f"parallel.role={role} runs with scheduler.async_scheduling=false (the prefill engine reads a "
                        f"request's KV for its hand-off right after the step that sampled its first token)")
    if int(cfg.parallel.ep) > 1 or int(cfg.parallel.dp) > 1:
        raise UserError(f"parallel.role={role}: each prefill or decode instance is one engine process (parallel.ep=1, "
                        f"parallel.dp=1); got parallel.ep={cfg.parallel.ep}, parallel.dp={cfg.parallel.dp}")
    timeout_of(cfg.parallel)  # > 0 (the KV links' timeout and heartbeat, the router's silence limit)
    if int(cfg.disagg.restarts) < 0:
        raise UserError(f"disagg.restarts must be >= 0, got {cfg.disagg.restarts}")
    if float(cfg.disagg.reconnect_s) < 0:
        raise UserError(f"disagg.reconnect_s must be >= 0 (0 = never), got {cfg.disagg.reconnect_s}")
    if role == "router":
        from inferhal.core.disagg.link import authkey_of, parse_address

        if not cfg.disagg.prefill and not cfg.disagg.decode:
            raise UserError("parallel.role=router needs its instances: disagg.prefill=[host:port,...] and "
                            "disagg.decode=[host:port,...]")
        for r in ("prefill", "decode"):
            for i, text in enumerate(cfg.disagg[r]):
                parse_address(text, f"disagg.{r}[{i}]")
        authkey_of(cfg)
    if role in ("prefill", "decode"):
        from inferhal.core.disagg.link import authkey_of, parse_address

        parse_address(cfg.disagg.listen, "disagg.listen")
        if not 0 <= int(cfg.disagg.kv_port) < 65536:
            raise UserError(f"disagg.kv_port must be in [0, 65535], got {cfg.disagg.kv_port}")
        authkey_of(cfg)


def serve_instance(cfg) -> int:
    """``parallel.role=prefill|decode``: one instance in the foreground, serving routers until SIGTERM (``cfg``
    as :func:`check_roles` passed it)."""
    from inferhal.core.disagg.instance import serve_instance as run
    from inferhal.core.disagg.link import authkey_of

    role = str(cfg.parallel.role)

    def announce(kind, arg):
        port, kv_port = arg
        host = str(cfg.disagg.listen).rpartition(":")[0]
        kv = f"; KV link store on port {kv_port}" if kv_port is not None else ""
        print(f"[serve] {role} instance of {cfg.model.name}: waiting for a router on {host}:{port}{kv}",
              file=sys.stderr, flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM):  # an instance holds nothing to save: the router retries elsewhere
        signal.signal(sig, lambda num, frame: os._exit(0))
    run(role, cfg, authkey_of(cfg), announce)
    return 0


def with_lifespan(app, engine):
    """``app`` with the engine loop starting and stopping in its lifespan (on the server's event loop)."""
    @asynccontextmanager
    async def lifespan(_app):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            engine.stop()
            close = getattr(engine.engine, "close", None)  # a router's prefill and decode processes
            if close is not None:
                close()

    app.router.lifespan_context = lifespan
    return app


def serve(cfg, llm=None) -> int:
    import uvicorn

    from inferhal.core.server.drain import FLUSH_S, DrainingServer

    from inferhal.core.engine.llm import LLM

    check_roles(cfg)
    role = str(cfg.parallel.role)
    if role in ("prefill", "decode"):
        return serve_instance(cfg)
    settings_of(cfg, str(cfg.model.name))  # bad server settings fail before the model loads
    dp = check_dp(cfg)
    if role in ("pd", "router"):
        app, engine = make_router_app(cfg)
    elif dp > 1 and str(cfg.parallel.launcher) == "torchrun" and "RANK" in os.environ:
        from inferhal.core.server.dp_rank import torchrun_main

        return torchrun_main(cfg)  # one rank, started by torchrun: it serves the front at parallel.front
    elif dp > 1:
        app, engine = make_dp_app(cfg)
    else:
        if llm is None:
            llm = LLM.from_config(cfg)
        app, engine = make_app(llm, cfg)
    s = cfg.server
    config = uvicorn.Config(app, host=str(s.host), port=int(s.port), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=FLUSH_S, lifespan="on")
    server = DrainingServer(config, engine, float(s.shutdown_timeout_s))
    # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown; with handlers of our own in place
    # that re-raise lands here instead of killing the process, so a graceful stop exits 0
    stopped = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda num, frame: stopped.append(num))

    async def announce():
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else s.port
        name = app.state.model_name
        print(f"[serve] {name} on http://{s.host}:{port}/v1 (OpenAI and Anthropic APIs; /health, /metrics)",
              file=sys.stderr, flush=True)

    async def main():
        task = asyncio.create_task(announce())
        await server.serve()
        task.cancel()

    try:
        asyncio.run(main())
    except SystemExit:  # uvicorn exits 1 when it cannot bind (it has said why)
        pass
    if not server.started:
        raise UserError(f"could not listen on {s.host}:{s.port} (see the message above)")
    return 0
