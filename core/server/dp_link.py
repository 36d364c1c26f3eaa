"""The wire between ``inferhal serve``'s DP front and DP ranks launched by torchrun, on this host or others
(``parallel=dep4 parallel.launcher=torchrun parallel.front=HOST:PORT``).

The front (the HTTP server, no weights) listens on ``parallel.front``; each rank, started by torchrun with the
same command line, connects there with ``multiprocessing.connection`` (TCP, an HMAC challenge both ways with
the key in the environment variable ``INFERHAL_DP_KEY``, the same on every host: the messages are pickled
Python objects). The connection then carries exactly the messages a spawned rank's pipe carries
(core/server/dp_rank.py), after one more exchange first:

- rank → front ``("join", {"rank", "world_size", "config", "pid", "host", "master"})`` before the rank loads
  anything: its torchrun ``RANK`` and ``WORLD_SIZE``, the fields of its resolved config that change what it
  computes (:func:`numerics`) and, from rank 0, ``(MASTER_ADDR, a free port on its host)``;
- front → rank ``("refused", why)`` at once: a ``WORLD_SIZE`` other than ``parallel.dp``, a ``RANK`` outside it
  or already connected, a config that differs from the front's (the message names each field and both values),
  or a group already complete; a refused rank exits with status 2, naming the reason. Else, once every rank has
  joined, ``("welcome", (addr, port))`` to each: rank 0's ``master``, where the ranks form their process group,
  with rank 0 hosting a new store (``TORCHELASTIC_USE_AGENT_STORE=False``). torchrun's own store (its agents'
  ``MASTER_PORT``) outlives a restart of the group with the previous group's keys in it, so a new group formed
  there can read a dead rank's address (seen here: a restarted rank 0 connecting to its dead peer's old port).

:class:`Door` is the front's listener (a thread accepting connections and reading their joins);
:class:`RemoteRank` stands where a spawned rank's ``multiprocessing.Process`` stands for
:class:`~inferhal.core.server.dp_serve.DPGroup`; :func:`join_front` is the rank's side.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional

from inferhal.core.errors import UserError

KEY_ENV = "INFERHAL_DP_KEY"
#: what a rank's config must share with the front's: the groups and fields that decide what it computes and
#: where requests are placed (every rank runs the same placement)
NUMERIC = ("model", "backend", "scheduler", "cache", "spec", "eplb", "seed", "deterministic", "parallel.tp",
           "parallel.ep", "parallel.dp", "parallel.tbo", "parallel.dp_balance", "parallel.dp_balance_margin")
#: fields left out of the comparison: each host's own copy of the weights may live at another path
HOST_LOCAL = ("model.path",)
JOIN_WAIT_S = 10.0  # how long an accepted connection has to send its join

log = logging.getLogger("inferhal.server")


def key_of(env: Optional[Mapping[str, str]] = None) -> bytes:
    """The shared key from ``INFERHAL_DP_KEY``; refused when it is not set."""
    key = (os.environ if env is None else env).get(KEY_ENV) or None
    if key is None:
        raise UserError(f"parallel.launcher=torchrun: the front and its DP ranks talk over TCP with a shared key; set "
                        f"the environment variable {KEY_ENV} to the same secret on the front and on every rank's host")
    return str(key).encode()


def front_address(parallel: Any) -> tuple[str, int]:
    """``parallel.front`` as ``(host, port)``, checked: the address the front listens on and the ranks connect to."""
    from inferhal.core.disagg.link import parse_address

    text = str(parallel.front or "")
    if not text:
        raise UserError("parallel.launcher=torchrun: set parallel.front=HOST:PORT, the address where the front listens "
                        "for its DP ranks and where they connect (the same on the front and on every rank)")
    host, port = parse_address(text, "parallel.front")
    if port == 0:
        raise UserError(f"parallel.front={text!r}: the ranks need a fixed port to connect to (1..65535), not 0")
    return host, port


def numerics(cfg_node: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`NUMERIC` fields of a resolved config (a plain dict), flattened to dotted names."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif prefix not in HOST_LOCAL:
            out[prefix] = value

    for name in NUMERIC:
        value: Any = cfg_node
        for part in name.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        walk(name, value)
    return out


def differences(front: Mapping[str, Any], rank: Mapping[str, Any]) -> list[str]:
    """Each field whose value differs, as ``name=<rank's> (the front has <front's>)``."""
    missing = object()

    def shown(side: Mapping[str, Any], k: str) -> str:
        return repr(side[k]) if k in side else "nothing"

    return [f"{k}={shown(rank, k)} (the front has {shown(front, k)})" for k in sorted(set(front) | set(rank))
            if front.get(k, missing) != rank.get(k, missing)]


def refusal(join: Any, dp: int, front_config: Mapping[str, Any], connected: Mapping[int, str]) -> Optional[str]:
    """Why the front refuses a rank's ``join`` (None: it is welcome). ``connected``: rank → who holds it."""
    if not isinstance(join, dict) or not {"rank", "world_size", "config"} <= set(join):
        return "its first message was not a join (is it an inferhal DP rank of the same version?)"
    rank, world = join["rank"], join["world_size"]
    if world != dp:
        return f"WORLD_SIZE={world} but the front serves parallel.dp={dp} ranks (torchrun's --nnodes x " \
               f"--nproc-per-node must make {dp})"
    if not 0 <= rank < dp:
        return f"RANK={rank} is outside the front's {dp} ranks"
    diff = differences(front_config, join["config"])
    if diff:
        return "its config differs from the front's in what it computes: " + "; ".join(diff)
    if rank in connected:
        return f"RANK={rank} is already connected ({connected[rank]}); is another torchrun group pointed at this front?"
    return None


def answer_joins(door: "Door", dp: int, front_config: Mapping[str, Any], held: dict[int, str],
                 full: bool = False) -> list[tuple[int, "RemoteRank"]]:
    """Refuse (:func:`refusal`) or accept each rank waiting at ``door``; → ``(rank, RemoteRank)`` of the accepted
    ones (welcomed later). ``held``: rank → who holds it (updated); ``full``: the group is live, all are refused."""
    accepted = []
    for conn, join in door.take():
        why = refusal(join, dp, front_config, held) or ("the DP group is complete" if full else None)
        if why:
            log.error("refused a DP rank at parallel.front: %s", why)
            try:
                conn.send(("refused", why))
            except (OSError, ValueError):
                pass
            conn.close()
            continue
        remote = RemoteRank(conn, join)
        held[join["rank"]] = str(remote)
        accepted.append((join["rank"], remote))
    return accepted


class RemoteRank:
    """A rank connected over TCP, standing where a spawned rank's ``multiprocessing.Process`` stands: ``pid``,
    ``exitcode`` (always None: its exit status is its torchrun agent's to see), ``is_alive()`` (its connection
    is open: a peek, safe beside a thread reading it), ``kill()`` (close the connection), ``join()``."""

    exitcode = None

    def __init__(self, conn: Any, join: dict) -> None:
        self.conn, self.pid, self.host = conn, join.get("pid"), join.get("host", "?")
        self.master = join.get("master")  # rank 0: where the group's store will be
        self.gone = False

    def is_alive(self) -> bool:
        if self.gone:
            return False
        try:
            sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        except (OSError, ValueError):  # closed here
            self.gone = True
            return False
        try:
            if select.select([sock], [], [], 0)[0] and not sock.recv(1, socket.MSG_PEEK):
                self.gone = True  # end of stream: the rank's process ended
        except OSError:
            self.gone = True
        finally:
            sock.close()
        return not self.gone

    def kill(self) -> None:
        self.gone = True
        try:
            self.conn.close()
        except OSError:
            pass

    def join(self, timeout: Optional[float] = None) -> None:
        return None

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}"


class Door:
    """The front's listener on ``address``: a thread accepts ranks' connections and greets each on a thread of its
    own (the key check with ``key`` both ways, then its join, each within :data:`JOIN_WAIT_S`, so a peer that
    connects and says nothing holds up no one); :meth:`take` hands over ``(connection, join)`` pairs that arrived."""

    def __init__(self, address: tuple[str, int], key: bytes) -> None:
        self.address, self.key = address, key
        try:
            self.sock = socket.create_server(address)
        except OSError as exc:
            raise UserError(f"could not listen on {address[0]}:{address[1]} (parallel.front) for the DP ranks: "
                            f"{exc}") from None
        self.arrived: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
        self.closed = False
        threading.Thread(target=self._accept, name="inferhal-dp-door", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                if self.closed:
                    return
                continue
            threading.Thread(target=self._greet, args=(sock,), name="inferhal-dp-greet", daemon=True).start()

    def _greet(self, sock: socket.socket) -> None:
        from multiprocessing import AuthenticationError
        from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

        def cut() -> None:  # a peer silent past JOIN_WAIT_S: the blocked read below ends (EOF)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        conn = Connection(os.dup(sock.fileno()))  # its own descriptor: ``sock`` is closed once greeted
        timer = threading.Timer(JOIN_WAIT_S, cut)
        timer.start()
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
            join = conn.recv()[1] if conn.poll(JOIN_WAIT_S) else None
        except AuthenticationError as exc:
            log.warning("a connection to parallel.front failed the key check (%s): is %s the same on its host?",
                        exc, KEY_ENV)
            conn.close()
            return
        except (OSError, EOFError, TypeError, IndexError, ValueError):
            conn.close()
            return
        finally:
            timer.cancel()
            sock.close()
        self.arrived.put((conn, join))

    def waiting(self) -> bool:
        return not self.arrived.empty()

    def take(self) -> list[tuple[Any, Any]]:
        got = []
        while True:
            try:
                got.append(self.arrived.get_nowait())
            except queue.Empty:
                return got

    def close(self) -> None:
        self.closed = True
        self.sock.close()
        for conn, _ in self.take():
            conn.close()


def join_front(address: tuple[str, int], key: bytes, join: dict, timeout_s: float) -> Any:
    """The rank's side: connect to the front at ``address`` (retrying while nothing listens there, for up to
    ``timeout_s``), send ``join``, and → (the connection, the group's master address) once welcomed (every rank
    joined, within ``timeout_s``); a :class:`UserError` when refused, or when no front answered in time."""
    from multiprocessing import AuthenticationError

    from inferhal.core.disagg.link import connect

    where = f"{address[0]}:{address[1]} (parallel.front)"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = connect(address, key, max(1.0, deadline - time.monotonic()))
            break
        except AuthenticationError:
            raise UserError(f"the DP front at {where} refused this rank's key: set {KEY_ENV} to the front's") from None
        except OSError as exc:
            if time.monotonic() > deadline:
                raise UserError(f"no DP front answered at {where} within parallel.timeout_s={timeout_s:g} s: "
                                f"{exc}") from None
            time.sleep(0.5)
    conn.send(("join", join))
    if not conn.poll(timeout_s):
        conn.close()
        raise UserError(f"the DP front at {where} did not welcome this rank within parallel.timeout_s={timeout_s:g} s "
                        f"(it welcomes the ranks once all of them joined)")
    try:
        kind, arg = conn.recv()
    except (EOFError, OSError):
        raise UserError(f"the DP front at {where} closed the connection after this rank's join") from None
    if kind != "welcome":
        conn.close()
        raise UserError(f"the DP front at {where} refused RANK={join['rank']}: {arg}")
    return conn, tuple(arg)


class TorchrunFront:
    """:class:`~inferhal.core.server.dp_serve.DPGroup`'s part under ``parallel.launcher=torchrun``, mixed into it:
    it reads the group's ``ranks`` (each with ``process`` and ``conn``, both None while its place is empty),
    ``dp``, ``door`` and ``_vacant(process=None)`` (a place, empty or held by a :class:`RemoteRank`)."""

    ranks: list
    dp: int
    door: Any
    _vacant: Callable[..., Any]

    def _open_door(self, parallel: Any) -> None:
        self.door, self._numerics = Door(front_address(parallel), key_of()), numerics(self._cfg)  # type: ignore
        self._shown, self._welcomed = -1, False

    def _connected(self) -> int:
        return sum(r.conn is not None for r in self.ranks)

    def _admit(self) -> None:
        """Free the places of ranks that disconnected, welcome or refuse the ranks that joined, and say how many
        are connected when that changes."""
        for i, r in enumerate(self.ranks):
            if r.conn is not None and not r.process.is_alive():
                log.warning("DP rank %d (%s) disconnected while the group starts; waiting for it again", i, r.process)
                if self._welcomed:  # the others wait for it in their group's forming: they start again too
                    self._welcomed = False
                    for other in self.ranks:
                        if other.conn is not None:
                            other.process.kill()
                    self.ranks = [self._vacant() for _ in self.ranks]
                    break
                r.process.kill()
                self.ranks[i] = self._vacant()
        held = {i: str(r.process) for i, r in enumerate(self.ranks) if r.conn is not None}
        for i, remote in answer_joins(self.door, self.dp, self._numerics, held):
            self.ranks[i] = self._vacant(remote)
        if self._connected() == self.dp and not self._welcomed:
            self._welcomed = True
            for r in self.ranks:
                try:
                    r.conn.send(("welcome", self.ranks[0].process.master))
                except (OSError, ValueError):
                    r.process.kill()  # freed at the next call
        if self._connected() != self._shown:
            self._shown = self._connected()
            print(f"[serve] {self._shown}/{self.dp} DP ranks connected to {self.door.address[0]}:"
                  f"{self.door.address[1]}", file=sys.stderr, flush=True)

    def _turn_away(self) -> None:
        """The group is live: refuse whoever joins (every place is held)."""
        answer_joins(self.door, self.dp, self._numerics, {i: str(r.process) for i, r in enumerate(self.ranks)}, True)
