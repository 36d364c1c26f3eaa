"""Anthropic's Messages API: ``POST /v1/messages`` (JSON, or SSE when ``stream``) and
``POST /v1/messages/count_tokens``, over the same engine, prompt rendering, tools and reasoning as the
OpenAI routes (:mod:`.anthropic_protocol` reads the body).

A reply's content blocks come in the order the model wrote them: ``thinking`` (its reasoning, where the
server splits reasoning; ``signature`` empty), ``text`` and ``tool_use`` (``input`` the call's arguments).
Streaming sends Anthropic's events: ``message_start``, then per block ``content_block_start``,
``content_block_delta`` (``text_delta`` / ``thinking_delta``; a tool call's ``input_json_delta`` carries its
whole JSON at once) and ``content_block_stop``, then ``message_delta`` (``stop_reason``, ``stop_sequence``,
``usage.output_tokens``) and ``message_stop``; the non-stream reply is built from the same blocks, so the
two are equal. ``stop_reason``: ``end_turn``, ``stop_sequence``, ``max_tokens``, ``tool_use``, or the
server's own ``timeout`` (the request's deadline) and ``abort``. Errors are Anthropic's shape
(:meth:`~.errors.APIError.anthropic_body`); the key comes as ``x-api-key`` or a bearer token. A session key
(placement on DP ranks, :mod:`.protocol`) comes in the ``X-Session-Id`` header.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferhal.core.server.anthropic_protocol import parse
from inferhal.core.server.detok import Detokenizer
from inferhal.core.server.errors import APIError
from inferhal.core.server.openai_api import SSE_HEADERS, run_until_disconnect
from inferhal.core.server.protocol import session_of
from inferhal.core.server.service import Service

STOP_REASONS = {"length": "max_tokens"}


class Blocks:
    """Content blocks as a choice's parsed output arrives; each :meth:`add` → the stream events it makes."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self.open = False

    def add(self, out) -> list[tuple[str, dict]]:
        ev: list[tuple[str, dict]] = []
        if out.reasoning:
            self._text("thinking", out.reasoning, ev)
        for item in out.items:
            if isinstance(item, str):
                self._text("text", item, ev)
                continue
            self._close(ev)
            block = {"type": "tool_use", "id": item.id, "name": item.name, "input": item.arguments}
            self.blocks.append(block)
            i = len(self.blocks) - 1
            ev.append(("content_block_start", {"index": i, "content_block": {**block, "input": {}}}))
            ev.append(("content_block_delta", {"index": i, "delta": {"type": "input_json_delta",
                                                                     "partial_json": item.arguments_json()}}))
            ev.append(("content_block_stop", {"index": i}))
        return ev

    def _text(self, kind: str, s: str, ev: list) -> None:
        last = self.blocks[-1] if self.open else None
        if last is None or last["type"] != kind:
            self._close(ev)
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            self.blocks.append(block)
            self.open = True
            ev.append(("content_block_start", {"index": len(self.blocks) - 1, "content_block": dict(block)}))
            last = block
        last[kind] += s
        delta = {"type": "thinking_delta", "thinking": s} if kind == "thinking" else {"type": "text_delta", "text": s}
        ev.append(("content_block_delta", {"index": len(self.blocks) - 1, "delta": delta}))

    def _close(self, ev: list) -> list:
        if self.open:
            ev.append(("content_block_stop", {"index": len(self.blocks) - 1}))
            self.open = False
        return ev


def stop_reason(reason: Optional[str], calls, matched_stop: Optional[str]) -> Optional[str]:
    if reason == "stop":
        return "tool_use" if calls else ("stop_sequence" if matched_stop is not None else "end_turn")
    return STOP_REASONS.get(reason, reason)


async def count_tokens(request: Request):
    svc = Service.of(request)
    svc.check_key(request)
    job = parse(await svc.read_json(request), count_only=True)
    svc.check_model(job)
    return {"input_tokens": len(svc.prompt_ids(job))}


async def messages(request: Request):
    svc = Service.of(request)
    svc.check_key(request)
    job = parse(await svc.read_json(request))
    session_of(job, request.headers)
    ids, subs = await svc.start(job)
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    detok = Detokenizer(svc.tok, job.sampling.get("stop", []))
    parser, blocks = svc.parser(job), Blocks()
    head = {"id": msg_id, "type": "message", "role": "assistant", "model": svc.settings.model_name}
    if job.stream:
        return StreamingResponse(_stream(svc, ids, subs, head, detok, parser, blocks), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    end: dict = {}

    async def collect():
        async for _, d in svc.events(subs):
            end["n"] = end.get("n", 0) + len(d.token_ids)
            blocks.add(parser.feed(detok.step(d), end=d.finished))
            if d.finished:
                end["reason"] = d.finish_reason

    if await run_until_disconnect(request, collect(), svc, subs) is None:
        return Response(status_code=499)
    return JSONResponse({**head, "content": blocks.blocks,
                         "stop_reason": stop_reason(end.get("reason"), parser.total.calls, detok.matched_stop),
                         "stop_sequence": detok.matched_stop,
                         "usage": {"input_tokens": len(ids), "output_tokens": end.get("n", 0)}})


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _stream(svc: Service, ids, subs, head, detok, parser, blocks):
    n_out, finished = 0, False
    try:
        yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                                   "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
        async for _, d in svc.events(subs):
            n_out += len(d.token_ids)
            for kind, data in blocks.add(parser.feed(detok.step(d), end=d.finished)):
                yield _event(kind, data)
            if d.finished:
                finished = True
                for kind, data in blocks._close([]):
                    yield _event(kind, data)
                reason = stop_reason(d.finish_reason, parser.total.calls, detok.matched_stop)
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": detok.matched_stop},
                                               "usage": {"output_tokens": n_out}})
                yield _event("message_stop", {})
    except APIError as exc:  # the engine died mid-stream: Anthropic's error event
        yield f"event: error\ndata: {json.dumps(exc.anthropic_body())}\n\n"
    finally:
        if not finished:
            svc.abort(subs)
