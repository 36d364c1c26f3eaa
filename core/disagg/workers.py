"""The engine side of disaggregated serving: one prefill or decode **instance**, its KV links to its peers,
and the loop that serves the router (:mod:`.router`).

An instance is one engine process with role ``prefill`` or ``decode``: spawned by the router
(``inferhal serve parallel.role=pd``) or launched on its own (``inferhal serve parallel.role=prefill`` /
``decode``, on any host; :mod:`.instance`). The router is its only client, over one authenticated
connection (:mod:`.link`); KV never passes through the router. Every prefill instance has one KV link to
every decode instance the router names: a 2-rank ``torch.distributed`` gloo group of its own (prefill rank
0, decode rank 1), met at the decode instance's store (:func:`.link.pair_group`), carried by the backend's
KV connector. A link is made, lost and made again without touching the others, so an instance that dies
or restarts costs only its own links.

Messages, plain data:

- router → instance (``ctl``, a queue fed from the router's connection; ``("router_gone", why)`` when it
  closes): ``("add", (rid, prompt_ids, params, once, to))`` run a request here from its prompt (``once``: a
  retry, skipped when this instance already holds or held ``rid``; ``to``: the decode instance a prefill
  instance hands it to, ``None``: decode it here); ``("abort", rid)``; ``("link", (peer, key, host, port,
  timeout_s))``: make the KV link to ``peer`` (the pair meets at the decode side's store ``host:port``
  under ``key``); ``("unlink", peer)``; ``("probe", None)``: answer ``("probe", accounting)``; ``("stop",
  None)``.
- instance → router (``out``): ``("outputs", (outputs, gauges))`` after each step that gave outputs;
  ``("gauges", gauges)`` at least once a second (the router's sign of life, also through long prefills); ``("taken", rid)`` /
  ``("skipped", rid)`` for a retry; ``("failed", (rid, why))`` a request this instance cannot run;
  ``("linked", (peer, why))`` a link is up (``why`` None) or could not be made; ``("link_lost", (peer,
  why))``; ``("send_failed", (rid, peer, why))`` a hand-off the decode peer never got.

A payload that reaches a decode instance for a request it already took as a retry (or was told to abort)
is dropped before anything is allocated for it: whichever of the two comes first runs the request.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Callable, Optional

#: seconds between an idle instance's ``gauges`` messages (the router's sign of life)
IDLE_BEAT_S = 1.0


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
    """The prefill side's end of one KV link: sends one payload at a time (a lock: a payload is several
    transport messages), and a heartbeat from its own thread whenever nothing was sent for ``every``
    seconds, however long a step takes (a receive that waits out the group's timeout closes a gloo link for
    good). A failed heartbeat is kept in ``broken`` for the loop to report."""

    def __init__(self, conn: Any, every: float) -> None:
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
            except Exception as exc:  # noqa: BLE001 - the decode instance is gone
                self.broken = f"{type(exc).__name__}: {exc}"
                return


def gauges(eng: Any) -> dict:
    """What the router reads of an instance: its batch, queue and KV pool (for /metrics and placement)."""
    s = eng.scheduler
    return {"running": len(s.running), "waiting": len(s.waiting) + len(eng.transfer.pending()),
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


def make_link(role: str, eng: Any, store: Any, key: str, host: str, port: int, timeout_s: float) -> Any:
    """This side's KV connector of one link, its peer checked (blocks until the peer joins, at most
    ``timeout_s``). ``store``: the decode side's own store (it hosts the pair's rendezvous), None on the
    prefill side (it connects to ``host:port``)."""
    from inferhal.core.disagg.connector import connect
    from inferhal.core.disagg.handoff import check_compatible, describe
    from inferhal.core.disagg.link import pair_group

    rank = 0 if role == "prefill" else 1
    group = pair_group(store, key, host, port, rank, timeout_s)
    conn = connect(eng.backend, 1 - rank, group)
    them = "decode" if role == "prefill" else "prefill"
    check_compatible(describe(eng), conn.handshake(describe(eng)), me=role, them=them)
    return conn


class _Links:
    """This instance's KV links, by peer name. Prefill side: a :class:`_Sender` each. Decode side: a
    receiving thread each, putting ``("kv", peer, payload)`` or ``("lost", peer, why)`` on ``events``.
    Links are made on threads of their own (a pair waits for its peer); ``("linked", peer, conn|None,
    why)`` lands on ``events`` when done."""

    def __init__(self, role: str, eng: Any, store: Any, heartbeat_s: float) -> None:
        self.role, self.eng, self.store, self.heartbeat_s = role, eng, store, heartbeat_s
        self.events: "queue.Queue" = queue.Queue()
        self.senders: dict[str, _Sender] = {}
        self.gen: dict[str, int] = collections.defaultdict(int)  # a peer's link generation (stale events dropped)

    def start(self, peer: str, key: str, host: str, port: int, timeout_s: float) -> None:
        self.drop(peer)  # a link made before is stale from here (drop starts a new generation)
        g = self.gen[peer]

        def run() -> None:
            try:
                conn = make_link(self.role, self.eng, self.store, key, host, port, timeout_s)
            except Exception as exc:  # noqa: BLE001 - said to the router, which names it
                self.events.put(("linked", peer, g, None, f"{type(exc).__name__}: {exc}"))
                return
            self.events.put(("linked", peer, g, conn, None))

        threading.Thread(target=run, name=f"inferhal-kv-link-{peer}", daemon=True).start()

    def up(self, peer: str, g: int, conn: Any) -> bool:
        """A made link goes live (False: a newer ``start`` or a ``drop`` made it stale)."""
        if g != self.gen[peer]:
            return False
        if self.role == "prefill":
            self.senders[peer] = _Sender(conn, self.heartbeat_s)
        else:
            def receive() -> None:
                while self.gen[peer] == g:
                    try:
                        payload = conn.recv()
                    except Exception as exc:  # noqa: BLE001 - the prefill instance is gone
                        self.events.put(("lost", peer, g, None, f"{type(exc).__name__}: {exc}"))
                        return
                    if not payload.state.get("heartbeat"):
                        self.events.put(("kv", peer, g, payload, None))

            threading.Thread(target=receive, name=f"inferhal-kv-recv-{peer}", daemon=True).start()
        return True

    def drop(self, peer: str) -> None:
        self.gen[peer] += 1
        s = self.senders.pop(peer, None)
        if s is not None:
            s.stopped.set()

    def close(self) -> None:
        for peer in list(self.senders):
            self.drop(peer)


def serve_router(role: str, eng: Any, store: Any, ctl: Any, out: Any, probe: Optional[Callable] = None,
                 heartbeat_s: float = 30.0, alive: Callable[[], bool] = lambda: True) -> str:
    """Serve one router until ``stop`` (→ ``"stop"``), the router's connection closes (→ ``"router_gone"``,
    every request here aborted and every link dropped, so the next router finds a clean instance) or
    ``alive()`` turns false. ``probe(answer)`` answers a probe (default: ``out.send(("probe", answer))``)."""
    from inferhal.core.errors import UserError

    probe = probe or (lambda acc: out.send(("probe", acc)))
    links = _Links(role, eng, store, heartbeat_s)
    held = _Recent()  # decode: adopted, retried or aborted ids (a late payload or retry for them is dropped)
    dest: dict[str, Optional[str]] = {}  # prefill: request id -> the decode instance it is handed to
    beat = time.monotonic()
    try:
        while alive():
            busy = eng.has_unfinished()
            while True:  # links made or lost, payloads arrived
                try:
                    kind, peer, g, arg, why = links.events.get(timeout=0.01) if not busy else links.events.get_nowait()
                except queue.Empty:
                    break
                if g != links.gen[peer]:
                    continue  # from a link since dropped or made again
                if kind == "linked":
                    if arg is not None:
                        links.up(peer, g, arg)
                    out.send(("linked", (peer, why)))
                elif kind == "lost":
                    links.drop(peer)
                    out.send(("link_lost", (peer, why)))
                else:  # a payload
                    rid = str(arg.state["request_id"])
                    if rid in held:
                        continue  # taken as a retry or aborted first: nothing was allocated for it
                    held.add(rid)
                    try:
                        eng.transfer.add(arg)
                    except UserError as exc:
                        out.send(("failed", (rid, str(exc))))
                    busy = True
            while True:
                try:
                    cmd, arg = ctl.get_nowait() if busy else ctl.get(timeout=0.05)
                except queue.Empty:
                    break
                if cmd in ("stop", "router_gone"):
                    return cmd
                if cmd == "add":
                    rid, prompt, params, once, to = arg
                    if once and (rid in eng.scheduler.requests or (role == "decode" and rid in held)):
                        out.send(("skipped", rid))
                        continue
                    held.add(rid)
                    try:
                        eng.add(eng.make_request(prompt, params, request_id=rid))
                    except (UserError, ValueError) as exc:
                        out.send(("failed", (rid, str(exc))))
                        continue
                    if role == "prefill":
                        dest[rid] = to
                        if to is None:
                            eng.transfer.keep_local.add(rid)
                    if once:
                        out.send(("taken", rid))
                elif cmd == "abort":
                    held.add(arg)
                    dest.pop(arg, None)
                    eng.abort([arg])
                elif cmd == "link":
                    links.start(*arg)
                elif cmd == "unlink":
                    links.drop(arg)
                elif cmd == "probe":
                    probe(accounting(eng))
                busy = eng.has_unfinished()
            for peer, s in list(links.senders.items()):
                if s.broken:  # a heartbeat failed: that decode instance is gone
                    links.drop(peer)
                    out.send(("link_lost", (peer, s.broken)))
            if time.monotonic() - beat > IDLE_BEAT_S:  # a sign of life, idle or in steps that give no output
                out.send(("gauges", gauges(eng)))
                beat = time.monotonic()
            if not eng.has_unfinished():
                continue
            outs = eng.step()
            handoffs = eng.transfer.take() if role == "prefill" else []
            if outs:
                out.send(("outputs", (outs, gauges(eng))))  # before the hand-offs: the router sees "transferred" first
                beat = time.monotonic()
            for o in outs:
                if o.finished and o.outputs[0].finish_reason != "transferred":
                    dest.pop(o.request_id, None)
            for payload in handoffs:
                rid = str(payload.state["request_id"])
                peer = dest.pop(rid, None)
                sender = links.senders.get(peer) if peer is not None else None
                if sender is None:
                    out.send(("send_failed", (rid, peer, f"no KV link to {peer!r}")))
                    continue
                try:
                    sender.send(payload)
                except Exception as exc:  # noqa: BLE001 - the decode instance is gone
                    links.drop(peer)
                    out.send(("send_failed", (rid, peer, f"{type(exc).__name__}: {exc}")))
        return "gone"
    finally:
        links.close()
        eng.abort([*eng.scheduler.requests, *eng.transfer.pending()])
        if role == "prefill":
            eng.transfer.keep_local.clear()
