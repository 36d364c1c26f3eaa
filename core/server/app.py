"""The ASGI app (FastAPI): OpenAI's completions and chat completions and Anthropic's Messages API over an
:class:`AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (:mod:`.openai_api`), ``POST /v1/messages``,
``POST /v1/messages/count_tokens`` (:mod:`.anthropic_api`), ``GET /v1/models``,
``GET /health`` (503 once the engine loop has died, or ``draining`` while SIGTERM drains it; under
``parallel.role=pd`` each process's state, ``degraded`` when one is dead; under ``parallel.dp > 1`` each DP
rank's, 503 ``down`` while the group restarts), ``GET /version``, ``GET /metrics``
(Prometheus text).

Every handler is a module-level function reading the app's :class:`~.service.Service` from
``request.app.state.service``. Every error is OpenAI's schema (:class:`~.errors.APIError`), Anthropic's on
``/v1/messages*``; ``/v1/*`` needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` when a key is set
(compared in constant time).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferhal.core.server import anthropic_api, openai_api
from inferhal.core.server.async_engine import AsyncEngine
from inferhal.core.server.protocol import APIError
from inferhal.core.server.service import ServerSettings, Service

__all__ = ["ServerSettings", "build_app"]

ANTHROPIC_PREFIX = "/v1/messages"


def build_app(engine: AsyncEngine, settings: ServerSettings, metrics=None) -> FastAPI:
    app = FastAPI(title="inferhal", version=settings.version, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = Service(engine, settings, metrics)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.add_api_route("/v1/completions", openai_api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"])
    app.add_api_route(ANTHROPIC_PREFIX, anthropic_api.messages, methods=["POST"])
    app.add_api_route(ANTHROPIC_PREFIX + "/count_tokens", anthropic_api.count_tokens, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    return app


# -- errors ---------------------------------------------------------------------------------------
def error_response(request: Request, exc: APIError) -> JSONResponse:
    """OpenAI's error shape, or Anthropic's on the Messages routes."""
    anthropic = request.url.path.startswith(ANTHROPIC_PREFIX)
    return JSONResponse(exc.anthropic_body() if anthropic else exc.body(), status_code=exc.status,
                        headers=exc.headers or None)


async def _api_error(request: Request, exc: APIError):
    return error_response(request, exc)


async def _http_error(request: Request, exc: StarletteHTTPException):
    return error_response(request, APIError(exc.status_code, str(exc.detail),
                                            code="not_found" if exc.status_code == 404 else None))


async def _internal(request: Request, exc: Exception):
    return error_response(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


# -- the small routes -----------------------------------------------------------------------------
async def models(request: Request):
    svc = Service.of(request)
    svc.check_key(request)
    return {"object": "list", "data": [{"id": svc.settings.model_name, "object": "model", "created": 0,
                                         "owned_by": "inferhal", "max_model_len": svc.max_len}]}


async def health(request: Request):
    svc = Service.of(request)
    engine = svc.engine
    if not engine.alive:
        why = f"{type(engine.dead).__name__}: {engine.dead}" if engine.dead else "not running"
        return JSONResponse({"status": "dead", "reason": why}, status_code=503)
    if engine.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    eng = svc.eng
    roles = eng.health() if callable(getattr(type(eng), "health", None)) else None  # parallel.role=pd, parallel.dp > 1
    if roles is None:
        return {"status": "ok"}
    down = getattr(eng, "down", None)  # parallel.dp > 1: why the DP group is out of service (it restarts)
    if down:
        return JSONResponse({"status": "down", "reason": down, "roles": roles}, status_code=503)
    return {"status": "ok" if all(v == "ok" for v in roles.values()) else "degraded", "roles": roles}


async def version(request: Request):
    return {"version": Service.of(request).settings.version}


async def prometheus(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST

    metrics = Service.of(request).metrics
    return Response(metrics.render() if metrics else b"", media_type=CONTENT_TYPE_LATEST)
