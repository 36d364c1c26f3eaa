"""What every route shares: the API key, the body limit, a request's prompt ids and sampling params, its
admission into the :class:`~.async_engine.AsyncEngine`, and the merged stream of its choices' outputs.

One :class:`Service` per app, at ``app.state.service``; the route handlers (:mod:`.openai_api`) are
module-level functions that read it from the request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import Request

from inferhal.core.errors import EngineDead, UserError
from inferhal.core.server.async_engine import AsyncEngine, Draining, QueueFull
from inferhal.core.server.protocol import APIError, Job
from inferhal.core.server.tools import prompt, reasoning
from inferhal.core.server.tools.choice import ChoiceParser
from inferhal.core.server.tools.constrain import constraint
from inferhal.core.server.tools.formats import call_format, reasoning_of
from inferhal.core.structured.grammar import GrammarError


#: a 429's (queue full) and a draining server's 503's Retry-After, in seconds
RETRY = {"Retry-After": "1"}


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: Optional[str] = None
    max_body_bytes: int = 1_048_576
    version: str = "0"
    reasoning_parser: Optional[str] = None  # think | none | None (the model family's own)


class Service:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings, metrics=None) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.eng = engine.engine
        self.tok = self.eng.tokenizer
        self.max_len = self.eng.max_model_len
        self._key = settings.api_key.encode() if settings.api_key else None
        family = getattr(getattr(self.eng, "loaded", None), "family", None)
        self.fmt = call_format(family)  # the model family's tool-call format
        self.reasoning = reasoning_of(family, settings.reasoning_parser)  # split <think> reasoning from content

    @staticmethod
    def of(request: Request) -> "Service":
        return request.app.state.service

    # -- the request ------------------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        if self._key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].encode() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "").encode()
        if not hmac.compare_digest(given, self._key):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY, or x-api-key: KEY)",
                           code="invalid_api_key")

    async def read_json(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
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
        except (ValueError, RecursionError) as exc:  # (RecursionError: nested deeper than json can read)
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    # -- prompt and params ------------------------------------------------------------------------
    def check_model(self, job: Job) -> None:
        if job.model != self.settings.model_name:
            raise APIError(404, f"the model {job.model!r} does not exist; this server serves "
                                f"{self.settings.model_name!r}", "model", "model_not_found")

    def chat_prompt(self, job: Job) -> str:
        """A chat job's prompt text; sets ``job.thinking`` (where its reasoning starts, when the server splits
        reasoning): the ``thinking`` / ``enable_thinking`` template argument if given, else whether the
        template left a ``<think>`` block open."""
        text = prompt.render(self.tok, job.messages, self.fmt, job.tools, job.template_kwargs)
        if self.reasoning:
            kw = job.template_kwargs
            given = kw.get("thinking", kw.get("enable_thinking"))
            job.thinking = bool(given) if given is not None else text.rstrip().endswith(reasoning.OPEN)
        return text

    def prompt_ids(self, job: Job) -> list[int]:
        tok, max_len = self.tok, self.max_len
        try:
            if job.chat:
                ids = tok.encode(self.chat_prompt(job), add_bos=False)
            elif isinstance(job.prompt, str):
                ids = tok.encode(job.prompt)
            else:
                ids = list(job.prompt)
                bad = [t for t in ids if not 0 <= t < self.eng.model.vocab_size]
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

    def sampling(self, job: Job, n_prompt: int, i: int):
        from inferhal.core.sampling.params import SamplingParams

        kw = dict(job.sampling)
        if "seed" in kw and i:
            kw["seed"] = kw["seed"] + i
        kw["max_tokens"] = job.max_tokens if job.max_tokens is not None else self.max_len - n_prompt
        if job.logprobs is not None:
            kw["logprobs"] = max(1, job.logprobs)
        try:
            return SamplingParams(**kw)
        except UserError as exc:
            raise APIError(400, str(exc), self.param_of(exc, job)) from None

    @staticmethod
    def param_of(exc: Exception, job: Job) -> str:
        """The body field an engine-side refusal is about: the sampling field its message names
        (``SamplingParams.seed ...``), else the prompt (its length against the KV pool or the queue bound)."""
        named = re.match(r"SamplingParams\.(\w+)", str(exc))
        if named:
            return named.group(1)
        return "messages" if job.chat else "prompt"

    # -- admission and outputs --------------------------------------------------------------------
    def check_choices(self, job: Job, prompt_len: int) -> None:
        """A 400 naming ``n`` for choices the server could never queue at once (more requests than
        ``server.max_queued_requests``, or more prompt tokens than ``server.max_queued_tokens``): retrying, which a
        429 asks for, would never help."""
        eng, tokens = self.engine, job.n * prompt_len
        bound = eng.max_queued_tokens
        if job.n > eng.max_queued or (job.n > 1 and bound is not None and tokens > bound):
            raise APIError(400, f"n={job.n} choices of a {prompt_len}-token prompt are {job.n} requests and {tokens} "
                                f"prompt tokens, more than the server queues at once (server.max_queued_requests="
                                f"{eng.max_queued}, server.max_queued_tokens={bound})", "n")

    async def start(self, job: Job) -> tuple[list[int], list[tuple[str, asyncio.Queue]]]:
        """Admit ``job``'s ``n`` choices → (prompt ids, [(request id, its Delta queue)])."""
        self.check_model(job)
        ids = self.prompt_ids(job)
        if job.tools is not None and job.tools.forced:
            job.sampling["structured"] = constraint(job.tools, self.fmt, bool(job.thinking))
            job.structured_field = "tools"
        self.check_choices(job, len(ids))
        subs: list[tuple[str, asyncio.Queue]] = []
        try:
            if job.n > 1:  # the n choices fit together, or none is admitted (one goes through submit's own checks)
                self.engine.check_room(job.n, job.n * len(ids))
            for i in range(job.n):
                subs.append(await self.engine.submit(ids, self.sampling(job, len(ids), i), job.timeout_s,
                                                     session=job.session))
        except BaseException as exc:
            for rid, _ in subs:
                self.engine.abort(rid)
            if isinstance(exc, QueueFull):
                raise APIError(429, str(exc), code="queue_full", headers=RETRY) from None
            if isinstance(exc, Draining):
                raise APIError(503, "the server is shutting down; retry on another", code="shutting_down",
                               headers=RETRY) from None
            if isinstance(exc, EngineDead):
                raise APIError(503, f"the engine is not running: {exc}", code="engine_dead") from None
            if isinstance(exc, GrammarError):
                raise APIError(400, str(exc), job.structured_field) from None
            if isinstance(exc, UserError):
                raise APIError(400, str(exc), self.param_of(exc, job)) from None
            raise
        return ids, subs

    def parser(self, job: Job) -> ChoiceParser:
        """A chat choice's reasoning/content/tool-call parser."""
        active = job.tools is not None and job.tools.active
        return ChoiceParser(job.thinking if self.reasoning else None, self.fmt if active else None)

    def abort(self, subs) -> None:
        for rid, _ in subs:
            self.engine.abort(rid)

    @staticmethod
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

    @staticmethod
    def usage(n_prompt: int, n_out: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
