"""The router of disaggregated serving: the HTTP server's engine, over prefill and decode instances.

- ``inferhal serve parallel.role=pd``: one launch. The router spawns one prefill and one decode process
  on this host (:func:`~.instance.spawned`), and respawns one that dies (``disagg.restarts`` times each).
- ``inferhal serve parallel.role=router disagg.prefill=[h:p,...] disagg.decode=[h:p,...]``: the router
  alone, in front of instances launched on their own (``parallel.role=prefill|decode``, on any hosts).
  It reconnects to an instance that went away every ``disagg.reconnect_s``, so a restarted instance
  rejoins by itself.

The router loads no weights: it tokenizes and validates with the tokenizer and limits the instances sent
at hello (:class:`~.front.Front`), and refuses at hello an instance whose model or KV layout differs from
the others', naming the difference. It never touches KV: every prefill instance holds a KV link to every
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

**Faults.** An instance is dead when its connection ends (its process died, or its host closed it) or
it sends nothing for ``parallel.timeout_s`` (it sends its gauges at least once a second):

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
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import Any, Iterable, Optional

from inferhal.core.disagg.prefixes import PREFIX_SLACK, Prefixes
from inferhal.core.errors import UserError

log = logging.getLogger("inferhal.disagg")

ROLES = ("prefill", "decode")


@dataclasses.dataclass
class _Inst:
    """One instance as the router holds it."""

    name: str
    role: str
    address: Optional[tuple] = None  # (host, port) where it listens
    process: Any = None  # spawned (parallel.role=pd)
    announce: Any = None  # spawned: the pipe end it says "listening" on
    conn: Any = None  # the connection, while connected
    hello: Optional[dict] = None
    state: str = "starting"  # starting | hello | live | dead
    dead: Optional[str] = None  # why it is out of service
    refused: bool = False  # its model or KV layout differs: never taken back
    restarts: int = 0
    gauges: dict = dataclasses.field(default_factory=dict)
    heard: float = 0.0  # when it last sent anything
    retry_at: float = 0.0  # dead: when to try it again
    probes: "queue.Queue" = dataclasses.field(default_factory=queue.Queue)

    @property
    def live(self) -> bool:
        return self.state == "live"


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
        return range(self._sum("waiting", live=True) + sum(r.at == "pending" for r in list(self._r._reqs.values())))

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


class Router:
    """The HTTP front's engine over prefill and decode instances (module docstring). ``spawn``: start one
    prefill and one decode process here (``parallel.role=pd``); otherwise connect to ``disagg.prefill``
    and ``disagg.decode``."""

    def __init__(self, cfg: Any, spawn: bool, start_timeout_s: float = 600.0) -> None:
        from omegaconf import OmegaConf

        from inferhal.core.disagg.link import authkey_of, parse_address, random_key
        from inferhal.core.parallel.launch import timeout_of

        self.timeout_s = timeout_of(cfg.parallel)
        self.spawn = spawn
        self.key = random_key() if spawn else authkey_of(cfg)
        self.max_restarts = int(cfg.disagg.restarts)
        self.reconnect_s = float(cfg.disagg.reconnect_s)
        self.insts: dict[str, _Inst] = {}
        self._reqs: dict[str, _Rec] = {}
        self._resumed: dict[str, Any] = {}  # request id -> the output it had streamed when it was retried
        self.retried: dict[str, str] = {}  # request id -> the instance it was last retried on (taken there)
        self.pairs: dict[tuple[str, str], dict] = {}  # (prefill, decode) -> {"key", prefill: ok?, decode: ok?}
        self._connected: "queue.Queue" = queue.Queue()  # (name, conn | None, why) from reconnect threads
        self._pair_no = 0
        self._lock = threading.RLock()  # held by step(); probe() reads for itself when no loop is stepping
        self._early: list = []  # outputs read by probe() outside step(), returned by the next step()
        self._prefixes: Optional[Prefixes] = None  # made at the first hello (the block size)
        self.prefix_placed = 0  # requests placed on the prefill instance that was sent their prefix
        self.placed: collections.Counter = collections.Counter()  # (instance, decode instance or None) -> requests
        self.front: Any = None
        self.closed = False
        if spawn:
            d = OmegaConf.to_container(cfg, resolve=True)
            d["parallel"]["role"] = "any"  # each instance's own config: a plain engine, given its role there
            d["disagg"].update(listen="127.0.0.1:0", kv_port=0)
            self._cfg_dict = d
            for role in ROLES:
                self.insts[role] = _Inst(role, role)
                self._spawn(self.insts[role])
        else:
            for role in ROLES:
                for i, text in enumerate(cfg.disagg[role]):
                    name = f"{role}{i}"
                    self.insts[name] = _Inst(name, role, parse_address(text, f"disagg.{role}[{i}]"))
        try:
            self._start(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.scheduler, self.kv_manager = _Counts(self), _Usage(self)

    # ------------------------------------------------------------------ start-up

    def _spawn(self, inst: _Inst) -> None:
        import multiprocessing as mp

        from inferhal.core.disagg.instance import spawned

        ctx = mp.get_context("spawn")
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=spawned, args=(inst.role, self._cfg_dict, self.key, w), daemon=True,
                        name=f"inferhal-{inst.name}")
        p.start()
        w.close()  # the process holds the only write end: its death is EOF here
        inst.process, inst.announce, inst.state, inst.conn, inst.hello = p, r, "starting", None, None

    def _start(self, timeout_s: float) -> None:
        """Every instance connected and said hello, all of one model and KV layout, every pair linked. A
        failure is said, naming the instance, not waited out."""
        deadline = time.monotonic() + timeout_s
        while any(i.state != "live" for i in self.insts.values()):
            for inst in self.insts.values():
                if inst.state == "starting":
                    self._advance_start(inst, wait_s=0.1, strict=True)
                elif inst.state == "hello":
                    self._read_hello(inst, strict=True)
            if time.monotonic() > deadline:
                late = [f"{i.name} ({self._where(i)})" for i in self.insts.values() if i.state != "live"]
                raise UserError(f"no answer within {timeout_s:.0f} s from {', '.join(late)} (is it running, with "
                                f"the same disagg.authkey, and not serving another router?)")
        self._link_all(strict=True, timeout_s=max(deadline - time.monotonic(), self.timeout_s))

    def _where(self, inst: _Inst) -> str:
        if inst.address is not None:
            return f"{inst.address[0]}:{inst.address[1]}"
        return f"pid {inst.process.pid}" if inst.process is not None else "?"

    def _advance_start(self, inst: _Inst, wait_s: float, strict: bool) -> None:
        """A starting instance: a spawned one says where it listens (then we connect); a remote one is
        connected to (at start-up: retried until the deadline)."""
        from multiprocessing import AuthenticationError

        if inst.process is not None:
            try:
                if not inst.announce.poll(wait_s):
                    if not inst.process.is_alive():
                        raise EOFError
                    return
                kind, arg = inst.announce.recv()
            except (EOFError, OSError):
                inst.process.join(1)
                return self._start_failed(inst, f"the {inst.role} process exited (code {inst.process.exitcode})",
                                          strict)
            if kind == "error":
                return self._start_failed(inst, f"the {inst.role} process failed to start: {arg}", strict)
            inst.address = ("127.0.0.1", int(arg[0]))
        try:
            inst.conn = self._dial(inst)
        except AuthenticationError:
            return self._start_failed(inst, f"{inst.name} at {self._where(inst)} refused the key: give the router "
                                            f"and every instance the same disagg.authkey", strict, refuse=True)
        except OSError as exc:
            if inst.process is not None:
                return self._start_failed(inst, f"cannot connect to the {inst.role} process: {exc}", strict)
            time.sleep(wait_s)  # not up yet
            return
        inst.state, inst.heard = "hello", time.monotonic()

    def _start_failed(self, inst: _Inst, why: str, strict: bool, refuse: bool = False) -> None:
        if strict:
            raise UserError(why)
        self._down(inst, why, [], refuse=refuse)

    def _read_hello(self, inst: _Inst, strict: bool, wait_s: float = 0.1) -> None:
        from inferhal.core.disagg.front import Front
        from inferhal.core.disagg.handoff import check_compatible

        try:
            if not inst.conn.poll(wait_s):
                if time.monotonic() - inst.heard > self.timeout_s:
                    raise EOFError("no hello")
                return
            kind, h = inst.conn.recv()
        except (EOFError, OSError) as exc:
            return self._start_failed(inst, f"{inst.name} at {self._where(inst)} closed before its hello ({exc})",
                                      strict)
        if h["role"] != inst.role:
            return self._start_failed(inst, f"{inst.name} at {self._where(inst)} is a {h['role']} instance, listed "
                                            f"as disagg.{inst.role}", strict, refuse=True)
        ref = next((i.hello for i in self.insts.values() if i.hello is not None and i is not inst), None)
        if ref is not None:
            try:
                check_compatible(ref["describe"], h["describe"], me="other", them=inst.name)
            except UserError as exc:
                return self._start_failed(inst, f"{inst.name} at {self._where(inst)} is refused: {exc}", strict,
                                          refuse=True)
        if self.front is None:
            self.front = Front(h["tokenizer"], h["limits"])
            self._prefixes = Prefixes(int(h["describe"]["block_size"]))
        else:
            self.front.tighten(h["limits"])
        h = dict(h, tokenizer=None)
        inst.hello, inst.state, inst.dead, inst.heard = h, "live", None, time.monotonic()
        print(f"[router] {inst.name} ({inst.role} instance at {self._where(inst)}, pid {h['pid']}) is live",
              file=sys.stderr, flush=True)

    def _link_all(self, strict: bool = False, timeout_s: float = 0.0) -> None:
        """Link every live prefill/decode pair not linked yet; at start-up, wait until all are (or fail)."""
        for p in self.insts.values():
            for d in self.insts.values():
                if p.role == "prefill" and d.role == "decode" and p.live and d.live and (p.name, d.name) not in self.pairs:
                    self._link(p, d)
        if not strict:
            return
        deadline = time.monotonic() + timeout_s
        outs: list = []
        while any(not self._usable(pair) for pair in self.pairs):
            for inst in self.insts.values():
                self._drain(inst, outs)
            bad = [(k, v) for k, v in self.pairs.items() if any(isinstance(v.get(r), str) for r in ROLES)]
            if bad:
                (p, d), v = bad[0]
                why = v["prefill"] if isinstance(v["prefill"], str) else v["decode"]
                raise UserError(f"the KV link between {p} and {d} failed: {why}")
            if any(not i.live for i in self.insts.values()):
                raise UserError("; ".join(f"{i.name}: {i.dead}" for i in self.insts.values() if not i.live))
            if time.monotonic() > deadline:
                raise UserError(f"the KV links {sorted(k for k in self.pairs if not self._usable(k))} were not made "
                                f"within {timeout_s:.0f} s (parallel.timeout_s)")
            time.sleep(0.01)

    def _link(self, p: _Inst, d: _Inst) -> None:
        import secrets

        self._pair_no += 1  # a key never used before at that store, by this router or an earlier one
        key = f"{secrets.token_hex(6)}-{self._pair_no}-{p.name}-{d.name}"
        self.pairs[(p.name, d.name)] = {"key": key, "prefill": None, "decode": None}
        port = int(d.hello["kv_port"])
        for inst, peer in ((p, d.name), (d, p.name)):
            self._send(inst, ("link", (peer, key, d.address[0], port, self.timeout_s)))

    def _usable(self, pair: tuple[str, str]) -> bool:
        v = self.pairs.get(pair)
        return v is not None and v["prefill"] is True and v["decode"] is True

    # ------------------------------------------------------------------ what the server calls

    @property
    def tokenizer(self) -> Any:
        return self.front.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.front.max_model_len

    @property
    def model(self) -> Any:
        return self.front.model

    @property
    def failed(self) -> dict[str, str]:
        """Instances out of service: name -> why."""
        return {n: i.dead for n, i in self.insts.items() if i.dead is not None}

    def health(self) -> dict[str, str]:
        """Each instance's state for ``/health``: ``ok``, ``starting (restart n)`` or ``dead: why``."""
        return {n: "ok" if i.live else f"dead: {i.dead}" if i.state == "dead" else f"starting (restart {i.restarts})"
                if i.restarts else "starting" for n, i in self.insts.items()}

    def make_request(self, prompt, params=None, request_id=None, extra_keys=()):
        return self.front.make_request(prompt, params, request_id, extra_keys)  # raises on a bad request

    def add(self, req: Any) -> str:
        rid = req.request_id
        if rid in self._reqs:
            raise UserError(f"request id {rid!r} is already in use")
        if not any(i.live or i.state in ("starting", "hello") for i in self.insts.values()):
            from inferhal.core.server.async_engine import EngineDead

            raise EngineDead("no engine instance is live (" + "; ".join(f"{n}: {i.dead}" for n, i in self.insts.items())
                             + (f"); the router tries each again every {self.reconnect_s:g} s" if not self.spawn else ")"))
        self._reqs[rid] = rec = _Rec(list(req.prompt_token_ids), req.params, "pending")
        self._place(rid, rec, rec.prompt, rec.params, once=False)
        return rid

    def has_unfinished(self) -> bool:
        """True while the router runs: it watches its instances (deaths, restarts, reconnects) every step."""
        return not self.closed

    def abort(self, request_ids: Iterable[str]) -> list:
        outs = []
        for rid in request_ids:
            rec = self._reqs.pop(rid, None)
            if rec is None:
                continue
            for name in {rec.where, rec.dest if rec.at in ("prefill", "handed") else None} - {None}:
                self._send(self.insts[name], ("abort", rid))
            last = rec.last or self._empty(rid, rec)
            outs.append(self._resume(dataclasses.replace(last, finished=True, new_token_ids=[], new_text="", outputs=[
                dataclasses.replace(last.outputs[0], finish_reason="abort")])))
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
            stranded = [rid for rid, r in self._reqs.items() if r.at == "pending"]
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

    def close(self) -> None:
        """Stop the spawned processes; leave separately launched instances running (they abort this
        router's requests and wait for the next router)."""
        self.closed = True
        for inst in self.insts.values():
            if inst.conn is not None and inst.process is not None:
                self._send(inst, ("stop", None))
            if inst.conn is not None:
                inst.conn.close()
        for inst in self.insts.values():
            p = inst.process
            if p is not None:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)

    # ------------------------------------------------------------------ placement

    def _load(self, inst: _Inst) -> tuple:
        if inst.role == "prefill":
            return (sum(len(r.prompt) for r in self._reqs.values() if r.where == inst.name and r.at == "prefill"),
                    int(inst.gauges.get("running", 0)))
        return (sum(1 for r in self._reqs.values() if (r.dest == inst.name and r.at in ("prefill", "handed"))
                    or (r.where == inst.name and r.at == "decode")), float(inst.gauges.get("kv_usage", 0.0)))

    def _place(self, rid: str, rec: _Rec, prompt: list, params: Any, once: bool,
               avoid: Optional[str] = None) -> None:
        """Send ``rid`` to the least loaded live instance (module docstring), or hold it ``pending``."""
        pre = [i for i in self.insts.values() if i.role == "prefill" and i.live]
        dec = [i for i in self.insts.values() if i.role == "decode" and i.live and i.name != avoid]
        load = {i.name: self._load(i) for i in pre + dec}
        if pre:
            on = self._by_prefix(pre, prompt, load)
            linked = [d for d in dec if self._usable((on.name, d.name))]
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

    def _by_prefix(self, pre: list, prompt: list, load: dict) -> _Inst:
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
        for rid, rec in list(self._reqs.items()):
            if rec.at == "pending":
                self._place(rid, rec, *rec.held)

    def _send(self, inst: _Inst, msg: Any) -> None:
        if inst.conn is None or inst.state == "dead":
            return
        try:
            inst.conn.send(msg)
        except OSError:
            pass  # its end is seen at its next read

    # ------------------------------------------------------------------ the instances' messages

    def _drain(self, inst: _Inst, outs: list) -> None:
        while inst.live:
            try:
                if not inst.conn.poll():
                    return
                kind, arg = inst.conn.recv()
            except (EOFError, OSError):
                if inst.process is not None:
                    inst.process.join(1)
                    why = f"the {inst.role} process exited (code {inst.process.exitcode})"
                else:
                    why = f"{inst.name} at {self._where(inst)} closed its connection"
                self._down(inst, why, outs)
                return
            inst.heard = time.monotonic()
            self._handle(inst, kind, arg, outs)

    def _handle(self, inst: _Inst, kind: str, arg: Any, outs: list) -> None:
        if kind == "outputs":
            got, inst.gauges = arg
            for o in got:
                self._output(inst, o, outs)
        elif kind == "gauges":
            inst.gauges = arg
        elif kind == "taken":
            rec = self._reqs.get(arg)
            if rec is not None:
                self.retried[arg] = inst.name
                if rec.retry_from is not None:
                    self._resumed[arg] = rec.retry_from
        elif kind == "skipped":
            log.info("request %s: its KV reached %s before its retry did; it runs from there", arg, inst.name)
        elif kind == "probe":
            inst.probes.put(arg)
        elif kind == "linked":
            peer, why = arg
            pair = (inst.name, peer) if inst.role == "prefill" else (peer, inst.name)
            if pair in self.pairs:
                self.pairs[pair][inst.role] = True if why is None else why
            if why is not None:
                log.error("the KV link %s -> %s failed on %s: %s", *pair, inst.name, why)
        elif kind == "link_lost":
            peer, why = arg
            self._unlink(inst.name, peer, why)
        elif kind == "failed":
            rid, why = arg
            rec = self._reqs.get(rid)
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
            rec = self._reqs.get(rid)
            if rec is not None and rec.at == "handed" and rec.where == inst.name:
                self._retry(rid, avoid=peer)

    def _output(self, inst: _Inst, o: Any, outs: list) -> None:
        rid = o.request_id
        rec = self._reqs.get(rid)
        handed = o.finished and o.outputs[0].finish_reason == "transferred"
        if rec is None:
            return  # aborted (its hand-off target was told so) or from before a retry
        if inst.name == rec.dest and rec.at == "prefill":  # the prefill instance said "handed" first: read that first
            self._drain(self.insts[rec.where], outs)
            if self._reqs.get(rid) is not rec:
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
            del self._reqs[rid]
        outs.append(o)
        if handed and (rec.dest is None or not self.insts[rec.dest].live):
            self._retry(rid)

    # ------------------------------------------------------------------ faults, restarts, reconnects

    def _watch(self, outs: list) -> None:
        now = time.monotonic()
        for inst in self.insts.values():
            if inst.live:
                if inst.process is not None and not inst.process.is_alive():
                    self._drain(inst, outs)  # what it sent before it died, then EOF
                elif inst.process is None and now - inst.heard > self.timeout_s:
                    self._down(inst, f"{inst.name} at {self._where(inst)} sent nothing for {self.timeout_s:g} s "
                                     f"(parallel.timeout_s)", outs)
            elif inst.state == "starting" and inst.process is not None:
                self._advance_start(inst, wait_s=0, strict=False)
            elif inst.state == "hello":
                self._read_hello(inst, strict=False, wait_s=0)
                if inst.live:
                    self._link_all()
                    self._place_pending()
            elif inst.state == "dead" and not inst.refused and now >= inst.retry_at:
                if inst.process is not None and inst.restarts < self.max_restarts:
                    inst.restarts += 1
                    log.warning("restarting %s (restart %d of %d)", inst.name, inst.restarts, self.max_restarts)
                    self._spawn(inst)
                elif inst.process is None and self.reconnect_s > 0:
                    inst.retry_at = float("inf")  # one try at a time
                    threading.Thread(target=self._reconnect, args=(inst,), daemon=True).start()
        while True:
            try:
                name, conn = self._connected.get_nowait()
            except queue.Empty:
                break
            inst = self.insts[name]
            if conn is None or self.closed:
                inst.retry_at = time.monotonic() + self.reconnect_s
                continue
            inst.conn, inst.state, inst.heard, inst.hello = conn, "hello", time.monotonic(), None

    def _dial(self, inst: _Inst) -> Any:
        """A connection to ``inst``'s address (raises as :func:`~inferhal.core.disagg.link.connect`)."""
        from inferhal.core.disagg.link import Locked, connect

        return Locked(connect(inst.address, self.key, timeout_s=min(5.0, self.timeout_s)))

    def _reconnect(self, inst: _Inst) -> None:
        try:
            conn = self._dial(inst)
        except Exception:  # noqa: BLE001 - not back yet
            conn = None
        self._connected.put((inst.name, conn))

    def _down(self, inst: _Inst, why: str, outs: list, refuse: bool = False) -> None:
        """``inst`` is out of service: its requests are placed again, its links dropped."""
        was_live = inst.live
        inst.state, inst.dead, inst.refused = "dead", why, inst.refused or refuse
        if self._prefixes is not None:
            self._prefixes.forget(inst.name)  # its cache died with it (a rejoined instance starts empty)
        inst.retry_at = time.monotonic() + (self.reconnect_s if inst.process is None else 0.0)
        if inst.conn is not None:
            inst.conn.close()
            inst.conn = None
        if inst.process is not None and inst.process.is_alive():
            inst.process.kill()
        log.error("%s: %s", inst.name, why)
        for pair in [k for k in self.pairs if inst.name in k]:
            del self.pairs[pair]
            other = pair[1] if pair[0] == inst.name else pair[0]
            self._send(self.insts[other], ("unlink", inst.name))
        if not was_live:
            return
        for rid, rec in list(self._reqs.items()):
            if inst.role == "prefill" and rec.where == inst.name:
                if rec.at == "handed" and rec.dest is not None and self.insts[rec.dest].live:
                    self._retry(rid, on=rec.dest)  # the KV may be there already: it takes whichever comes first
                else:
                    self._retry(rid)
            elif inst.role == "decode" and (rec.where == inst.name or (rec.dest == inst.name and rec.at == "handed")):
                self._retry(rid, avoid=inst.name)
            elif rec.dest == inst.name:  # still prefilling: its prefill instance keeps it
                rec.dest = None

    def _unlink(self, name: str, peer: str, why: str) -> None:
        """A KV link broke with both ends alive (or one about to be seen dead): drop it; made again at the
        next step while both are live."""
        p, d = (name, peer) if self.insts[name].role == "prefill" else (peer, name)
        if self.pairs.pop((p, d), None) is not None:
            log.warning("the KV link %s -> %s is down (%s)", p, d, why)
            for a, b in ((p, d), (d, p)):
                self._send(self.insts[a], ("unlink", b))

    def _retry(self, rid: str, on: Optional[str] = None, avoid: Optional[str] = None) -> None:
        """Run ``rid`` again from its prompt and what it streamed: on ``on`` (a decode instance, to run it
        there) or wherever placement says (never handed to ``avoid``)."""
        rec = self._reqs[rid]
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
