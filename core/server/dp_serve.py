"""``inferhal serve parallel=dep2`` (``parallel.dp = parallel.ep > 1``): the HTTP server's engine over DP rank
processes.

This process serves HTTP and loads no weights: it spawns ``parallel.dp`` rank processes (:mod:`.dp_rank`; each
its own scheduler and KV pool, the routed experts sharded over them and reached by all-to-all, gloo on CPU),
validates and tokenizes requests with what rank 0 said at hello (:class:`~inferhal.core.disagg.front.Front`,
as the disaggregated router does), and drives the group step by step: every step it sends every rank the same
message (the requests added and aborted since the last step), and each rank answers when the step ended on
all of them. Every rank runs every step, with or without requests of its own, so an idle rank still joins
each MoE exchange (empty) and nothing waits on it. The ranks place new requests themselves, all alike
(``parallel.dp_balance``: :mod:`~inferhal.core.parallel.dp_balance`), from their exact prefix caches and loads.

:class:`DPGroup` stands where an engine stands for the server's
:class:`~inferhal.core.server.async_engine.AsyncEngine` (``make_request``, ``add``, ``abort``, ``step``,
``has_unfinished``, ``scheduler``/``kv_manager`` read by the metrics; ``rank_gauges`` per rank; ``health()``
and ``down`` for ``/health``).

**A rank's death** (its process exited, it raised, or it answered nothing for ``2 * parallel.timeout_s + 10``
seconds; a rank whose peer died fails the next collective): ``/health`` answers 503 while the group is down,
every rank is stopped, and the group is spawned again (``parallel.restarts`` times over the server's life),
which starts with empty KV pools. Each open request is then placed again from its prompt plus the tokens
already streamed, and its stream goes on where it stopped (a request under a structured-output constraint
ends with ``abort`` instead: its grammar state died with the rank). With no restart left, :meth:`DPGroup.step`
raises: every stream ends with the server's ``engine_dead`` error and ``/health`` answers 503. **Elastic EP**
(:mod:`.dp_elastic`, ``eplb.survive_rank_loss``): when a rank process exited and the survivors hold a replica of
each of its experts, they go on without it instead (``/health`` 200 ``degraded``, no restart), and the open
requests are placed again on them the same way.

**torchrun** (``parallel.launcher=torchrun``, ranks on any hosts): nothing is spawned; the ranks join at
``parallel.front`` (:mod:`.dp_link`). When one dies the survivors are told to stop (they exit 1, so torchrun's
``--max-restarts`` restarts the whole group) and the front waits ``parallel.start_timeout_s`` for the new group
to connect (a restart, counted as above); a group that does not come back ends every stream as above.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from multiprocessing.connection import wait
from types import SimpleNamespace
from typing import Any, Iterable, Optional

from inferhal.core.disagg.front import Fronted, continued, ended
from inferhal.core.errors import EngineDead, UserError
from inferhal.core.server.dp_elastic import ElasticGroup
from inferhal.core.server.dp_link import TorchrunFront
from inferhal.core.server.dp_metrics import RankCounts, RankPools

log = logging.getLogger("inferhal.server")


class _Lost(Exception):
    """A rank is out of service (the message says which and why)."""


@dataclasses.dataclass
class _Rec:
    prompt: list
    params: Any
    session: Optional[str] = None  # its client's session key (placement)
    last: Any = None  # its latest output, as its stream knows it


@dataclasses.dataclass
class _Rank:
    process: Any
    conn: Any
    hello: Optional[dict] = None
    gauges: dict = dataclasses.field(default_factory=dict)


class DPGroup(ElasticGroup, Fronted, TorchrunFront):
    """The DP ranks behind the server (module docstring). Raises a :class:`UserError` when the group cannot
    start within ``parallel.start_timeout_s``."""

    door: Any = None  # parallel.launcher=torchrun: where the ranks connect (core/server/dp_link.py)
    final = False  # torchrun: the ranks did not come back; no restart is tried

    def __init__(self, cfg: Any) -> None:
        from omegaconf import OmegaConf

        from inferhal.core.config.values import timeout_of

        self.dp = int(cfg.parallel.dp)
        self.timeout_s = timeout_of(cfg.parallel)
        self.max_restarts = int(cfg.parallel.restarts)
        self.start_timeout_s = float(cfg.parallel.start_timeout_s)  # at start and after each restart
        self._cfg = OmegaConf.to_container(cfg, resolve=True)
        self.requests: dict[str, _Rec] = {}
        self._resumed: dict[str, Any] = {}  # request id -> its output as streamed when it was placed again
        self._adds: list[tuple] = []  # (id, prompt ids, params, session key) to hand the ranks at the next step
        self._aborts: list[str] = []
        self._early: list = []  # outputs for the next step() (requests ended while the group was down)
        self.ranks: list[_Rank] = []
        self.state, self.why, self.restarts, self.busy = "starting", None, 0, False
        self.totals: dict[str, int] = {}  # counters of the group's earlier lives (restarts)
        self.front: Any = None
        self.metrics: Any = None  # a DPMetrics (core/server/dp_metrics.py), set by the server
        self.closed = False
        self.scheduler, self.kv_manager = RankCounts(self), RankPools(self)
        self._full_group()  # elastic EP (core/server/dp_elastic.py): which ranks are in place, which were lost
        if str(cfg.parallel.launcher) == "torchrun":
            self._open_door(cfg.parallel)
        self._spawn()
        try:
            while self.state == "starting":
                self._poll_start(strict=True)
                time.sleep(0.02)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ what the server reads

    @property
    def eos_token_ids(self) -> tuple:
        return tuple(self.front.eos_token_ids)

    @property
    def rank_gauges(self) -> list[dict]:
        return self.labelled([r.gauges for r in self.ranks])  # a lost rank's place: {}

    @property
    def down(self) -> Optional[str]:
        """Why the group is out of service (``/health`` answers 503), or None while it serves."""
        if self.state == "live" and all(r.process.is_alive() for r in self.ranks):
            return None
        if self.state == "starting" and self.door is not None:
            return f"waiting for the DP ranks: {self._connected()}/{self.dp} connected" + (
                f" (restart {self.restarts}: {self.why})" if self.why else "")
        return self.why or ("restarting" if self.state == "starting" else "a DP rank exited")

    def health(self) -> dict[str, str]:
        """Each rank's state for ``/health``."""
        def state(i: int, r: _Rank) -> str:
            if self.state == "starting":
                if r.conn is None:
                    return "not connected"
                return f"starting (restart {self.restarts})" if self.restarts else "starting"
            if self.state == "live":
                return "ok" if r.process.is_alive() else f"dead: {self._gone(i)}"
            return f"dead: {self.why}"

        return {**{f"dp{self.labels[i]}": state(i, r) for i, r in enumerate(self.ranks)}, **self.lost_health()}

    # ------------------------------------------------------------------ requests

    def add(self, req: Any) -> str:
        rid = req.request_id
        if rid in self.requests:
            raise UserError(f"request id {rid!r} is already in use")
        if self.state == "dead" and (self.restarts >= self.max_restarts or self.final):
            raise EngineDead(f"the DP group is down ({self.why}) with no restart left")
        self.requests[rid] = _Rec(list(req.prompt_token_ids), req.params, req.session)
        self._adds.append((rid, list(req.prompt_token_ids), req.params, req.session))
        return rid

    def abort(self, request_ids: Iterable[str]) -> list:
        outs = []
        for rid in request_ids:
            rec = self.requests.pop(rid, None)
            if rec is None:
                continue
            before = len(self._adds)
            self._adds = [a for a in self._adds if a[0] != rid]
            if len(self._adds) == before:  # handed to the ranks already: freed on the rank holding it
                self._aborts.append(rid)
            outs.append(self._ended(rid, rec))
        return outs

    def has_unfinished(self) -> bool:
        """Open requests, aborts to send, ranks with work, or a group (re)starting or with a rank gone, or (torchrun)
        ranks at the door to answer."""
        return bool(self.requests or self._aborts or self.busy or self._early) or self.state != "live" or \
            not all(r.process.is_alive() for r in self.ranks) or (self.door is not None and self.door.waiting())

    # ------------------------------------------------------------------ the loop

    def step(self) -> list:
        outs, self._early = self._early, []
        if self.state == "dead":
            if self.final:
                raise RuntimeError(f"the DP group is down ({self.why})")
            if self.restarts >= self.max_restarts:
                raise RuntimeError(f"the DP group is down ({self.why}) and parallel.restarts={self.max_restarts} "
                                   f"restarts are used up")
            self.restarts += 1
            if self.metrics is not None:
                self.metrics.restarted()
            log.warning("restarting the DP group (restart %d of %d)", self.restarts, self.max_restarts)
            self._spawn()
        if self.state == "starting":
            self._poll_start(strict=False)
            if self.state != "live":
                time.sleep(0.02)
                return outs
        if self.door is not None and self.door.waiting() and all(r.process.is_alive() for r in self.ranks):
            self._turn_away()
        adds, aborts = self._adds, self._aborts
        self._adds, self._aborts = [], []
        try:
            replies = self._exchange(("step", (adds, aborts)))
        except _Lost as exc:
            if not self._shrink(str(exc)):  # the survivors go on when the lost rank's experts are covered
                self._down(str(exc))
            return outs + self._early_take()
        got, _, self.busy, failed = replies[0]
        for i, (_, gauges, _, _) in enumerate(replies):
            self.ranks[i].gauges = gauges
        if self.metrics is not None:
            self.metrics.update(self.rank_gauges, self.lost)  # a lost rank's series go (elastic EP)
        for o in got:
            rec = self.requests.get(o.request_id)
            if rec is None:
                continue  # aborted meanwhile
            o = continued(self._resumed, o)
            rec.last = o
            if o.finished:
                del self.requests[o.request_id]
            outs.append(o)
        for rid, why in failed:
            log.error("request %s failed on the DP ranks: %s", rid, why)
            outs.extend(self.abort([rid]))
        return outs

    def _exchange(self, msg: Any) -> list:
        """Send ``msg`` to every rank and wait for every answer; raises :class:`_Lost`."""
        for i, r in enumerate(self.ranks):
            try:
                r.conn.send(msg)
            except (OSError, ValueError) as exc:
                raise _Lost(f"DP rank {i} is gone ({type(exc).__name__}: {exc})") from None
        replies: list = [None] * self.dp
        deadline = time.monotonic() + 2 * self.timeout_s + 10
        left = {r.conn: i for i, r in enumerate(self.ranks)}
        while left:
            ready = wait(list(left), timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            for c in ready:
                i = left.pop(c)
                try:
                    kind, arg = c.recv()
                except (EOFError, OSError):
                    self.ranks[i].process.join(1)
                    raise _Lost(f"DP rank {i} {self._gone(i)}") from None
                if kind == "error":
                    raise _Lost(f"DP rank {i} failed: {arg}")
                replies[i] = arg
            if left and time.monotonic() > deadline:
                raise _Lost(f"DP rank {sorted(left.values())[0]} answered nothing for {2 * self.timeout_s + 10:g} s "
                            f"(parallel.timeout_s={self.timeout_s:g})")
        return replies

    def probe(self, rank: int, timeout: float = 30.0) -> dict:
        """Rank ``rank``'s KV accounting (:func:`~inferhal.core.disagg.workers.accounting`); for tests and
        tools, from the thread that steps the group (or while nothing steps it)."""
        r = self.ranks[rank]
        r.conn.send(("probe", None))
        if not r.conn.poll(timeout):
            raise UserError(f"DP rank {rank} did not answer within {timeout} s")
        return r.conn.recv()[1]

    # ------------------------------------------------------------------ start, death, restart

    def _spawn(self) -> None:
        from inferhal.core import procs
        from inferhal.core.backend import ParallelLayout
        from inferhal.core.parallel.launch import free_port
        from inferhal.core.server.dp_rank import rank_main

        if self.door is not None:  # torchrun starts the ranks (again): they connect to the door
            self.ranks = [self._vacant() for _ in range(self.dp)]
            self.state, self._started, self._shown, self._welcomed = "starting", time.monotonic(), -1, False
            return
        p = self._cfg["parallel"]
        layout = ParallelLayout(world_size=self.dp, rank=0, ep=self.dp, dp=self.dp, master_addr=str(p["master_addr"]),
                                master_port=int(p["master_port"]) or free_port(), timeout_s=self.timeout_s)
        ctx = procs.context()  # a forkserver's: a restart's ranks do not import torch again
        self.ranks = []
        for i in range(self.dp):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(dataclasses.replace(layout, rank=i), self._cfg, theirs),
                               daemon=True, name=f"inferhal-dp{i}")
            proc.start()
            theirs.close()  # the rank holds the only other end: its death is EOF here
            self.ranks.append(_Rank(proc, mine))
        self.state, self._started = "starting", time.monotonic()

    def _poll_start(self, strict: bool) -> None:
        """Read the ranks' hellos; every rank said hello: the group is live, the open requests placed again."""
        why = None
        if self.door is not None:
            self._admit()
        for i, r in enumerate(self.ranks):
            if r.hello is not None or r.conn is None:
                continue
            try:
                if r.conn.poll(0):
                    kind, arg = r.conn.recv()
                    if kind == "error":
                        why = f"DP rank {i} failed to start: {arg}"
                    else:
                        r.hello = arg
                elif not r.process.is_alive():
                    why = f"DP rank {i} exited while starting (code {r.process.exitcode})"
            except (EOFError, OSError):
                why = f"DP rank {i} exited while starting (code {r.process.exitcode})"
            if why and self.door is not None:  # torchrun may start it again: its place waits for it
                log.warning("%s; waiting for it to connect again", why)
                r.process.kill()
                self.ranks[i], why = self._vacant(), None
            if why:
                break
        if why is None and time.monotonic() - self._started > self.start_timeout_s:
            why = f"the DP ranks did not start within parallel.start_timeout_s={self.start_timeout_s:g} s"
            if self.door is not None:
                why = f"{self._connected()}/{self.dp} DP ranks connected to parallel.front within " \
                      f"parallel.start_timeout_s={self.start_timeout_s:g} s (are the torchrun agents running, with " \
                      f"restarts left?)"
                self.final = not strict
        if why is not None:
            if strict:
                raise UserError(why)
            return self._down(why)
        if any(r.hello is None for r in self.ranks):
            return
        h = self.ranks[0].hello
        if self.front is None:
            from inferhal.core.disagg.front import Front

            self.front = Front(h["tokenizer"], h["limits"])
            self.loaded = SimpleNamespace(family=h["family"], name=h["describe"]["model"])
        self.state, self.why, self.busy = "live", None, False
        print(f"[serve] DP group of {self.dp} ranks is live (pids {', '.join(str(r.hello['pid']) for r in self.ranks)})"
              + (f" after restart {self.restarts}" if self.restarts else ""), file=sys.stderr, flush=True)
        self._adds = []
        for rid in list(self.requests):
            self._again(rid)

    def _gone(self, i: int) -> str:
        p = self.ranks[i].process
        return f"exited (code {p.exitcode})" if self.door is None else f"disconnected ({p})"

    @staticmethod
    def _vacant(process: Any = None) -> _Rank:
        """A rank's place: empty, or (torchrun) a :class:`~.dp_link.RemoteRank` that joined."""
        return _Rank(process, None if process is None else process.conn)

    def _down(self, why: str) -> None:
        """The group is out of service: every rank stopped; its requests wait for the next group."""
        log.error("the DP group is down: %s", why)
        for i, r in enumerate(self.ranks):
            for key, v in r.gauges.items():  # counters carried over the restart
                if key in ("preemptions", "drafts", "accepted"):
                    self.totals[key] = self.totals.get(key, 0) + int(v)
            r.gauges = {}  # counted in totals from here
        self._stop_ranks(graceful=False)
        self._full_group()  # the restart brings back every rank
        self.state, self.why, self.busy = "dead", why, False
        self._aborts = []

    def _again(self, rid: str) -> None:
        """Hand ``rid`` to the new group from its prompt and the tokens it streamed (a constrained one ends)."""
        rec = self.requests[rid]
        done = list(rec.last.outputs[0].token_ids) if rec.last is not None else []
        if rec.params.structured is not None and done:
            del self.requests[rid]
            self._early.append(self._ended(rid, rec))
            return
        params = dataclasses.replace(rec.params, max_tokens=rec.params.max_tokens - len(done)) if done else rec.params
        if done:
            self._resumed[rid] = rec.last
        self._adds.append((rid, rec.prompt + done, params, rec.session))

    def _ended(self, rid: str, rec: _Rec) -> Any:
        self._resumed.pop(rid, None)
        return ended(rec.last, rid, rec.prompt, "abort")

    def _early_take(self) -> list:
        outs, self._early = self._early, []
        return outs

    def _stop_ranks(self, graceful: bool) -> None:
        for r in self.ranks:
            if r.conn is not None and (graceful or self.door is not None):
                try:  # a remote rank told to stop for a restart exits 1: its torchrun agent restarts the group
                    r.conn.send(("stop", None if graceful else "the DP group restarts"))
                except (OSError, ValueError):
                    pass
        for r in self.ranks:
            if r.conn is None:
                continue
            if graceful:
                r.process.join(10)
            if r.process.is_alive():
                r.process.kill()
            r.process.join(10)
            r.conn.close()

    def close(self) -> None:
        """Stop the ranks (they leave their group together)."""
        if self.closed:
            return
        self.closed = True
        self._stop_ranks(graceful=self.state == "live")
        if self.door is not None:
            self.door.close()
