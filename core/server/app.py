"""The ASGI app (FastAPI): OpenAI's completions and chat completions over an :class:`AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE when ``stream``: one
``data: {chunk}`` event per output, ``data: [DONE]`` last), ``GET /v1/models``, ``GET /health`` (503 once
the engine loop has died; under ``parallel.role=pd`` each process's state, ``degraded`` when one is dead), ``GET /version``, ``GET /metrics`` (Prometheus text).

Text: each choice decodes its tokens without special tokens; while it runs, text that could still be
cut (a trailing partial UTF-8 character, the last ``len(longest stop) - 1`` characters) is held back,
so the streamed deltas joined equal the non-stream text, and ``finish_reason`` comes only in a choice's
last chunk. ``n`` choices are ``n`` engine requests (seeds ``seed + i``), sharing the prompt's prefix
cache. A client that disconnects aborts its requests, which frees their KV blocks before the next step.
Every error is OpenAI's schema (:class:`~.protocol.APIError`); ``/v1/*`` needs
``Authorization: Bearer KEY`` when a key is set (compared in constant time).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferhal.core.errors import UserError
from inferhal.core.server.async_engine import AsyncEngine, EngineDead, QueueFull
from inferhal.core.server.protocol import APIError, Job, parse
from inferhal.core.structured.grammar import GrammarError


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: Optional[str] = None
    max_body_bytes: int = 1_048_576
    version: str = "0"


class Detokenizer:
    """A choice's text as its tokens arrive (see the module docstring for what is held back)."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def _text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        safe = self._text().rstrip("\ufffd")
        safe = safe[:max(0, len(safe) - self.hold)] if self.hold else safe
        if len(safe) > len(self.sent) and safe.startswith(self.sent):
            delta, self.sent = safe[len(self.sent):], safe
            return delta
        return ""

    def finish(self, ids: list[int], reason: Optional[str]) -> str:
        self.ids.extend(ids)
        text = self._text()
        if reason == "stop" and self.stop:
            cut = min((text.find(s) for s in self.stop if s in text), default=-1)
            if cut >= 0:
                text = text[:cut]
        delta = text[len(self.sent):] if text.startswith(self.sent) else text
        self.sent = text
        return delta


def _logprob_entries(tok, ids: list[int], lps: list[dict[int, float]], k: int) -> list[dict]:
    out = []
    for t, lp in zip(ids, lps):
        s = tok.decode([t])
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        out.append({"token": s, "logprob": float(lp.get(t, float("-inf"))), "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [{"token": tok.decode([i]), "logprob": float(v),
                                      "bytes": list(tok.decode([i]).encode("utf-8"))} for i, v in top]})
    return out


def _completion_logprobs(entries: list[dict], offset: int) -> dict:
    offsets, pos = [], offset
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def build_app(engine: AsyncEngine, settings: ServerSettings, metrics=None) -> FastAPI:
    app = FastAPI(title="inferhal", version=settings.version, docs_url=None, redoc_url=None, openapi_url=None)
    eng = engine.engine
    tok = eng.tokenizer
    max_len = eng.max_model_len
    key = settings.api_key.encode() if settings.api_key else None

    def error(exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return error(APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        return error(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    def check_key(request: Request) -> None:
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].encode() if auth[:7].lower() == "bearer " else b""
        if not hmac.compare_digest(given, key):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        limit = settings.max_body_bytes
        too_big = APIError(413, f"request body is larger than server.max_body_bytes={limit}", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    def prompt_ids(job: Job) -> list[int]:
        try:
            if job.chat:
                ids = tok.encode(tok.apply_chat_template(job.messages, add_generation_prompt=True), add_bos=False)
            elif isinstance(job.prompt, str):
                ids = tok.encode(job.prompt)
            else:
                ids = list(job.prompt)
                bad = [t for t in ids if not 0 <= t < eng.model.vocab_size]
                if bad:
                    raise APIError(400, f"token id {bad[0]} is outside the vocabulary", "prompt")
        except UserError as exc:
            raise APIError(400, str(exc), "messages" if job.chat else "prompt") from None
        n = len(ids)
        if n >= max_len:
            raise APIError(400, f"this model's maximum context length is {max_len} tokens; the prompt has {n} "
                                f"(at most {max_len - 1})", "messages" if job.chat else "prompt",
                           "context_length_exceeded")
        if job.max_tokens is not None and n + job.max_tokens > max_len:
            raise APIError(400, f"this model's maximum context length is {max_len} tokens; the prompt has {n} and "
                                f"max_tokens asks for {job.max_tokens}", "max_tokens", "context_length_exceeded")
        return ids

    def sampling(job: Job, n_prompt: int, i: int):
        from inferhal.core.sampling.params import SamplingParams

        kw = dict(job.sampling)
        if "seed" in kw and i:
            kw["seed"] = kw["seed"] + i
        kw["max_tokens"] = job.max_tokens if job.max_tokens is not None else max_len - n_prompt
        if job.logprobs is not None:
            kw["logprobs"] = max(1, job.logprobs)
        try:
            return SamplingParams(**kw)
        except UserError as exc:
            raise APIError(400, str(exc)) from None

    async def start(job: Job) -> tuple[list[int], list[tuple[str, asyncio.Queue]]]:
        if job.model != settings.model_name:
            raise APIError(404, f"the model {job.model!r} does not exist; this server serves "
                                f"{settings.model_name!r}", "model", "model_not_found")
        ids = prompt_ids(job)
        subs: list[tuple[str, asyncio.Queue]] = []
        try:
            for i in range(job.n):
                subs.append(await engine.submit(ids, sampling(job, len(ids), i)))
        except BaseException as exc:
            for rid, _ in subs:
                engine.abort(rid)
            if isinstance(exc, QueueFull):
                raise APIError(429, str(exc), code="queue_full") from None
            if isinstance(exc, EngineDead):
                raise APIError(503, f"the engine is not running: {exc}", code="engine_dead") from None
            if isinstance(exc, GrammarError):
                raise APIError(400, str(exc), job.structured_field) from None
            if isinstance(exc, UserError):
                raise APIError(400, str(exc)) from None
            raise
        return ids, subs

    async def events(subs) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, Delta) as they come from every choice, until each has finished."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, q: asyncio.Queue) -> None:
            while True:
                d = await q.get()
                await merged.put((i, d))
                if isinstance(d, BaseException) or d.finished:
                    return

        tasks = [asyncio.create_task(pump(i, q)) for i, (_, q) in enumerate(subs)]
        left = len(subs)
        try:
            while left:
                i, d = await merged.get()
                if isinstance(d, BaseException):
                    raise APIError(503, f"the engine stopped: {d}", code="engine_dead")
                if d.finished:
                    left -= 1
                yield i, d
        finally:
            for t in tasks:
                t.cancel()

    def usage(n_prompt: int, n_out: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    async def complete(request: Request, chat: bool):
        check_key(request)
        job = parse(await read_json(request), chat)
        ids, subs = await start(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        detoks = [Detokenizer(tok, job.sampling.get("stop", [])) for _ in subs]
        k = job.logprobs
        if job.stream:
            return StreamingResponse(stream(job, ids, subs, rid, created, detoks), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts = [""] * len(subs)
        lps: list[list[dict]] = [[] for _ in subs]
        reasons: list[Optional[str]] = [None] * len(subs)
        n_out = [0] * len(subs)
        done = False
        gen = events(subs)

        async def collect():
            nonlocal done
            async for i, d in gen:
                n_out[i] += len(d.token_ids)
                if k is not None:
                    lps[i] += _logprob_entries(tok, d.token_ids, d.logprobs, k)
                texts[i] += detoks[i].finish(d.token_ids, d.finish_reason) if d.finished else detoks[i].push(d.token_ids)
                if d.finished:
                    reasons[i] = d.finish_reason
            done = True

        task = asyncio.create_task(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    return Response(status_code=499)
            task.result()
        finally:
            if not done:
                for r, _ in subs:
                    engine.abort(r)
        choices = []
        for i in range(len(subs)):
            if chat:
                c = {"index": i, "message": {"role": "assistant", "content": texts[i]},
                     "logprobs": {"content": lps[i]} if k is not None else None, "finish_reason": reasons[i]}
            else:
                c = {"index": i, "text": texts[i], "logprobs": _completion_logprobs(lps[i], 0) if k is not None else None,
                     "finish_reason": reasons[i]}
            choices.append(c)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": settings.model_name, "choices": choices,
                             "usage": usage(len(ids), sum(n_out))})

    async def stream(job: Job, ids, subs, rid, created, detoks) -> AsyncIterator[str]:
        chat, k = job.chat, job.logprobs
        obj = "chat.completion.chunk" if chat else "text_completion"
        n_out, offsets = 0, [0] * len(subs)
        finished = set()

        def chunk(choices: list, usage_: Any = None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": settings.model_name, "choices": choices}
            if job.include_usage:
                body["usage"] = usage_
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(subs))])
            async for i, d in events(subs):
                n_out += len(d.token_ids)
                text = detoks[i].finish(d.token_ids, d.finish_reason) if d.finished else detoks[i].push(d.token_ids)
                entries = _logprob_entries(tok, d.token_ids, d.logprobs, k) if k is not None else None
                if not text and not d.finished and not entries:
                    continue
                reason = d.finish_reason if d.finished else None
                if chat:
                    c = {"index": i, "delta": {"content": text} if text else {},
                         "logprobs": {"content": entries} if entries is not None else None, "finish_reason": reason}
                else:
                    c = {"index": i, "text": text, "logprobs": _completion_logprobs(entries, offsets[i])
                         if entries is not None else None, "finish_reason": reason}
                    offsets[i] += len(text)
                if d.finished:
                    finished.add(i)
                yield chunk([c])
            if job.include_usage:
                yield chunk([], usage(len(ids), n_out))
        except APIError as exc:  # the engine died mid-stream: the error as a last event
            yield f"data: {json.dumps(exc.body())}\n\n"
        finally:
            for i, (r, _) in enumerate(subs):
                if i not in finished:
                    engine.abort(r)
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                             "owned_by": "inferhal", "max_model_len": max_len}]}

    @app.get("/health")
    async def health():
        if not engine.alive:
            why = f"{type(engine.dead).__name__}: {engine.dead}" if engine.dead else "not running"
            return JSONResponse({"status": "dead", "reason": why}, status_code=503)
        roles = eng.health() if callable(getattr(type(eng), "health", None)) else None  # parallel.role=pd
        if roles is None:
            return {"status": "ok"}
        return {"status": "ok" if all(v == "ok" for v in roles.values()) else "degraded", "roles": roles}

    @app.get("/version")
    async def version():
        return {"version": settings.version}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render() if metrics else b"", media_type=CONTENT_TYPE_LATEST)

    return app
