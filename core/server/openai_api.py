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
from inferhal.core.server.protocol import APIError, Job, parse
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
    ids, subs = await svc.start(job)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    detoks = [Detokenizer(svc.tok, job.sampling.get("stop", [])) for _ in subs]
    if job.stream:
        return StreamingResponse(_stream(svc, job, ids, subs, rid, created, detoks), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    k = job.logprobs
    texts = [""] * len(subs)
    lps: list[list[dict]] = [[] for _ in subs]
    reasons: list[Optional[str]] = [None] * len(subs)
    n_out = [0] * len(subs)

    async def collect():
        async for i, d in svc.events(subs):
            n_out[i] += len(d.token_ids)
            if k is not None:
                lps[i] += logprob_entries(svc.tok, d.token_ids, d.logprobs, k)
            texts[i] += detoks[i].step(d)
            if d.finished:
                reasons[i] = d.finish_reason

    if await run_until_disconnect(request, collect(), svc, subs) is None:
        return Response(status_code=499)
    choices = []
    for i in range(len(subs)):
        if chat:
            c = {"index": i, "message": {"role": "assistant", "content": texts[i]},
                 "logprobs": {"content": lps[i]} if k is not None else None, "finish_reason": reasons[i]}
        else:
            c = {"index": i, "text": texts[i], "logprobs": completion_logprobs(lps[i], 0) if k is not None else None,
                 "finish_reason": reasons[i]}
        choices.append(c)
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": svc.settings.model_name, "choices": choices,
                         "usage": svc.usage(len(ids), sum(n_out))})


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
            if not text and not d.finished and not entries:
                continue
            reason = d.finish_reason if d.finished else None
            if chat:
                c = {"index": i, "delta": {"content": text} if text else {},
                     "logprobs": {"content": entries} if entries is not None else None, "finish_reason": reason}
            else:
                c = {"index": i, "text": text, "logprobs": completion_logprobs(entries, offsets[i])
                     if entries is not None else None, "finish_reason": reason}
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
