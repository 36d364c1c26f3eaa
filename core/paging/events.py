"""KV events: which blocks the prefix cache and its tiers hold, told to an external router as they change.

The wire format is vLLM's ``kv_events`` (``vllm/distributed/kv_events.py``, ``docs/features/kv_events.md``), so
a router written for vLLM (llm-d, NVIDIA Dynamo) reads it unchanged. This module's version of it,
:data:`WIRE_VERSION` 1, is:

- transport: a ZMQ PUB socket (``cache.kv_events_endpoint``; an address with ``*``, ``ipc://`` or ``inproc://``
  is bound, any other connected), each message three frames: the topic (``cache.kv_events_topic``), an 8-byte
  big-endian sequence number (0, 1, ...; one per batch) and the payload;
- payload: a msgpack array ``[ts, events, data_parallel_rank]`` (msgspec's ``array_like`` encoding of vLLM's
  ``KVEventBatch``), each event an array whose first element is its tag:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]``,
  ``["BlockRemoved", block_hashes, medium, group_idx]`` and ``["AllBlocksCleared"]``;
- a block hash is the first 8 bytes of the 16-byte chained hash (:mod:`.hashing`), big-endian, as an unsigned
  64-bit integer (:func:`external_hash`); ``parent_block_hash`` is the previous block's (None for a sequence's
  first block); ``token_ids`` are the stored blocks' tokens, ``block_size`` tokens each;
- ``group_idx`` is the KV group's index in the engine's group list (each group has its own pool: a hybrid
  model stores a block once per group), ``kv_cache_spec_kind`` its kind (full, sliding, compressed) and
  ``kv_cache_spec_sliding_window`` its window; ``medium`` is ``"GPU"`` for the pool (vLLM's name for the device
  pool, whatever the device), ``"CPU"`` for the host tier and ``"DISK"`` for the disk tier (tier stores carry no
  tokens); ``AllBlocksCleared`` empties the pool's medium only;
- replay: a ZMQ ROUTER socket (``cache.kv_events_replay_endpoint``) answers a request whose last frame is an
  8-byte big-endian sequence number with every buffered batch from that number on (``cache.kv_events_buffer_steps``
  batches are kept), each as ``[seq, payload]``, then ``[-1 as 8 signed bytes, b""]``.

A later version only appends optional fields at the ends of these arrays (as vLLM has), so a reader of version 1
keeps working. Events are off unless an endpoint is set; pyzmq and msgspec (the ``models`` extra) are needed then.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Any, Optional, Sequence

from inferhal.core.errors import UserError

log = logging.getLogger(__name__)

WIRE_VERSION = 1
MEDIUM_POOL, MEDIUM_HOST, MEDIUM_DISK = "GPU", "CPU", "DISK"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def external_hash(h: bytes) -> int:
    """A block's hash as vLLM-style routers read it: an unsigned 64-bit integer."""
    return int.from_bytes(h[:8], "big")


class KVEventLog:
    """Events as they happen, in order, until a publisher takes them (thread-safe: the disk tier's writer adds its
    own). ``specs``: the engine's KV groups, in order (``group_idx``)."""

    def __init__(self, specs: Sequence[Any], block_size: int) -> None:
        self.block_size = int(block_size)
        self.index = {s.name: i for i, s in enumerate(specs)}
        self.kind = {s.name: (s.kind, int(s.window) or None) for s in specs}
        self._events: list[list] = []
        self._lock = threading.Lock()
        self.logged = 0  # events ever added

    def _add(self, ev: list) -> None:
        with self._lock:
            self._events.append(ev)
            self.logged += 1

    def stored(self, group: str, hashes: Sequence[bytes], parent: Optional[bytes], token_ids: Sequence[int],
               medium: str = MEDIUM_POOL) -> None:
        kind, window = self.kind[group]
        self._add(["BlockStored", [external_hash(h) for h in hashes],
                   None if parent is None else external_hash(parent), [int(t) for t in token_ids], self.block_size,
                   None, medium, None, None, self.index[group], kind, window])

    def stored_runs(self, group: str, js: Sequence[int], hashes: Sequence[bytes], token_ids: Sequence[int]) -> None:
        """Blocks ``js`` (ascending) of a sequence stored in the pool: one event per run of consecutive blocks."""
        bs, start = self.block_size, 0
        for i in range(1, len(js) + 1):
            if i == len(js) or js[i] != js[i - 1] + 1:
                a, b = js[start], js[i - 1] + 1
                self.stored(group, hashes[a:b], hashes[a - 1] if a else None, token_ids[a * bs:b * bs])
                start = i

    def removed(self, group: str, hashes: Sequence[bytes], medium: str = MEDIUM_POOL) -> None:
        self._add(["BlockRemoved", [external_hash(h) for h in hashes], medium, self.index[group]])

    def cleared(self) -> None:
        self._add(["AllBlocksCleared"])

    # a tier's listener (core/paging/tiers.py)
    def tier_stored(self, medium: str, key: tuple[str, bytes]) -> None:
        self.stored(key[0], [key[1]], None, [], medium)

    def tier_removed(self, medium: str, key: tuple[str, bytes]) -> None:
        self.removed(key[0], [key[1]], medium)

    def take(self) -> list[list]:
        with self._lock:
            out, self._events = self._events, []
        return out


def _require(what: str) -> tuple[Any, Any]:
    try:
        import msgspec
        import zmq
    except ImportError as e:
        raise UserError(f"{what} needs pyzmq and msgspec (the `models` extra: pip install 'inferhal[models]'): "
                        f"{e}") from None
    return zmq, msgspec


class ZmqEventPublisher:
    """Publishes what ``log`` gathers, as one batch every ``interval_s`` at most, from a thread of its own (the
    sockets live there), and answers replay requests from its buffer of the last ``buffer_steps`` batches."""

    def __init__(self, log_: KVEventLog, endpoint: str, replay_endpoint: str = "", topic: str = "",
                 buffer_steps: int = 10_000, interval_s: float = 0.01, dp_rank: int = 0) -> None:
        zmq, msgspec = _require("cache.kv_events_endpoint")
        if buffer_steps < 1:
            raise UserError(f"cache.kv_events_buffer_steps must be >= 1, got {buffer_steps}")
        self.log, self.topic, self.interval_s, self.dp_rank = log_, topic.encode(), interval_s, dp_rank
        self._zmq, self._encode = zmq, msgspec.msgpack.Encoder().encode
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=int(buffer_steps))
        self._seq = itertools.count()
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._replay = None
        try:
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._pub.close(0)
            if self._replay is not None:
                self._replay.close(0)
            raise UserError(f"KV events: cannot open cache.kv_events_endpoint={endpoint!r} / "
                            f"cache.kv_events_replay_endpoint={replay_endpoint!r}: {e}") from None
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode() if self._replay else ""
        self.published = 0  # events sent so far
        self._done = threading.Condition()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="inferhal-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events (wire version %d) on %s%s", WIRE_VERSION, self.endpoint,
                 f", replay on {self.replay_endpoint}" if self._replay else "")

    def _loop(self) -> None:
        wait_ms = max(1, int(self.interval_s * 1000))
        while True:
            running = self._running
            if self._replay is not None and self._replay.poll(wait_ms):
                self._serve_replay()
            elif self._replay is None:
                time.sleep(self.interval_s)
            events = self.log.take()
            if events:
                self._send(events)
            with self._done:
                self._done.notify_all()
            if not running:
                return

    def _send(self, events: list[list]) -> None:
        seq = next(self._seq)
        payload = self._encode([time.time(), events, self.dp_rank])
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except self._zmq.ZMQError as e:  # pragma: no cover - a PUB socket drops rather than fails
            log.warning("KV events: batch %d not sent: %s", seq, e)
        self._buffer.append((seq, payload))
        self.published += len(events)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        ident, start = frames[0], frames[-1]
        if len(frames) < 2 or len(start) != 8:
            log.warning("KV events: a replay request needs an 8-byte sequence number as its last frame")
            self._replay.send_multipart((ident, b"", END_SEQ, b""))
            return
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((ident, b"", END_SEQ, b""))

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event logged before this call is published; False on timeout."""
        want = self.log.logged
        deadline = time.monotonic() + timeout
        with self._done:
            while self.published < want and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._done.wait(left)
        return self.published >= want

    def close(self) -> None:
        if self._running:
            self._running = False
            self._thread.join(timeout=5)
            self._pub.close()
            if self._replay is not None:
                self._replay.close()
