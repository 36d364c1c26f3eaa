"""``inferhal serve``: load the model, start the engine loop thread, serve HTTP with uvicorn until SIGTERM
or SIGINT.

Settings come from the ``server`` group (:class:`~inferhal.core.config.schema.ServerConfig`): the bind
address (``127.0.0.1`` unless ``server.host`` says otherwise), the served model name, the API key (or the
environment variable ``INFERHAL_API_KEY``), the body-size and queue limits. On SIGTERM the server stops
accepting connections, lets in-flight requests finish for ``server.shutdown_timeout_s``, aborts the
rest (their streams end), stops the engine loop and exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from contextlib import asynccontextmanager

from inferhal.core.errors import UserError

API_KEY_ENV = "INFERHAL_API_KEY"


def settings_of(cfg, model_name: str):
    from inferhal.core.server.app import ServerSettings

    s = cfg.server
    if int(s.max_body_bytes) < 1024:
        raise UserError(f"server.max_body_bytes must be >= 1024, got {s.max_body_bytes}")
    if int(s.max_queued_requests) < 1:
        raise UserError(f"server.max_queued_requests must be >= 1, got {s.max_queued_requests}")
    if float(s.shutdown_timeout_s) < 0:
        raise UserError(f"server.shutdown_timeout_s must be >= 0, got {s.shutdown_timeout_s}")
    if not 0 <= int(s.port) < 65536:
        raise UserError(f"server.port must be in [0, 65535], got {s.port}")
    key = s.api_key if s.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        from importlib.metadata import version

        ver = version("inferhal")
    except Exception:
        ver = "0"
    return ServerSettings(model_name=str(s.served_model_name or model_name), api_key=key,
                          max_body_bytes=int(s.max_body_bytes), version=ver)


def make_app(llm, cfg):
    """(FastAPI app, AsyncEngine) over a built :class:`~inferhal.core.engine.llm.LLM`; the engine loop
    starts and stops with the app's lifespan."""
    from inferhal.core.server.app import build_app
    from inferhal.core.server.async_engine import AsyncEngine
    from inferhal.core.server.metrics import ServerMetrics

    if llm.tokenizer is None:
        raise UserError("inferhal serve needs a model with a tokenizer (text in, text out)")
    settings = settings_of(cfg, str(cfg.model.name))
    metrics = ServerMetrics(settings.model_name)
    inner = disaggregated(llm, cfg) if str(cfg.parallel.role) != "any" else llm.engine
    engine = AsyncEngine(inner, int(cfg.server.max_queued_requests), metrics)
    llm.served_by = engine  # its generate/stream/chat are refused while the server's loop thread runs the engine
    return with_lifespan(build_app(engine, settings, metrics), engine), engine


def disaggregated(llm, cfg):
    """``parallel.role=pd``: this process serves HTTP and routes; a spawned prefill process prefills and a
    spawned decode process decodes (core/disagg/router.py). This process's engine only validates requests."""
    role = str(cfg.parallel.role)
    if role != "pd":
        raise UserError(f"parallel.role={role!r}: `inferhal serve` runs parallel.role=any (one engine) or "
                        f"parallel.role=pd (one launch: a router here, a prefill and a decode process spawned); "
                        f"prefill and decode as separate launches (on other hosts) are not implemented")
    if bool(cfg.scheduler.async_scheduling):
        raise UserError("parallel.role=pd runs with scheduler.async_scheduling=false (the prefill engine reads a "
                        "request's KV for its hand-off right after the step that sampled its first token)")
    if int(cfg.parallel.ep) > 1 or int(cfg.parallel.dp) > 1:
        raise UserError(f"parallel.role=pd runs one prefill and one decode process (parallel.ep=1, parallel.dp=1); "
                        f"got parallel.ep={cfg.parallel.ep}, parallel.dp={cfg.parallel.dp}")
    from inferhal.core.disagg.router import Router
    from inferhal.core.parallel.launch import timeout_of

    timeout_of(cfg.parallel)  # > 0, or refused before spawning (the two processes' group, and their heartbeat)

    return Router(llm.engine, cfg)


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

    from inferhal.core.engine.llm import LLM

    settings_of(cfg, str(cfg.model.name))  # bad server settings fail before the model loads
    if llm is None:
        llm = LLM.from_config(cfg)
    app, _ = make_app(llm, cfg)
    s = cfg.server
    config = uvicorn.Config(app, host=str(s.host), port=int(s.port), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=float(s.shutdown_timeout_s), lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown; with handlers of our own in place
    # that re-raise lands here instead of killing the process, so a graceful stop exits 0
    stopped = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda num, frame: stopped.append(num))

    async def announce():
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else s.port
        name = s.served_model_name or cfg.model.name
        print(f"[serve] {name} on http://{s.host}:{port}/v1 (OpenAI API; /health, /metrics)", file=sys.stderr,
              flush=True)

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
