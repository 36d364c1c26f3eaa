"""The instances behind the router of disaggregated serving (:mod:`.router`): started, linked, watched.

- ``parallel.role=pd``: one prefill and one decode process are spawned on this host
  (:func:`~.instance.spawned`); one that dies is spawned again (``disagg.restarts`` times each).
- ``parallel.role=router``: instances launched on their own (``disagg.prefill``, ``disagg.decode``, on any
  hosts) are dialled; one that went away is dialled again every ``disagg.reconnect_s``, so a restarted
  instance rejoins by itself.

Each instance says hello first (its role, KV description, limits, tokenizer); one whose role, model or KV
layout differs from the others' is refused for good, naming the difference. Every live prefill instance
then holds a KV link to every live decode instance (:mod:`.workers`), asked for here and made by the two.
An instance is dead when its connection ends (its process died, or its host closed it) or it sends
nothing for ``parallel.timeout_s`` (it sends its gauges at least once a second). :class:`Fleet` knows
nothing of requests: :class:`~.router.Router` adds them through :meth:`Fleet._hello`,
:meth:`Fleet._joined`, :meth:`Fleet._lost` and :meth:`Fleet._handle`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sys
import threading
import time
from typing import Any, Optional

from inferhal.core import procs
from inferhal.core.errors import UserError

log = logging.getLogger("inferhal.disagg")

ROLES = ("prefill", "decode")


@dataclasses.dataclass
class Member:
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


class Fleet:
    """The prefill and decode instances (module docstring). ``spawn``: start one prefill and one decode process
    here (``parallel.role=pd``); otherwise dial ``disagg.prefill`` and ``disagg.decode``. Raises a
    :class:`~inferhal.core.errors.UserError` naming the instance when one cannot be started or linked
    within ``start_timeout_s``."""

    def __init__(self, cfg: Any, spawn: bool, start_timeout_s: float = 600.0) -> None:
        from omegaconf import OmegaConf

        from inferhal.core.disagg.link import authkey_of, parse_address, random_key
        from inferhal.core.config.values import timeout_of

        self.timeout_s = timeout_of(cfg.parallel)
        self.spawn = spawn
        self.key = random_key() if spawn else authkey_of(cfg)
        self.max_restarts = int(cfg.disagg.restarts)
        self.reconnect_s = float(cfg.disagg.reconnect_s)
        self.insts: dict[str, Member] = {}
        self.pairs: dict[tuple[str, str], dict] = {}  # (prefill, decode) -> {"key", prefill: ok?, decode: ok?}
        self._connected: "queue.Queue" = queue.Queue()  # (name, conn | None) from reconnect threads
        self._pair_no = 0
        self.closed = False
        if spawn:
            d = OmegaConf.to_container(cfg, resolve=True)
            d["parallel"]["role"] = "any"  # each instance's own config: a plain engine, given its role there
            d["disagg"].update(listen="127.0.0.1:0", kv_port=0)
            self._cfg_dict = d
            for role in ROLES:
                self.insts[role] = Member(role, role)
                self._spawn(self.insts[role])
        else:
            for role in ROLES:
                for i, text in enumerate(cfg.disagg[role]):
                    name = f"{role}{i}"
                    self.insts[name] = Member(name, role, parse_address(text, f"disagg.{role}[{i}]"))
        try:
            self._start(start_timeout_s)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ what the subclass adds

    def _hello(self, inst: Member, hello: dict) -> None:
        """``inst`` said ``hello`` (checked: its role, model and KV layout) and is about to be live."""

    def _joined(self) -> None:
        """An instance came back (restarted or reconnected), and its links were asked for."""

    def _lost(self, inst: Member, was_live: bool, outs: list) -> None:
        """``inst`` went out of service (its links dropped); ``outs``: outputs for the server."""

    def _handle(self, inst: Member, kind: str, arg: Any, outs: list) -> None:
        """A message from ``inst``: here, those about links, gauges and probes."""
        if kind == "gauges":
            inst.gauges = arg
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
        else:
            log.error("%s sent an unknown message %r", inst.name, kind)

    # ------------------------------------------------------------------ start-up

    def _spawn(self, inst: Member) -> None:
        from inferhal.core.disagg.instance import spawned

        ctx = procs.context()
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

    def _where(self, inst: Member) -> str:
        if inst.address is not None:
            return f"{inst.address[0]}:{inst.address[1]}"
        return f"pid {inst.process.pid}" if inst.process is not None else "?"

    def _advance_start(self, inst: Member, wait_s: float, strict: bool) -> None:
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

    def _start_failed(self, inst: Member, why: str, strict: bool, refuse: bool = False) -> None:
        if strict:
            raise UserError(why)
        self._down(inst, why, [], refuse=refuse)

    def _read_hello(self, inst: Member, strict: bool, wait_s: float = 0.1) -> None:
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
        self._hello(inst, h)
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
        while any(not self.linked(pair) for pair in self.pairs):
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
                raise UserError(f"the KV links {sorted(k for k in self.pairs if not self.linked(k))} were not made "
                                f"within {timeout_s:.0f} s (parallel.timeout_s)")
            time.sleep(0.01)

    def _link(self, p: Member, d: Member) -> None:
        import secrets

        self._pair_no += 1  # a key never used before at that store, by this router or an earlier one
        key = f"{secrets.token_hex(6)}-{self._pair_no}-{p.name}-{d.name}"
        self.pairs[(p.name, d.name)] = {"key": key, "prefill": None, "decode": None}
        port = int(d.hello["kv_port"])
        for inst, peer in ((p, d.name), (d, p.name)):
            self._send(inst, ("link", (peer, key, d.address[0], port, self.timeout_s)))

    def linked(self, pair: tuple[str, str]) -> bool:
        """Whether the KV link of ``(prefill, decode)`` is made at both ends."""
        v = self.pairs.get(pair)
        return v is not None and v["prefill"] is True and v["decode"] is True

    # ------------------------------------------------------------------ state

    @property
    def failed(self) -> dict[str, str]:
        """Instances out of service: name -> why."""
        return {n: i.dead for n, i in self.insts.items() if i.dead is not None}

    def health(self) -> dict[str, str]:
        """Each instance's state for ``/health``: ``ok``, ``starting (restart n)`` or ``dead: why``."""
        return {n: "ok" if i.live else f"dead: {i.dead}" if i.state == "dead" else f"starting (restart {i.restarts})"
                if i.restarts else "starting" for n, i in self.insts.items()}

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

    def _send(self, inst: Member, msg: Any) -> None:
        if inst.conn is None or inst.state == "dead":
            return
        try:
            inst.conn.send(msg)
        except OSError:
            pass  # its end is seen at its next read

    def _drain(self, inst: Member, outs: list) -> None:
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
                    self._joined()
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

    def _dial(self, inst: Member) -> Any:
        """A connection to ``inst``'s address (raises as :func:`~inferhal.core.disagg.link.connect`)."""
        from inferhal.core.disagg.link import Locked, connect

        return Locked(connect(inst.address, self.key, timeout_s=min(5.0, self.timeout_s)))

    def _reconnect(self, inst: Member) -> None:
        try:
            conn = self._dial(inst)
        except Exception:  # noqa: BLE001 - not back yet
            conn = None
        self._connected.put((inst.name, conn))

    def _down(self, inst: Member, why: str, outs: list, refuse: bool = False) -> None:
        """``inst`` is out of service: its connection closed (its process killed), its links dropped, then
        :meth:`_lost`."""
        was_live = inst.live
        inst.state, inst.dead, inst.refused = "dead", why, inst.refused or refuse
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
        self._lost(inst, was_live, outs)
    def _unlink(self, name: str, peer: str, why: str) -> None:
        """A KV link broke with both ends alive (or one about to be seen dead): drop it; made again at the
        next step while both are live."""
        p, d = (name, peer) if self.insts[name].role == "prefill" else (peer, name)
        if self.pairs.pop((p, d), None) is not None:
            log.warning("the KV link %s -> %s is down (%s)", p, d, why)
            for a, b in ((p, d), (d, p)):
                self._send(self.insts[a], ("unlink", b))
