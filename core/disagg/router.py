"""The router of ``inferhal serve parallel.role=pd``: one launch, three processes. This process serves HTTP
and routes; a spawned prefill process prefills; a spawned decode process decodes (:mod:`.workers`).

:class:`Router` stands where an engine stands for the server's
:class:`~inferhal.core.server.async_engine.AsyncEngine`: ``make_request`` validates a request with this
process's engine (tokenizer, limits; it never steps), ``add`` sends it to the prefill process, ``step``
collects what both processes sent. The prefill process samples a request's first token (streamed from
there) and hands its KV and state to the decode process over the backend's KV connector (a 2-rank gloo
group between the two processes); the decode process streams the rest. Each process's outputs come back
on its own pipe, so a process that dies is seen at once (EOF) or at the next step (``is_alive``).

Where a request is, as the router knows it: ``prefill`` (sent to the prefill process), ``handed`` (the
prefill process handed it off; the decode process may not have it yet), ``decode``.

Faults (tests: ``tests/core/server/test_disagg_serve.py`` kills each process with SIGKILL mid-stream):

- **the prefill process dies**: every request at ``prefill`` or ``handed`` is retried on the decode process,
  from its prompt plus the tokens already streamed; a ``handed`` one whose KV did arrive runs on from its
  KV instead (the decode process takes whichever comes first, so nothing runs twice). The decode process
  runs colocated from then on, new requests included. Requests it already held stream on untouched.
- **the decode process dies** (or a hand-off to it fails): every request at ``handed`` or ``decode`` is
  retried on the prefill process the same way, which runs colocated from then on.
- **both die**: :meth:`Router.step` raises; the server's loop ends every open stream with an
  ``engine_dead`` error (503, or an error event in a stream) and ``/health`` answers 503.

A retried stream goes on where it stopped: nothing repeated or lost (:meth:`Router._resume` puts the
streamed tokens and logprobs before the new ones). Blocks: a process hands a request off by freeing its
blocks, a dead process's blocks die with it, a retry allocates afresh on the survivor, and a late KV
payload for a request the survivor already took is dropped before anything is allocated: no block leaks
on the surviving side (:meth:`Router.probe` asks a process for its pool's accounting).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from multiprocessing.connection import wait
from typing import Any, Iterable, Optional

from inferhal.core.errors import UserError

log = logging.getLogger("inferhal.disagg")

ROLES = ("prefill", "decode")
OTHER = {"prefill": "decode", "decode": "prefill"}


@dataclasses.dataclass
class _Proc:
    """One engine process as the router holds it."""

    role: str
    process: Any
    ctl: Any  # router -> worker queue
    conn: Any  # worker -> router pipe end (EOF when the process dies)
    probe: Any  # worker -> caller of Router.probe
    gauges: dict = dataclasses.field(default_factory=dict)
    dead: Optional[str] = None  # why it is dead


@dataclasses.dataclass
class _Rec:
    prompt: list
    params: Any
    at: str  # prefill | handed | decode
    last: Any = None  # its latest output, as its stream knows it
    retry_from: Any = None  # the output it had streamed when it was last retried


class _Counts:
    """What the server's metrics read of an engine, over both processes (their last reported counts):
    running and waiting over the live ones; counters (preemptions, drafts) over all, so they never drop."""

    def __init__(self, router: "Router") -> None:
        self._r = router

    def _sum(self, key: str, live: bool = False) -> int:
        return sum(int(p.gauges.get(key, 0)) for p in self._r.procs.values() if not live or p.dead is None)

    @property
    def running(self) -> range:
        return range(self._sum("running", live=True))

    @property
    def waiting(self) -> range:
        return range(self._sum("waiting", live=True))

    @property
    def num_preemptions(self) -> int:
        return self._sum("preemptions")

    @property
    def num_draft_tokens(self) -> int:
        return self._sum("drafts")

    @property
    def num_accepted_tokens(self) -> int:
        return self._sum("accepted")


class _Usage:
    def __init__(self, router: "Router") -> None:
        self._r = router

    def usage(self) -> float:
        """The fuller of the live processes' KV pools (the one that limits admission)."""
        return max((float(p.gauges.get("kv_usage", 0.0)) for p in self._r.procs.values() if p.dead is None),
                   default=0.0)


class Router:
    """The HTTP front's engine: routes requests over a prefill and a decode process (module docstring)."""

    def __init__(self, front: Any, cfg: Any, start_timeout_s: float = 600.0) -> None:
        import multiprocessing as mp

        from omegaconf import OmegaConf

        from inferhal.core.disagg.workers import role_worker
        from inferhal.core.parallel.launch import free_port

        self.front = front
        ctx = mp.get_context("spawn")
        port = free_port()
        d = OmegaConf.to_container(cfg, resolve=True)
        d["parallel"]["role"] = "any"  # each worker's own config: a plain engine, given its role there
        self.procs: dict[str, _Proc] = {}
        for role in ROLES:
            ctl, probe = ctx.Queue(), ctx.Queue()
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=role_worker, args=(role, d, port, ctl, w, probe), daemon=True,
                            name=f"inferhal-{role}")
            p.start()
            w.close()  # the worker holds the only write end: its death is EOF here
            self.procs[role] = _Proc(role, p, ctl, r, probe)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self._reqs: dict[str, _Rec] = {}
        self._resumed: dict[str, Any] = {}  # request id -> the output it had streamed when it was retried
        self.retried: dict[str, str] = {}  # request id -> the role it was last retried on (taken there)
        self.scheduler, self.kv_manager = _Counts(self), _Usage(self)

    def _wait_ready(self, timeout_s: float) -> None:
        """Both processes load their model; then both join their group (so joining never waits out a load
        under ``parallel.timeout_s``) and check each other. A failure is said, not waited out."""
        deadline = time.monotonic() + timeout_s
        for step in ("loaded", "ready"):
            waiting = set(ROLES)
            while waiting:
                for role in sorted(waiting):
                    p = self.procs[role]
                    try:
                        if p.conn.poll(0.25):
                            kind, msg = p.conn.recv()
                            if kind == "error":
                                raise UserError(f"the {role} process failed to start: {msg}")
                            waiting.discard(role)
                            continue
                    except (EOFError, OSError):
                        pass
                    if not p.process.is_alive() or time.monotonic() > deadline:
                        raise UserError(f"the {role} process did not start (exit code {p.process.exitcode})")
            if step == "loaded":
                for p in self.procs.values():
                    p.ctl.put(("join", None))

    # ------------------------------------------------------------------ what the server calls

    def __getattr__(self, name: str) -> Any:  # tokenizer, max_model_len, ... of this process's engine
        if name in ("front", "procs"):
            raise AttributeError(name)
        return getattr(self.front, name)

    @property
    def failed(self) -> dict[str, str]:
        """Dead processes: role -> why."""
        return {r: p.dead for r, p in self.procs.items() if p.dead is not None}

    def health(self) -> dict[str, str]:
        """Each role's state for ``/health``: ``ok`` or ``dead: why``."""
        return {r: f"dead: {p.dead}" if p.dead is not None else "ok" if p.process.is_alive() else
                f"dead: the {r} process exited (code {p.process.exitcode})" for r, p in self.procs.items()}

    def make_request(self, prompt, params=None, request_id=None, extra_keys=()):
        req = self.front.make_request(prompt, params, request_id, extra_keys)  # raises on a bad request
        self.front.discard(req.request_id)
        return req

    def add(self, req: Any) -> str:
        rid = req.request_id
        if rid in self._reqs:
            raise UserError(f"request id {rid!r} is already in use")
        pre = self.procs["prefill"]
        to = "prefill" if pre.dead is None and pre.process.is_alive() else "decode"  # (step fails it over)
        self._reqs[rid] = _Rec(list(req.prompt_token_ids), req.params, to)
        self.procs[to].ctl.put(("add", (rid, list(req.prompt_token_ids), req.params, False, False)))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def abort(self, request_ids: Iterable[str]) -> list:
        outs = []
        for rid in request_ids:
            rec = self._reqs.pop(rid, None)
            if rec is None:
                continue
            p = self.procs["prefill" if rec.at == "prefill" else "decode"]
            if p.dead is None:
                p.ctl.put(("abort", rid))
            last = rec.last or self._empty(rid, rec)
            outs.append(self._resume(dataclasses.replace(last, finished=True, new_token_ids=[], new_text="", outputs=[
                dataclasses.replace(last.outputs[0], finish_reason="abort")])))
            self._resumed.pop(rid, None)
        return outs

    def step(self) -> list:
        outs: list = []
        self._watch_exits(outs)
        live = {p.conn: p for p in self.procs.values() if p.dead is None}
        for c in wait(list(live), timeout=0.02):
            self._drain(live[c], outs)
        return outs

    def probe(self, role: str, timeout: float = 30.0) -> dict:
        """A live process's KV accounting (:func:`~inferhal.core.disagg.workers.accounting`): the requests
        holding blocks and its pool's consistency check. Any thread may ask."""
        p = self.procs[role]
        if p.dead is not None:
            raise UserError(f"the {role} process is dead ({p.dead})")
        p.ctl.put(("probe", None))
        try:
            return p.probe.get(timeout=timeout)
        except queue.Empty:
            raise UserError(f"the {role} process did not answer within {timeout} s") from None

    def close(self) -> None:
        for p in self.procs.values():
            if p.process.is_alive():
                p.ctl.put(("stop", None))
        for p in self.procs.values():
            p.process.join(5)
            if p.process.is_alive():
                p.process.kill()
                p.process.join(5)

    # ------------------------------------------------------------------ the processes' messages

    def _drain(self, p: _Proc, outs: list) -> None:
        while p.dead is None:
            try:
                if not p.conn.poll():
                    return
                kind, arg = p.conn.recv()
            except (EOFError, OSError):
                p.process.join(1)
                self._fail(p.role, f"the {p.role} process exited (code {p.process.exitcode})", outs)
                return
            self._handle(p, kind, arg, outs)

    def _handle(self, p: _Proc, kind: str, arg: Any, outs: list) -> None:
        if kind == "outputs":
            got, p.gauges = arg
            for o in got:
                self._output(p.role, o, outs)
        elif kind == "taken":
            rec = self._reqs.get(arg)
            if rec is not None:
                self.retried[arg] = p.role
                if rec.retry_from is not None:
                    self._resumed[arg] = rec.retry_from
        elif kind == "skipped":
            log.info("request %s: its KV reached the decode process before its retry did; it runs from there", arg)
        elif kind == "failed":
            rid, why = arg
            rec = self._reqs.get(rid)
            if rec is None:
                return
            other = self.procs[OTHER[p.role]]
            if p.role == "decode" and other.dead is None:
                log.warning("the decode process refused request %s (%s): it is decoded on the prefill side", rid, why)
                self._retry(rid, "prefill", keep_local=True)
            else:
                log.error("request %s failed on the %s process: %s", rid, p.role, why)
                outs.extend(self.abort([rid]))
        elif kind == "send_failed":
            rid, why = arg
            dec = self.procs["decode"]
            if dec.dead is None:
                if dec.process.is_alive():
                    dec.process.kill()  # a process that cannot take hand-offs is not a decode instance
                what = f"handing request {rid!r}" if rid is not None else "a heartbeat"
                self._fail("decode", f"{what} to the decode process failed: {why}", outs)
            elif rid in self._reqs and self._reqs[rid].at == "handed":
                self._retry(rid, "prefill")

    def _output(self, role: str, o: Any, outs: list) -> None:
        rid = o.request_id
        rec = self._reqs.get(rid)
        handed = o.finished and o.outputs[0].finish_reason == "transferred"
        if rec is None:
            if handed and self.procs["decode"].dead is None:
                self.procs["decode"].ctl.put(("abort", rid))  # aborted here while it was being handed off
            return
        if role == "prefill" and rec.at != "prefill":
            return  # from before a retry moved it
        if role == "decode" and rec.at == "prefill":  # the prefill process said "handed" first: read that first
            self._drain(self.procs["prefill"], outs)
            if self._reqs.get(rid) is not rec:
                return
        if handed:  # its stream goes on from the decode process
            o = dataclasses.replace(o, finished=False, outputs=[dataclasses.replace(o.outputs[0], finish_reason=None)])
            rec.at = "handed"
        elif role == "decode":
            rec.at = "decode"
        o = self._resume(o)
        rec.last = o
        if o.finished:
            del self._reqs[rid]
        outs.append(o)
        if handed and self.procs["decode"].dead is not None:
            self._retry(rid, "prefill")

    # ------------------------------------------------------------------ faults

    def _watch_exits(self, outs: list) -> None:
        for p in self.procs.values():
            if p.dead is None and not p.process.is_alive():
                self._drain(p, outs)  # what it sent before it died, then EOF

    def _fail(self, role: str, why: str, outs: list) -> None:
        p = self.procs[role]
        p.dead = why
        other = OTHER[role]
        lost = ("prefill", "handed") if role == "prefill" else ("handed", "decode")
        moved = [rid for rid, rec in self._reqs.items() if rec.at in lost]
        if self.procs[other].dead is not None:
            raise RuntimeError(f"both engine processes are dead (prefill: {self.procs['prefill'].dead}; decode: "
                               f"{self.procs['decode'].dead})")
        log.error("%s: %d request(s) are retried on the %s process, which runs colocated from now on",
                  why, len(moved), other)
        self.procs[other].ctl.put(("colocate", why))
        for rid in moved:
            self._retry(rid, other)

    def _retry(self, rid: str, on: str, keep_local: bool = False) -> None:
        """Run ``rid`` again on ``on`` from its prompt and what it streamed, to decode the rest there."""
        rec = self._reqs[rid]
        last = rec.last
        done = list(last.outputs[0].token_ids) if last is not None else []
        params = dataclasses.replace(rec.params, max_tokens=rec.params.max_tokens - len(done))
        rec.at, rec.retry_from = on, last
        self._resumed.pop(rid, None)
        self.procs[on].ctl.put(("add", (rid, rec.prompt + done, params, True, keep_local)))

    def _resume(self, o: Any) -> Any:
        """A retried request's output as its stream knows it: earlier tokens and logprobs before the new."""
        prev = self._resumed.get(o.request_id)
        if prev is None:
            return o
        if o.finished:
            del self._resumed[o.request_id]
        c, p = o.outputs[0], prev.outputs[0]
        comp = dataclasses.replace(c, token_ids=list(p.token_ids) + list(c.token_ids),
                                   logprobs=list(p.logprobs) + list(c.logprobs), text=p.text + c.text)
        return dataclasses.replace(o, prompt_token_ids=list(prev.prompt_token_ids), outputs=[comp])

    @staticmethod
    def _empty(rid: str, rec: _Rec) -> Any:
        from inferhal.core.engine.outputs import CompletionOutput, RequestOutput

        return RequestOutput(rid, None, list(rec.prompt), [CompletionOutput(0, "", [], None, [])])
