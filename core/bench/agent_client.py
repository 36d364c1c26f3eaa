"""The agent bench's users: asyncio coroutines over the official ``openai`` client, each replaying sessions
turn by turn against an OpenAI-compatible ``/v1/chat/completions`` (streamed, ``stream_options.include_usage``),
timing every content chunk. Nothing server-specific: any OpenAI-compatible endpoint works.

At concurrency ``c``, ``c`` users run at once; user ``u`` replays sessions ``offset + u, offset + u + c, ...``
(modulo their number), each copy with its own salt (:meth:`Session.salted`), until the point's turn budget is taken:
a user starts a turn only while fewer than ``turns`` have been started, so a point runs a fixed number of
turns (the last sessions may stop early). After each answer the user waits the turn's think time. A turn that
fails (an HTTP error, a refused prompt) ends that user's session and is counted, not retried.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from inferhal.core.bench.agent_sessions import Session


@dataclass
class TurnResult:
    user: int
    session: str
    turn: int
    start: float = 0.0
    first: Optional[float] = None  # first content chunk
    end: float = 0.0
    times: list[float] = field(default_factory=list)  # every chunk with content
    prompt_tokens: Optional[int] = None  # from usage (None: the server sent none)
    output_tokens: int = 0  # usage's completion_tokens, else the content chunks counted
    usage: bool = False  # output_tokens came from usage
    text: str = ""
    finish_reason: Optional[str] = None
    error: str = ""
    messages: list = field(default_factory=list, repr=False)  # what was sent (the drafter replay re-renders it)

    @property
    def ok(self) -> bool:
        return not self.error


async def _turn(client, model: str, messages: list[dict], max_tokens: int, temperature: float, res: TurnResult,
                extra: dict) -> None:
    res.start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True}, extra_body=extra or None)
        chunks = 0
        async for chunk in stream:
            if chunk.usage is not None:
                res.prompt_tokens, res.output_tokens, res.usage = (chunk.usage.prompt_tokens,
                                                                   chunk.usage.completion_tokens, True)
            for ch in chunk.choices:
                if ch.delta is not None and ch.delta.content:
                    now = time.perf_counter()
                    res.first = res.first or now
                    res.times.append(now)
                    res.text += ch.delta.content
                    chunks += 1
                if ch.finish_reason:
                    res.finish_reason = ch.finish_reason
        if not res.usage:
            res.output_tokens = chunks
    except Exception as exc:  # the openai client's APIError family, connection errors
        res.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    res.end = time.perf_counter()


async def run_point(url: str, model: str, sessions: Sequence[Session], c: int, turns: int, temperature: float,
                    seed: int, offset: int = 0, api_key: str = "none", extra: Optional[dict] = None,
                    timeout_s: float = 1800.0) -> tuple[float, list[TurnResult]]:
    """``c`` users against ``url`` until ``turns`` turns were started → (wall seconds, every turn's result)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=timeout_s)
    rng = random.Random(seed)
    started = 0
    results: list[TurnResult] = []

    async def user(u: int) -> None:
        nonlocal started
        replay = 0
        while started < turns:
            sess = sessions[(offset + u + replay * c) % len(sessions)].salted(f"{rng.getrandbits(32):08x}")
            replay += 1
            messages = [{"role": "system", "content": sess.system}] if sess.system else []
            for t, turn in enumerate(sess.turns):
                if started >= turns:
                    return
                started += 1
                messages.append({"role": "user", "content": turn.content})
                res = TurnResult(u, sess.name, t, messages=list(messages))
                results.append(res)
                await _turn(client, model, messages, turn.max_tokens, temperature, res, extra or {})
                if not res.ok:
                    break
                messages.append({"role": "assistant", "content": turn.answer if turn.answer is not None else res.text})
                if turn.think_s and t + 1 < len(sess.turns):
                    await asyncio.sleep(turn.think_s)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(user(u) for u in range(c)))
    finally:
        await client.close()
    return time.perf_counter() - t0, results
