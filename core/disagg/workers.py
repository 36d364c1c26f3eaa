"""The two engine processes of ``inferhal serve parallel.role=pd``: a prefill process and a decode process,
each spawned by the router (:mod:`.router`), each loading the model itself. They form a 2-rank group
(prefill rank 0, decode rank 1) for the backend's KV connector; a request's KV and state move prefill →
decode over it, never through the router.

One body, :func:`role_worker`, serves both roles. Messages, plain data:

- router → worker (``ctl``, a queue with the router as its only writer):
  ``("join", None)`` once both have loaded their model (start-up);
  ``("add", (rid, prompt_ids, params, once, keep_local))`` run a request here from its prompt (``once``: a
  retry, skipped when this worker already holds or held ``rid``; ``keep_local``: decode it here, never
  hand it off); ``("abort", rid)``; ``("colocate", why)``: the peer is dead, run every request to its end
  here from now on; ``("probe", None)``: answer on ``probe`` with this worker's KV accounting;
  ``("stop", None)``.
- worker → router (``out``, this worker's end of a pipe; the router sees EOF when the process dies):
  ``("loaded", None)``, ``("ready", None)`` (joined, peer checked) or ``("error", why)`` at start; ``("outputs", (outputs, gauges))`` after each step
  that gave outputs; ``("taken", rid)`` / ``("skipped", rid)`` for a retry; ``("failed", (rid, why))`` a
  request this worker cannot run; ``("send_failed", (rid, why))`` a hand-off (or, ``rid`` None, a
  heartbeat) the decode peer never got.

A payload that reaches the decode worker for a request it already took as a retry (or was told to abort)
is dropped before anything is allocated for it: whichever of the two comes first runs the request.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from typing import Any

ROLE_RANK = {"prefill": 0, "decode": 1}


class _Recent:
    """The last ``cap`` request ids seen (a retry or a late payload only races a recent request)."""

    def __init__(self, cap: int = 65536) -> None:
        self._ids: collections.OrderedDict = collections.OrderedDict()
        self.cap = cap

    def add(self, rid: str) -> None:
        self._ids[rid] = None
        while len(self._ids) > self.cap:
            self._ids.popitem(last=False)

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids


class _Sender:
    """The prefill side's end of the KV link: sends one payload at a time (a lock: a payload is several
    transport messages), and a heartbeat from its own thread whenever nothing was sent for ``every``
    seconds, however long a step takes (a receive that waits out the group's timeout closes a gloo link for
    good). A failed heartbeat is kept in ``broken`` for the loop to report."""

    def __init__(self, conn: Any, every: float) -> None:
        import time

        self.conn, self.every, self.clock = conn, float(every), time.monotonic
        self.lock = threading.Lock()
        self.last = self.clock()
        self.broken: str | None = None
        self.stopped = threading.Event()
        threading.Thread(target=self._beat, name="inferhal-kv-heartbeat", daemon=True).start()

    def send(self, payload: Any) -> None:
        with self.lock:
            self.conn.send(payload)
            self.last = self.clock()

    def _beat(self) -> None:
        from inferhal.core.disagg.connector import KVPayload

        while not self.stopped.wait(min(self.every / 4, 1.0)):
            if self.clock() - self.last < self.every:
                continue
            try:
                self.send(KVPayload({"heartbeat": True}))
            except Exception as exc:  # noqa: BLE001 - the decode process is gone
                self.broken = f"{type(exc).__name__}: {exc}"
                return


def gauges(eng: Any) -> dict:
    """What the router's /metrics shows of this worker: its batch, queue and KV pool."""
    s = eng.scheduler
    return {"running": len(s.running), "waiting": len(s.waiting) + len(eng._transfers),
            "kv_usage": float(eng.kv_manager.usage()), "preemptions": int(s.num_preemptions),
            "drafts": int(s.num_draft_tokens), "accepted": int(s.num_accepted_tokens)}


def accounting(eng: Any) -> dict:
    """The probe's answer: the requests holding blocks and the pool's own consistency check."""
    try:
        eng.kv_manager.check()
        problem = None
    except Exception as exc:  # noqa: BLE001 - reported, the caller decides
        problem = f"{type(exc).__name__}: {exc}"
    return {"kv_requests": sorted(eng.kv_manager.reqs), "unfinished": bool(eng.has_unfinished()),
            "kv_usage": float(eng.kv_manager.usage()), "check": problem}


def _load(role: str, cfg_dict: dict) -> tuple[Any, float]:
    """This role's engine over the model loaded here, and the group's timeout (``parallel.timeout_s``)."""
    from omegaconf import OmegaConf

    from inferhal.core.config import schema
    from inferhal.core.engine.engine import Engine
    from inferhal.core.engine.llm import LLM, _to
    from inferhal.core.parallel.launch import timeout_of

    cfg = OmegaConf.create(cfg_dict)
    llm = LLM.from_config(cfg)
    e = llm.engine
    eng = Engine(e.loaded, e.backend, e.scheduler.cfg, _to(schema.CacheConfig, cfg.cache), e.max_model_len,
                 seed=int(cfg.seed), spec=_to(schema.SpecConfig, cfg.spec), role=role)
    return eng, timeout_of(cfg.parallel)


def _join(role: str, eng: Any, port: int, timeout_s: float) -> Any:
    """Join the 2-rank group (both processes have loaded: the router says when) and check the peer."""
    from inferhal.core.backend import ParallelLayout
    from inferhal.core.disagg.handoff import check_compatible, describe

    rank = ROLE_RANK[role]
    eng.backend.communicator(ParallelLayout(world_size=2, rank=rank, master_port=port, timeout_s=timeout_s))
    conn = eng.backend.kv_connector(1 - rank)
    them = "decode" if role == "prefill" else "prefill"
    check_compatible(describe(eng), conn.handshake(describe(eng)), me=role, them=them)
    return conn


def role_worker(role: str, cfg_dict: dict, port: int, ctl: Any, out: Any, probe: Any) -> None:
    """The body of the prefill or the decode process (``role``); ends with ``os._exit`` (gloo's threads can
    abort an interpreter's finalization after the work succeeded). It loads, says ``loaded``, joins the
    group when the router says ``join`` (both have loaded then, so joining waits for no model load), says
    ``ready``, and serves."""
    parent = os.getppid()
    try:
        eng, timeout_s = _load(role, cfg_dict)
        out.send(("loaded", None))
        while True:
            try:
                cmd, _ = ctl.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:
                    os._exit(0)
                continue
            if cmd == "stop":
                os._exit(0)
            if cmd == "join":
                break
        conn = _join(role, eng, port, timeout_s)
        out.send(("ready", None))
    except BaseException as exc:  # noqa: BLE001 - said to the router, which fails with it
        try:
            out.send(("error", f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(0)
    try:
        _loop(role, eng, conn, ctl, out, probe, parent, heartbeat_s=timeout_s / 4)
    finally:
        os._exit(0)


def _loop(role: str, eng: Any, conn: Any, ctl: Any, out: Any, probe: Any, parent: int,
          heartbeat_s: float = 30.0) -> None:
    """Serve until ``stop`` or the router's death. The prefill side sends a heartbeat whenever it has sent
    nothing for ``heartbeat_s`` (:class:`_Sender`)."""
    from inferhal.core.errors import UserError

    held = _Recent()  # decode: adopted, retried or aborted ids (a late payload or retry for them is dropped)
    inbox: "queue.Queue" = queue.Queue()  # decode: payloads from the receiving thread
    colocated = False  # the peer is dead: every request runs to its end here
    sender = _Sender(conn, heartbeat_s) if role == "prefill" else None
    if role == "decode":
        def receive() -> None:
            while True:
                try:
                    payload = conn.recv()
                except Exception as exc:  # noqa: BLE001 - the prefill process is gone
                    inbox.put(("gone", str(exc)))
                    return
                inbox.put(("kv", payload))

        threading.Thread(target=receive, name="inferhal-kv-recv", daemon=True).start()
    while os.getppid() == parent:  # the router is gone: so is this worker
        busy = eng.has_unfinished()
        while True:  # decode: adopt what arrived
            try:
                kind, arg = inbox.get(timeout=0.01) if role == "decode" and not busy else inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "gone" or arg.state.get("heartbeat"):
                continue
            rid = str(arg.state["request_id"])
            if rid in held:
                continue  # taken as a retry or aborted first: nothing was allocated for it
            held.add(rid)
            try:
                eng.add_transferred(arg)
            except UserError as exc:
                out.send(("failed", (rid, str(exc))))
            busy = True
        while True:
            try:
                if busy or role == "decode":
                    cmd, arg = ctl.get_nowait()
                else:
                    cmd, arg = ctl.get(timeout=0.2)
            except queue.Empty:
                break
            if cmd == "stop":
                if sender is not None:
                    sender.stopped.set()
                return
            if cmd == "add":
                rid, prompt, params, once, keep_local = arg
                if once and (rid in eng.scheduler.requests or (role == "decode" and rid in held)):
                    out.send(("skipped", rid))
                    continue
                held.add(rid)
                try:
                    eng.add(eng.make_request(prompt, params, request_id=rid))
                except (UserError, ValueError) as exc:
                    out.send(("failed", (rid, str(exc))))
                    continue
                if keep_local:
                    eng.keep_local.add(rid)
                if once:
                    out.send(("taken", rid))
            elif cmd == "abort":
                held.add(arg)
                eng.abort([arg])
            elif cmd == "colocate":
                colocated = True
                if role == "prefill":
                    eng.role = "any"  # hands nothing off from now on
                    sender.stopped.set()
            elif cmd == "probe":
                probe.put(accounting(eng))
            busy = eng.has_unfinished()
        if sender is not None and sender.broken and not colocated:  # a heartbeat failed: the decode process is gone
            colocated = True
            eng.role = "any"
            out.send(("send_failed", (None, sender.broken)))
        if not eng.has_unfinished():
            continue
        outs = eng.step()
        handoffs = eng.take_handoffs() if role == "prefill" else []
        if outs:
            out.send(("outputs", (outs, gauges(eng))))  # before the hand-offs: the router sees "transferred" first
        for payload in handoffs:
            rid = str(payload.state["request_id"])
            if colocated:
                out.send(("send_failed", (rid, "the decode process is gone")))
                continue
            try:
                sender.send(payload)
            except Exception as exc:  # noqa: BLE001 - the decode process is gone
                colocated = True
                eng.role = "any"
                sender.stopped.set()
                out.send(("send_failed", (rid, f"{type(exc).__name__}: {exc}")))
