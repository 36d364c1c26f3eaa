"""The wires of disaggregated serving: the router's connection to each instance, and the KV link of each
prefill/decode pair.

- **Router ↔ instance**: one ``multiprocessing.connection`` (TCP, HMAC challenge on connect with a shared
  key) per instance. The instance listens on ``disagg.listen``; the router connects. Messages are pickled
  Python objects (requests, outputs, a tokenizer at hello), which is why the key is required: only a
  holder of ``disagg.authkey`` (or the environment variable ``INFERHAL_DISAGG_KEY``) may connect. A spawned
  pair (``parallel.role=pd``) gets a random key of its own.
- **KV link**: a 2-rank ``torch.distributed`` gloo group per prefill/decode pair (:func:`pair_group`), met
  at the decode instance's TCP store (``disagg.kv_port``) under a key the router draws for that pair, so
  any number of pairs coexist in one process and one pair's loss touches no other.
"""

from __future__ import annotations

import datetime
import os
import queue
import secrets
import threading
from typing import Any, Optional

from inferhal.core.errors import UserError

KEY_ENV = "INFERHAL_DISAGG_KEY"


def authkey_of(cfg: Any, required: bool = True) -> Optional[bytes]:
    """``disagg.authkey``, else the environment's ``INFERHAL_DISAGG_KEY``; refused when neither is set."""
    key = cfg.disagg.authkey if cfg.disagg.authkey is not None else os.environ.get(KEY_ENV) or None
    if key is None and required:
        raise UserError(f"disaggregated serving needs a shared key on the router and every instance: set "
                        f"disagg.authkey=... or the environment variable {KEY_ENV} (the same on all of them)")
    return None if key is None else str(key).encode()


def random_key() -> bytes:
    return secrets.token_hex(16).encode()


def parse_address(text: str, field: str) -> tuple[str, int]:
    """``host:port`` → ``(host, port)``, or a :class:`UserError` naming ``field``."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UserError(f"{field}: {text!r} is not an address (write host:port, e.g. 10.0.0.5:7100)")
    return host.strip("[]"), int(port)


def listen(address: tuple[str, int], key: bytes) -> Any:
    from multiprocessing.connection import Listener

    try:
        return Listener(address, family="AF_INET", authkey=key)
    except OSError as exc:
        raise UserError(f"could not listen on {address[0]}:{address[1]} for the router: {exc}") from None


def connect(address: tuple[str, int], key: bytes, timeout_s: float) -> Any:
    """A connection to the instance at ``address``; raises ``OSError`` (nothing listens there within
    ``timeout_s``) or ``multiprocessing.AuthenticationError`` (another key)."""
    import socket
    from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

    sock = socket.create_connection(address, timeout=timeout_s)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    try:
        if not conn.poll(timeout_s):  # an instance serving another router accepts no one until that one goes
            raise ConnectionError(f"{address[0]}:{address[1]} accepted the connection but sent no challenge within "
                                  f"{timeout_s:g} s (is it serving another router?)")
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
    except BaseException:
        conn.close()
        raise
    return conn


def reader(conn: Any, into: "queue.Queue", name: str) -> threading.Thread:
    """A thread putting every message of ``conn`` on ``into``, then ``("router_gone", why)`` at its end."""
    def run() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError) as exc:
                into.put(("router_gone", f"{type(exc).__name__}: {exc}"))
                return
            into.put(msg)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


class Locked:
    """A connection whose ``send`` is safe from several threads."""

    def __init__(self, conn: Any) -> None:
        self.conn, self._lock = conn, threading.Lock()

    def send(self, msg: Any) -> None:
        with self._lock:
            self.conn.send(msg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def kv_store(host: str, port: int, timeout_s: float) -> Any:
    """The decode instance's rendezvous store for its KV links (``port`` 0: any free port)."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise UserError(f"could not open the KV link store on {host}:{port} (disagg.kv_port): {exc}") from None


def pair_group(store: Any, key: str, host: str, port: int, rank: int, timeout_s: float) -> Any:
    """The 2-rank gloo group of one prefill/decode pair under ``key`` (rank 0 prefill, 1 decode). The decode
    side passes its own ``store``; the prefill side connects to ``host:port``. Blocks until both joined
    (at most ``timeout_s``); a receive that waits ``timeout_s`` ends the link (the prefill side's
    heartbeats keep an idle link alive)."""
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=td)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"{key}/", store), rank, 2, td)
