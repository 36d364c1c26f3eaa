"""The router of disaggregated serving: the HTTP server's engine, over prefill and decode instances.

- ``inferhal serve parallel.role=pd``: one launch. The router spawns one prefill and one decode process
  on this host, and respawns one that dies (``disagg.restarts`` times each).
- ``inferhal serve parallel.role=router disagg.prefill=[h:p,...] disagg.decode=[h:p,...]``: the router
  alone, in front of instances launched on their own (``parallel.role=prefill|decode``, on any hosts),
  dialled again while they are away.

How the instances are started, linked and watched is :mod:`.fleet`'s; this module is the requests'. The
router loads no weights: it tokenizes and validates with the tokenizer and limits the instances sent at
hello (:class:`~.front.Front`). It never touches KV: every prefill instance holds a KV link to every
decode instance (:mod:`.workers`), made when both are up.

:class:`Router` stands where an engine stands for the server's
:class:`~inferhal.core.server.async_engine.AsyncEngine`: ``make_request`` validates, ``add`` places a
request, ``step`` collects what the instances sent and watches them.

**Placement, by prefix and load.** A request goes to the prefill instance that last prefilled the
longest run of its leading full blocks (:class:`~.prefixes.Prefixes`: the router's record, a hint of what that
instance's prefix cache holds), unless that instance has more than ``PREFIX_SLACK`` blocks' worth of prompt
tokens still to prefill beyond the least loaded one; otherwise, and for a prompt no instance has seen, to
the prefill instance with the fewest prompt tokens still to prefill (as the router counts them). It is
handed to the decode instance with the fewest requests (then the emptiest KV pool) among those linked to
it. With no linked decode instance the prefill instance
decodes it too; with no prefill instance a decode instance runs it whole. With none live but one
(re)starting, it waits for that one.

Where a request is: ``prefill`` (prefilling on ``where``, to be handed to ``dest``), ``handed`` (the prefill
instance sent its KV; the decode instance may not have it yet), ``decode`` (running to its end on
``where``), ``pending`` (waiting for an instance).

**Faults.** When an instance is dead (:mod:`.fleet`: its connection ended, or it was silent for
``parallel.timeout_s``):

- a dead prefill instance: its requests at ``prefill`` are placed again from their prompt plus the tokens
  already streamed; those ``handed`` are retried on the decode instance their KV went to, which takes
  whichever comes first (the KV or the retry), so nothing runs twice;
- a dead decode instance: its requests (``handed`` to it or decoding there) are placed again the same way;
- none left (and none restarting): :meth:`step` raises; the server ends every open stream with an
  ``engine_dead`` error and ``/health`` answers 503.

A retried stream goes on where it stopped: nothing repeated or lost (:meth:`Router._resume`). Blocks: a
prefill instance frees a request's blocks when it hands it off, a dead process's blocks die with it, a
retry allocates afresh, and a late KV payload for a request already taken is dropped before anything is
allocated (:meth:`Router.probe` asks an instance for its pool's accounting). A sampled request that is
retried draws from a freshly seeded generator: a valid sample, not the one the dead instance would have
drawn.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from multiprocessing.connection import wait
from typing import Any, Iterable, Optional

from inferhal.core.disagg.fleet import Fleet, Member
from inferhal.core.disagg.front import Fronted, continued, ended
from inferhal.core.disagg.prefixes import PREFIX_SLACK, Prefixes
from inferhal.core.errors import EngineDead, UserError

log = logging.getLogger("inferhal.disagg")


@dataclasses.dataclass
class _Rec:
    prompt: list
    params: Any
    at: str  # prefill | handed | decode | pending
    where: Optional[str] = None  # the instance running it
    dest: Optional[str] = None  # prefill: the decode instance it is handed to
    last: Any = None  # its latest output, as its stream knows it
    retry_from: Any = None  # the output it had streamed when it was last retried
    held: Any = None  # pending: (prompt, params, once) to place when an instance is live


class _Counts:
    """What the server's metrics read of an engine, over the instances (their last reported counts):
    running and waiting over the live ones; counters (preemptions, drafts) over all, so they never drop."""

    def __init__(self, router: "Router") -> None:
        self._r = router

    def _sum(self, key: str, live: bool = False) -> int:
        return sum(int(i.gauges.get(key, 0)) for i in self._r.insts.values() if not live or i.live)

    @property
    def running(self) -> range:
        return range(self._sum("running", live=True))

    @property
    def waiting(self) -> range:
        return range(self._sum("waiting", live=True) + sum(r.at == "pending" for r in list(self._r.requests.values())))

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
        """The fullest live instance's KV pool (the one that limits admission)."""
        return max((float(i.gauges.get("kv_usage", 0.0)) for i in self._r.insts.values() if i.live), default=0.0)


class Router(Fronted, Fleet):
    """The HTTP front's engine over prefill and decode instances (module docstring): the requests, over the
    instances of :class:`~.fleet.Fleet` (``spawn``: ``parallel.role=pd``)."""

    def __init__(self, cfg: Any, spawn: bool, start_timeout_s: float = 600.0) -> None:
        self.requests: dict[str, _Rec] = {}
        self._resumed: dict[str, Any] = {}  # request id -> the output it had streamed when it was retried
        self.retried: dict[str, str] = {}  # request id -> the instance it was last retried on (taken there)
        self._lock = threading.RLock()  # held by step(); probe() reads for itself when no loop is stepping
        self._early: list = []  # outputs read by probe() outside step(), returned by the next step()
        self._prefixes: Optional[Prefixes] = None  # made at the first hello (the block size)
        self.prefix_placed = 0  # requests placed on the prefill instance that was sent their prefix
        self.placed: collections.Counter = collections.Counter()  # (instance, decode instance or None) -> requests
        self.front: Any = None
        super().__init__(cfg, spawn, start_timeout_s)
        self.scheduler, self.kv_manager = _Counts(self), _Usage(self)

    # ------------------------------------------------------------------ the fleet's events

    def _hello(self, inst: Member, hello: dict) -> None:
        from inferhal.core.disagg.front import Front

        if self.front is None:
            self.front = Front(hello["tokenizer"], hello["limits"])
            self._prefixes = Prefixes(int(hello["describe"]["block_size"]))
        else:
            self.front.tighten(hello["limits"])

    def _joined(self) -> None:
        self._place_pending()

    def _lost(self, inst: Member, was_live: bool, outs: list) -> None:
        """Its requests are placed again (module docstring, **Faults**)."""
        if self._prefixes is not None:
            self._prefixes.forget(inst.name)  # its cache died with it (a rejoined instance starts empty)
        if not was_live:
            return
        for rid, rec in list(self.requests.items()):
            if inst.role == "prefill" and rec.where == inst.name:
                if rec.at == "handed" and rec.dest is not None and self.insts[rec.dest].live:
                    self._retry(rid, on=rec.dest)  # the KV may be there already: it takes whichever comes first
                else:
                    self._retry(rid)
            elif inst.role == "decode" and (rec.where == inst.name or (rec.dest == inst.name and rec.at == "handed")):
                self._retry(rid, avoid=inst.name)
            elif rec.dest == inst.name:  # still prefilling: its prefill instance keeps it
                rec.dest = None


    # ------------------------------------------------------------------ what the server calls

    def add(self, req: Any) -> str:
        rid = req.request_id
        if rid in self.requests:
            raise UserError(f"request id {rid!r} is already in use")
        if not any(i.live or i.state in ("starting", "hello") for i in self.insts.values()):
            raise EngineDead("no engine instance is live (" + "; ".join(f"{n}: {i.dead}" for n, i in self.insts.items())
                             + (f"); the router tries each again every {self.reconnect_s:g} s" if not self.spawn else ")"))
        self.requests[rid] = rec = _Rec(list(req.prompt_token_ids), req.params, "pending")
        self._place(rid, rec, rec.prompt, rec.params, once=False)
        return rid

    def has_unfinished(self) -> bool:
        """True while the router runs: it watches its instances (deaths, restarts, reconnects) every step."""
        return not self.closed

    def abort(self, request_ids: Iterable[str]) -> list:
        outs = []
        for rid in request_ids:
            rec = self.requests.pop(rid, None)
            if rec is None:
                continue
            for name in {rec.where, rec.dest if rec.at in ("prefill", "handed") else None} - {None}:
                self._send(self.insts[name], ("abort", rid))
            outs.append(ended(rec.last, rid, rec.prompt, "abort"))  # rec.last is resumed already (_output)
            self._resumed.pop(rid, None)
        return outs

    def step(self) -> list:
        with self._lock:
            return self._step()

    def _step(self) -> list:
        outs, self._early = self._early, []
        self._watch(outs)
        live = {i.conn.conn: i for i in self.insts.values() if i.live}
        if live:
            for c in wait(list(live), timeout=0.02):
                self._drain(live[c], outs)
        else:
            time.sleep(0.02)  # nothing to wait on: starting, restarting or reconnecting
        if not any(i.live or i.state in ("starting", "hello") for i in self.insts.values()):
            why = "; ".join(f"{n}: {i.dead}" for n, i in self.insts.items())
            if self.spawn:  # no restart left: the server's loop ends, every stream gets engine_dead
                raise RuntimeError(f"every engine instance is dead ({why})")
            stranded = [rid for rid, r in self.requests.items() if r.at == "pending"]
            if stranded:  # separate instances may come back, but these streams do not wait for them
                log.error("no engine instance is live (%s): %d request(s) aborted", why, len(stranded))
                outs.extend(self.abort(stranded))
        return outs

    def probe(self, name: str, timeout: float = 30.0) -> dict:
        """A live instance's KV accounting (:func:`~inferhal.core.disagg.workers.accounting`): the requests
        holding blocks and its pool's consistency check. Any thread may ask."""
        inst = self.insts[name]
        if not inst.live:
            raise UserError(f"{name} is not live ({inst.dead or inst.state})")
        self._send(inst, ("probe", None))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return inst.probes.get(timeout=0.05)
            except queue.Empty:
                pass
            if self._lock.acquire(blocking=False):  # no loop steps this router now: read its messages here
                try:
                    self._drain(inst, self._early)
                finally:
                    self._lock.release()
        raise UserError(f"{name} did not answer within {timeout} s")

    # ------------------------------------------------------------------ placement

    def _load(self, inst: Member) -> tuple:
        if inst.role == "prefill":
            return (sum(len(r.prompt) for r in self.requests.values() if r.where == inst.name and r.at == "prefill"),
                    int(inst.gauges.get("running", 0)))
        return (sum(1 for r in self.requests.values() if (r.dest == inst.name and r.at in ("prefill", "handed"))
                    or (r.where == inst.name and r.at == "decode")), float(inst.gauges.get("kv_usage", 0.0)))

    def _place(self, rid: str, rec: _Rec, prompt: list, params: Any, once: bool,
               avoid: Optional[str] = None) -> None:
        """Send ``rid`` to the least loaded live instance (module docstring), or hold it ``pending``."""
        pre = [i for i in self.insts.values() if i.role == "prefill" and i.live]
        dec = [i for i in self.insts.values() if i.role == "decode" and i.live and i.name != avoid]
        load = {i.name: self._load(i) for i in pre + dec}
        if pre:
            on = self._by_prefix(pre, prompt, load)
            linked = [d for d in dec if self.linked((on.name, d.name))]
            to = min(linked, key=lambda d: load[d.name]).name if linked else None
        elif dec:
            on, to = min(dec, key=lambda d: load[d.name]), None
        else:
            rec.at, rec.where, rec.dest = "pending", None, None
            rec.held = (prompt, params, once)
            return
        rec.at, rec.where, rec.dest = ("prefill" if to is not None else "decode"), on.name, to
        self.placed[(on.name, to)] += 1
        self._send(on, ("add", (rid, prompt, params, once, to)))

    def _by_prefix(self, pre: list, prompt: list, load: dict) -> Member:
        """The prefill instance for ``prompt``: the one holding its longest known prefix, unless that one is
        ``PREFIX_SLACK`` blocks of prompt behind the least loaded (module docstring); recorded for the next.
        ``load``: each instance's :meth:`_load`."""
        least = min(pre, key=lambda i: load[i.name])
        keys = self._prefixes.keys(prompt) if self._prefixes is not None else []
        if not keys:
            return least
        hits = {i.name: self._prefixes.hit(i.name, keys) for i in pre}
        on = min(pre, key=lambda i: (-hits[i.name], load[i.name]))
        if load[on.name][0] - load[least.name][0] > PREFIX_SLACK * self._prefixes.block_size:
            on = least  # the hit's instance is too far behind: the prefill is recomputed elsewhere
        self.prefix_placed += hits[on.name] > 0
        self._prefixes.add(on.name, keys)
        return on

    def _place_pending(self) -> None:
        if not any(i.live for i in self.insts.values()):
            return
        for rid, rec in list(self.requests.items()):
            if rec.at == "pending":
                self._place(rid, rec, *rec.held)

    # ------------------------------------------------------------------ requests' messages and retries

    def _handle(self, inst: Member, kind: str, arg: Any, outs: list) -> None:
        if kind == "outputs":
            got, inst.gauges = arg
            for o in got:
                self._output(inst, o, outs)
        elif kind == "taken":
            rec = self.requests.get(arg)
            if rec is not None:
                self.retried[arg] = inst.name
                if rec.retry_from is not None:
                    self._resumed[arg] = rec.retry_from
        elif kind == "skipped":
            log.info("request %s: its KV reached %s before its retry did; it runs from there", arg, inst.name)
        elif kind == "failed":
            rid, why = arg
            rec = self.requests.get(rid)
            if rec is None:
                return
            if inst.role == "decode" and rec.dest == inst.name and rec.at in ("prefill", "handed"):
                log.warning("%s refused request %s (%s): it is placed again without it", inst.name, rid, why)
                self._retry(rid, avoid=inst.name)
            else:
                log.error("request %s failed on %s: %s", rid, inst.name, why)
                outs.extend(self.abort([rid]))
        elif kind == "send_failed":
            rid, peer, why = arg
            if peer is not None:
                self._unlink(inst.name, peer, why)
            rec = self.requests.get(rid)
            if rec is not None and rec.at == "handed" and rec.where == inst.name:
                self._retry(rid, avoid=peer)
        else:
            super()._handle(inst, kind, arg, outs)

    def _output(self, inst: Member, o: Any, outs: list) -> None:
        rid = o.request_id
        rec = self.requests.get(rid)
        handed = o.finished and o.outputs[0].finish_reason == "transferred"
        if rec is None:
            return  # aborted (its hand-off target was told so) or from before a retry
        if inst.name == rec.dest and rec.at == "prefill":  # the prefill instance said "handed" first: read that first
            self._drain(self.insts[rec.where], outs)
            if self.requests.get(rid) is not rec:
                return
        if inst.name != rec.where and not (inst.name == rec.dest and rec.at == "handed"):
            return  # from before a retry moved it
        if handed:  # its stream goes on from the decode instance
            o = dataclasses.replace(o, finished=False, outputs=[dataclasses.replace(o.outputs[0], finish_reason=None)])
            rec.at = "handed"
        elif inst.name == rec.dest:
            rec.at, rec.where, rec.dest = "decode", inst.name, None
        o = self._resume(o)
        rec.last = o
        if o.finished:
            del self.requests[rid]
        outs.append(o)
        if handed and (rec.dest is None or not self.insts[rec.dest].live):
            self._retry(rid)

    def _retry(self, rid: str, on: Optional[str] = None, avoid: Optional[str] = None) -> None:
        """Run ``rid`` again from its prompt and what it streamed: on ``on`` (a decode instance, to run it
        there) or wherever placement says (never handed to ``avoid``)."""
        rec = self.requests[rid]
        last = rec.last
        done = list(last.outputs[0].token_ids) if last is not None else []
        params = dataclasses.replace(rec.params, max_tokens=rec.params.max_tokens - len(done))
        rec.retry_from = last
        self._resumed.pop(rid, None)
        if on is not None:
            rec.at, rec.where, rec.dest = "decode", on, None
            self._send(self.insts[on], ("add", (rid, rec.prompt + done, params, True, None)))
        else:
            self._place(rid, rec, rec.prompt + done, params, once=True, avoid=avoid)

    def _resume(self, o: Any) -> Any:
        """A retried request's output as its stream knows it: earlier tokens and logprobs before the new."""
        return continued(self._resumed, o)
