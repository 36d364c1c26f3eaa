"""OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions``: module-level route handlers over the
app's :class:`~.service.Service`.

JSON, or SSE when ``stream`` (one ``data: {chunk}`` event per output, ``data: [DONE]`` last); ``n``
choices are ``n`` engine requests; ``finish_reason`` comes only in a choice's last chunk. A client that
disconnects aborts its requests, which frees their KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferhal.core.server.detok import Detokenizer, completion_logprobs, logprob_entries
from inferhal.core.server.protocol import APIError, Job, parse, session_of
from inferhal.core.server.service import Service

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def completions(request: Request):
    return await _complete(request, chat=False)


async def chat_completions(request: Request):
    return await _complete(request, chat=True)


async def _complete(request: Request, chat: bool):
    svc = Service.of(request)
    svc.check_key(request)
    job = parse(await svc.read_json(request), chat)
    session_of(job, request.headers)
    ids, subs = await svc.start(job)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    detoks = [Detokenizer(svc.tok, job.sampling.get("stop", [])) for _ in subs]
    if job.stream:
        return StreamingResponse(_stream(svc, job, ids, subs, rid, created, detoks), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    k = job.logprobs
    parsers = [svc.parser(job) for _ in subs] if chat else None
    texts = [""] * len(subs)
    lps: list[list[dict]] = [[] for _ in subs]
    reasons: list[Optional[str]] = [None] * len(subs)
    n_out = [0] * len(subs)

    async def collect():
        async for i, d in svc.events(subs):
            n_out[i] += len(d.token_ids)
            if k is not None:
                lps[i] += logprob_entries(svc.tok, d.token_ids, d.logprobs, k)
            text = detoks[i].step(d)
            texts[i] += text
            if parsers:
                parsers[i].feed(text, end=d.finished)
            if d.finished:
                reasons[i] = d.finish_reason

    if await run_until_disconnect(request, collect(), svc, subs) is None:
        return Response(status_code=499)
    choices = []
    for i in range(len(subs)):
        if chat:
            out = parsers[i].total
            c = {"index": i, "message": message(out, svc.reasoning), "logprobs": {"content": lps[i]} if k is not None
                 else None, "finish_reason": finish_reason(reasons[i], out.calls)}
        else:
            c = {"index": i, "text": texts[i], "logprobs": completion_logprobs(lps[i], 0) if k is not None else None,
                 "finish_reason": reasons[i]}
        choices.append(c)
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": svc.settings.model_name, "choices": choices,
                         "usage": svc.usage(len(ids), sum(n_out))})


def message(out, reasoning: bool) -> dict:
    """A chat choice's message from its parsed output: content (None when it made calls and wrote no text),
    ``tool_calls`` when it made any, ``reasoning_content`` when the server splits reasoning."""
    m: dict = {"role": "assistant", "content": out.content if out.content or not out.calls else None}
    if out.calls:
        m["tool_calls"] = [c.openai() for c in out.calls]
    if reasoning:
        m["reasoning_content"] = out.reasoning or None
    return m


def finish_reason(reason: Optional[str], calls) -> Optional[str]:
    """``tool_calls`` for a choice that ended by itself after calling tools."""
    return "tool_calls" if calls and reason == "stop" else reason


async def run_until_disconnect(request: Request, work, svc: Service, subs) -> Optional[bool]:
    """Await ``work`` (a coroutine reading ``subs``' outputs), polling every 0.5 s whether the client left;
    → True when it finished, None when the client disconnected. Unfinished requests are aborted either way."""
    task = asyncio.create_task(work)
    done = False
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return None
        task.result()
        done = True
        return True
    finally:
        if not done:
            svc.abort(subs)


async def _stream(svc: Service, job: Job, ids, subs, rid, created, detoks) -> AsyncIterator[str]:
    chat, k, tok = job.chat, job.logprobs, svc.tok
    obj = "chat.completion.chunk" if chat else "text_completion"
    n_out, offsets = 0, [0] * len(subs)
    finished = set()
    parsers = [svc.parser(job) for _ in subs] if chat else None
    n_calls = [0] * len(subs)

    def chunk(choices: list, usage_: Any = None) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": svc.settings.model_name, "choices": choices}
        if job.include_usage:
            body["usage"] = usage_
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(subs))])
        async for i, d in svc.events(subs):
            n_out += len(d.token_ids)
            text = detoks[i].step(d)
            entries = logprob_entries(tok, d.token_ids, d.logprobs, k) if k is not None else None
            if chat:
                out = parsers[i].feed(text, end=d.finished)
                if not out and not d.finished and not entries:
                    continue
                delta: dict = {"content": out.content} if out.content else {}
                if out.reasoning:
                    delta["reasoning_content"] = out.reasoning
                if out.calls:
                    delta["tool_calls"] = [c.openai(n_calls[i] + j) for j, c in enumerate(out.calls)]
                    n_calls[i] += len(out.calls)
                reason = finish_reason(d.finish_reason, parsers[i].total.calls) if d.finished else None
                c = {"index": i, "delta": delta, "logprobs": {"content": entries} if entries is not None else None,
                     "finish_reason": reason}
            elif not text and not d.finished and not entries:
                continue
            else:
                c = {"index": i, "text": text, "logprobs": completion_logprobs(entries, offsets[i])
                     if entries is not None else None, "finish_reason": d.finish_reason if d.finished else None}
                offsets[i] += len(text)
            if d.finished:
                finished.add(i)
            yield chunk([c])
        if job.include_usage:
            yield chunk([], svc.usage(len(ids), n_out))
    except APIError as exc:  # the engine died mid-stream: the error as a last event
        yield f"data: {json.dumps(exc.body())}\n\n"
    finally:
        for i, (r, _) in enumerate(subs):
            if i not in finished:
                svc.engine.abort(r)
    yield "data: [DONE]\n\n"
