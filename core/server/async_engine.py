"""An engine loop on its own thread, driven from an asyncio event loop.

:class:`AsyncEngine` owns an :class:`~inferhal.core.engine.engine.Engine` and calls it from one thread
only (the loop thread): ``add``, ``abort`` and ``step``. The event loop talks to it through a command
queue; each request's outputs come back on an ``asyncio.Queue`` of :class:`Delta` (filled with
``call_soon_threadsafe``), so HTTP handlers await tokens while the engine schedules and runs the batch.
Continuous batching, prefix caching and spec decoding are the engine's own: every request of the server
shares it.

- Admission: :meth:`AsyncEngine.submit` validates a request on the loop thread (the engine's own checks:
  prompt length, sampling fields) and raises its ``UserError`` back to the caller. Before that it raises
  :class:`QueueFull` when ``max_queued`` requests are unfinished (queued or running), or when the prompt
  tokens of requests that have not had their first token yet would pass ``max_queued_tokens`` (a prompt
  longer than that bound alone is a ``UserError``: it could never be admitted); :class:`Draining` once
  :meth:`drain` was called (the server is shutting down).
- Deadlines: a request's ``timeout_s`` (else the server's ``request_timeout_s``) counts from its arrival;
  past it the loop thread aborts the request (its KV blocks freed before the next step) and its last
  output says ``finish_reason="timeout"``.
- :meth:`AsyncEngine.abort` (a client that went away) frees the request's KV blocks at the next loop
  turn, before the next step; :meth:`abort_all` does it for every open request.
- A step that raises kills the loop: every open stream ends with :class:`EngineDead`, ``dead`` is set
  (the server's ``/health`` answers 503) and new requests are refused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from inferhal.core.errors import EngineDead, UserError

log = logging.getLogger("inferhal.server")


class QueueFull(Exception):
    """More unfinished requests than the server admits."""


class Draining(Exception):
    """The server is shutting down: it finishes what it admitted and admits nothing more."""


@dataclass
class Delta:
    """What one engine step gave one request: its new token ids, their logprobs, and whether it finished."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class _Track:
    queue: asyncio.Queue
    arrival: float
    num_prompt: int
    first: Optional[float] = None
    last: Optional[float] = None
    num_out: int = 0
    num_lp: int = 0
    deadline: Optional[float] = None  # time.monotonic() past which the request is ended ("timeout")


class AsyncEngine:
    def __init__(self, engine, max_queued: int = 256, metrics: Any = None, max_queued_tokens: Optional[int] = None,
                 request_timeout_s: Optional[float] = None) -> None:
        self.engine = engine
        self.max_queued = int(max_queued)
        self.max_queued_tokens = max_queued_tokens
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.dead: Optional[BaseException] = None
        self.draining = False
        self._pending: dict[str, int] = {}  # admitted, no token yet: prompt tokens (event loop side)
        self.queued_tokens = 0
        self._cmds: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self._tracks: dict[str, _Track] = {}  # loop thread only
        self._open: set[str] = set()  # submitted, neither finished nor aborted (event loop side)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="inferhal-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, end the loop thread and wait for it."""
        self._stop.set()
        self._cmds.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._open)

    def drain(self) -> None:
        """Admit nothing more (event loop side): :meth:`submit` raises :class:`Draining` from now on."""
        self.draining = True

    # -- requests (event loop side) ----------------------------------------------------------------
    def check_room(self, requests: int, prompt_tokens: int) -> None:
        """Raise :class:`QueueFull` unless ``requests`` more requests holding ``prompt_tokens`` prompt tokens in all
        fit under ``max_queued`` and ``max_queued_tokens`` now. A caller admitting several requests as one (an
        ``n > 1`` completion) checks them together first: admitted one by one, earlier ones could finish between
        two admissions and let the whole through a bound it exceeds."""
        if len(self._open) + requests > self.max_queued:
            raise QueueFull(f"{len(self._open)} requests are queued or running and {requests} more would pass "
                            f"server.max_queued_requests={self.max_queued}; retry later")
        bound = self.max_queued_tokens
        if bound is not None and self.queued_tokens + prompt_tokens > bound:
            raise QueueFull(f"{self.queued_tokens} prompt tokens are waiting for their first token; {prompt_tokens} "
                            f"more would pass server.max_queued_tokens={bound}; retry later")

    async def submit(self, prompt: Sequence[int], params, timeout_s: Optional[float] = None,
                     session: Optional[str] = None) -> tuple[str, asyncio.Queue]:
        """Admit one request → (request id, its queue of :class:`Delta`); ``session``: its client's session key
        (``Request.session``, read by DP placement). Raises ``UserError`` (bad request), :class:`QueueFull`,
        :class:`Draining` or :class:`EngineDead`."""
        if not self.alive:
            raise EngineDead("the engine loop is not running")
        if self.draining:
            raise Draining("the server is shutting down")
        n, bound = len(prompt), self.max_queued_tokens
        if bound is not None and n > bound:
            raise UserError(f"the prompt has {n} tokens, more than the server queues at once "
                            f"(server.max_queued_tokens={bound})")
        self.check_room(1, n)
        timeout = timeout_s if timeout_s is not None else self.request_timeout_s
        deadline = time.monotonic() + timeout if timeout is not None else None
        rid = f"req-{next(self._ids)}"
        self._open.add(rid)
        self._pending[rid] = n
        self.queued_tokens += n
        q: asyncio.Queue = asyncio.Queue()
        fut: Future = Future()
        self._cmds.put(("add", (rid, list(prompt), params, q, fut, deadline, session)))
        try:
            await asyncio.wrap_future(fut)
        except BaseException:  # refused, or the caller was cancelled (its request may be added all the same)
            self.abort(rid)
            raise
        return rid, q

    def abort(self, request_id: str) -> None:
        """Stop a request (event loop side): it no longer counts against ``max_queued``, and its KV is freed
        at the loop's next turn; a finished or unknown id is ignored."""
        self._forget(request_id)
        self._cmds.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every open request (event loop side): their streams end with ``finish_reason="abort"``."""
        for rid in list(self._open):
            self.abort(rid)

    def _forget(self, rid: str) -> None:
        self._open.discard(rid)
        self._started(rid)

    def _started(self, rid: str) -> None:
        self.queued_tokens -= self._pending.pop(rid, 0)

    # -- the loop thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain(block=not eng.has_unfinished())
                if self._stop.is_set():
                    break
                self._expire()
                if eng.has_unfinished():
                    outs = eng.step()
                    self._dispatch(outs)
                self._update_gauges()
        except BaseException as exc:  # a failed step: the engine is in an unknown state
            log.exception("the engine loop died")
            self.dead = exc
        finally:
            self._fail_all(self.dead or EngineDead("the server is shutting down"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, arg: Any) -> None:
        eng = self.engine
        if kind == "add":
            rid, prompt, params, q, fut, deadline, session = arg
            if not fut.set_running_or_notify_cancel():  # its submitter is gone already: never added
                return
            try:
                req = eng.make_request(prompt, params, request_id=rid)
                if session is not None:
                    req.session = session
                eng.add(req)
            except (UserError, ValueError, EngineDead) as exc:  # (EngineDead: a router with no live instance)
                fut.set_exception(exc)
                return
            except Exception as exc:  # a bug in checking one request: that request fails, the loop goes on
                log.exception("request %s could not be added", rid)
                try:
                    eng.abort([rid])  # whatever of it got in
                except Exception:  # noqa: BLE001 - already logged above
                    pass
                fut.set_exception(exc)
                return
            self._tracks[rid] = _Track(q, time.monotonic(), len(prompt), deadline=deadline)
            fut.set_result(rid)
        elif kind == "abort":
            if arg in self._tracks:
                outs = eng.abort([arg])
                self._dispatch(outs)

    def _expire(self) -> None:
        """End the requests past their deadline (loop thread): aborted in the engine, ``timeout`` to the client."""
        now = time.monotonic()
        late = [rid for rid, tr in self._tracks.items() if tr.deadline is not None and tr.deadline <= now]
        if late:
            self._dispatch(self.engine.abort(late), reason="timeout")

    def _dispatch(self, outs, reason: Optional[str] = None) -> None:
        """Each output to its request's queue (``reason`` replaces the finish reason of finished ones)."""
        now = time.monotonic()
        m = self.metrics
        for o in outs:
            tr = self._tracks.get(o.request_id)
            if tr is None:
                continue
            new = list(o.new_token_ids)
            lps = o.logprobs[tr.num_lp:tr.num_lp + len(new)] if o.logprobs else []
            tr.num_lp += len(lps)
            if new:
                if tr.first is None:
                    tr.first = now
                    if m:
                        m.ttft.observe(now - tr.arrival)
                elif m:
                    m.itl.observe((now - tr.last) / len(new))
                tr.last = now
                tr.num_out += len(new)
            d = Delta(new, lps, o.finished, (reason or o.finish_reason) if o.finished else o.finish_reason,
                      tr.num_prompt, o.num_cached_tokens)
            if o.finished:
                del self._tracks[o.request_id]
                if m:
                    m.finished(o, tr, now, d.finish_reason)
                self._loop.call_soon_threadsafe(self._finish_put, o.request_id, tr.queue, d)
            else:
                self._loop.call_soon_threadsafe(self._put, o.request_id, tr.queue, d)

    def _put(self, rid: str, q: asyncio.Queue, d) -> None:
        if d.token_ids:
            self._started(rid)
        q.put_nowait(d)

    def _finish_put(self, rid: str, q: asyncio.Queue, d) -> None:
        self._forget(rid)
        q.put_nowait(d)

    def _fail_all(self, exc: BaseException) -> None:
        tracks, self._tracks = self._tracks, {}
        if tracks:
            try:
                self.engine.abort(list(tracks))
            except Exception:  # the engine may be broken already
                pass
        for rid, tr in tracks.items():
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._finish_put, rid, tr.queue, exc)
        # requests that never reached the engine learn the same reason as those it was running (a request sent
        # while a router's last instance died read only "the engine loop stopped" before)
        why = exc if isinstance(exc, EngineDead) else EngineDead(f"the engine loop stopped: {exc}")
        while True:
            try:
                kind, arg = self._cmds.get_nowait()
            except queue.Empty:
                break
            if kind == "add" and not arg[4].done():  # (rid, prompt, params, queue, future, deadline, session)
                arg[4].set_exception(why)

    def _update_gauges(self) -> None:
        if self.metrics:
            self.metrics.engine_state(self.engine)
