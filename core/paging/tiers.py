"""Lower tiers of the prefix cache: blocks kept in host memory and in files after the pool lets them go.

A tier entry is one block of one KV group in every layer of the group, keyed by ``(group, chained block hash)``
(:mod:`.hashing`): a tensor ``[layers, slots_per_block, *slot_shape]`` in the pool's storage dtype, the bytes the
pool held (an FP8 or FP4 record stays a record: ``uint8``, :mod:`.formats`). Both tiers evict least recently used
entries first, past a byte capacity. :mod:`.offload` decides what goes in and what comes back.

- :class:`HostTier`: tensors in host memory, ``cache.host_tier_bytes``.
- :class:`DiskTier`: one file per entry under ``cache.disk_tier_dir``/``<fingerprint>``/``<group>``/, written off the
  step (on the KV offload's copy worker, or by :meth:`DiskTier.put`'s thread of its own), ``cache.disk_tier_bytes`` at most (0: only the disk bounds it). The fingerprint
  names the model and the KV layout (:func:`fingerprint`), so a folder never serves another model's blocks; files
  left by an earlier server are found again at start (least recently used first by modification time). A file is
  ``MAGIC`` (its last byte the format version), a little-endian u32 header length, a JSON header (group, hash,
  dtype, shape, payload bytes, CRC-32 of the payload) and the payload. A file that fails any check (truncated,
  corrupt, another layout) is reported, deleted and read as a miss: nothing is served from it. A write that fails
  (a full disk, a folder gone read-only) is reported once per kind of error, and the block is simply not there.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import pathlib
import queue
import re
import struct
import threading
import weakref
import atexit
import zlib
from typing import Any, Iterable, Mapping, Optional

import torch

from inferhal.core.errors import UserError

log = logging.getLogger(__name__)

Key = tuple[str, bytes]  # (KV group, chained block hash)
MAGIC = b"IHKVBLK\x01"
SUFFIX = ".kvb"


def entry_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TierError(UserError, OSError):
    """A tier that cannot be set up as configured (its folder cannot be created or written)."""


def _close_at_exit(ref: "weakref.ref[DiskTier]") -> None:
    """Blocks still queued for the disk are written before the process ends (a restart finds them)."""
    tier = ref()
    if tier is not None:
        tier.close()


class HostTier:
    """Blocks in host memory, least recently used evicted past ``capacity`` bytes. Thread-safe: the step thread
    stores while the scheduler looks up (asynchronous scheduling)."""

    name, medium = "host", "CPU"

    def __init__(self, capacity: int, listener: Optional[Any] = None) -> None:
        self.capacity = int(capacity)
        self.entries: collections.OrderedDict[Key, torch.Tensor] = collections.OrderedDict()
        self.nbytes = 0
        self.listener = listener  # .tier_stored(medium, key), .tier_removed(medium, key) (KV events)
        self.hits = self.stores = self.evictions = self.failures = 0
        self._lock = threading.Lock()

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def peek(self, key: Key) -> Optional[torch.Tensor]:
        """The entry without counting a hit or moving it."""
        return self.entries.get(key)

    def get(self, key: Key) -> Optional[torch.Tensor]:
        with self._lock:
            t = self.entries.get(key)
            if t is not None:
                self.entries.move_to_end(key)
                self.hits += 1
        return t

    def touch(self, key: Key) -> None:
        with self._lock:
            if key in self.entries:
                self.entries.move_to_end(key)

    def put(self, key: Key, t: torch.Tensor) -> bool:
        """Keep ``t`` (owned by the tier from now on) under ``key``; False when it cannot fit at all."""
        n = entry_bytes(t)
        if n > self.capacity:
            return False
        gone = []
        with self._lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return True
            while self.nbytes + n > self.capacity:
                old, ot = self.entries.popitem(last=False)
                self.nbytes -= entry_bytes(ot)
                self.evictions += 1
                gone.append(old)
            self.entries[key] = t
            self.nbytes += n
            self.stores += 1
        if self.listener is not None:
            for old in gone:
                self.listener.tier_removed(self.medium, old)
            self.listener.tier_stored(self.medium, key)
        return True


def _safe(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_.-]+", name) else "x" + name.encode().hex()


def fingerprint(description: Mapping[str, Any]) -> str:
    """A folder name for one model and KV layout: 16 hex digits of the BLAKE2b of its JSON description."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class DiskTier:
    """Blocks in files (see the module docstring). ``expect``: group → (dtype, entry shape) that a file must hold."""

    name, medium = "disk", "DISK"

    def __init__(self, root: str, fp: str, capacity: int, expect: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                 listener: Optional[Any] = None) -> None:
        self.root = pathlib.Path(root).expanduser()
        self.dir = self.root / fp
        self.capacity = int(capacity)
        self.expect = dict(expect)
        self.listener = listener  # .tier_stored(medium, key), .tier_removed(medium, key) (KV events)
        self.hits = self.stores = self.evictions = self.failures = 0
        self.index: collections.OrderedDict[Key, int] = collections.OrderedDict()  # key -> file bytes, LRU first
        self.nbytes = 0
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._prepare()
        self._queue: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None  # put()'s writer, started by the first put()

    # ------------------------------------------------------------------ setup

    def _prepare(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}"
            probe.write_bytes(b"inferhal")
            probe.unlink()
        except OSError as e:
            raise TierError(f"cache.disk_tier_dir={str(self.root)!r} cannot be used for the disk tier: "
                            f"{e.strerror or e} ({type(e).__name__} on {e.filename or self.dir}); give a folder this "
                            f"process can create and write, or leave cache.disk_tier_dir empty") from None
        found = []
        for group in self.expect:
            gdir = self.dir / _safe(group)
            if not gdir.is_dir():
                continue
            for f in gdir.iterdir():
                if ".tmp" in f.name:  # a write cut short by a crash
                    f.unlink(missing_ok=True)
                elif f.suffix == SUFFIX and re.fullmatch(r"[0-9a-f]+", f.stem):
                    st = f.stat()
                    found.append((st.st_mtime_ns, (group, bytes.fromhex(f.stem)), st.st_size))
        for _, key, size in sorted(found, key=lambda x: x[0]):
            self.index[key] = size
            self.nbytes += size
        self._trim()
        if found:
            log.info("disk tier %s: %d blocks (%d bytes) found from an earlier run", self.dir, len(self.index),
                     self.nbytes)

    def path(self, key: Key) -> pathlib.Path:
        return self.dir / _safe(key[0]) / (key[1].hex() + SUFFIX)

    # ------------------------------------------------------------------ lookups (engine thread)

    def __contains__(self, key: Key) -> bool:
        with self._lock:
            return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def touch(self, key: Key) -> None:
        with self._lock:
            if key in self.index:
                self.index.move_to_end(key)

    def get(self, key: Key) -> Optional[torch.Tensor]:
        """The entry, read and checked; None (and the file deleted, a warning logged) when it fails a check."""
        with self._lock:
            if key not in self.index:
                return None
        p = self.path(key)
        try:
            raw = p.read_bytes()
            t = self._decode(key, raw)
        except (OSError, ValueError) as e:
            self._drop(key, p, f"{e}")
            return None
        with self._lock:
            if key in self.index:
                self.index.move_to_end(key)
        try:
            os.utime(p)  # the LRU order survives a restart
        except OSError:
            pass
        self.hits += 1
        return t

    def _decode(self, key: Key, raw: bytes) -> torch.Tensor:
        if len(raw) < len(MAGIC) + 4 or raw[:len(MAGIC)] != MAGIC:
            raise ValueError("not a tier file of this format (bad magic or version)")
        (hlen,) = struct.unpack_from("<I", raw, len(MAGIC))
        start = len(MAGIC) + 4 + hlen
        if start > len(raw):
            raise ValueError(f"truncated header ({len(raw)} bytes)")
        head = json.loads(raw[len(MAGIC) + 4:start].decode())
        dtype, shape = self.expect.get(key[0], (None, None))
        if head.get("group") != key[0] or head.get("hash") != key[1].hex():
            raise ValueError("the header names another block")
        if head.get("dtype") != str(dtype).replace("torch.", "") or tuple(head.get("shape", ())) != tuple(shape):
            raise ValueError(f"holds {head.get('dtype')} {head.get('shape')}, this layout needs {dtype} {list(shape)}")
        payload = raw[start:]
        if len(payload) != head.get("nbytes"):
            raise ValueError(f"truncated: {len(payload)} payload bytes of {head.get('nbytes')}")
        if zlib.crc32(payload) != head.get("crc32"):
            raise ValueError("corrupt: the payload's CRC-32 does not match its header")
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)

    def _drop(self, key: Key, p: pathlib.Path, why: str) -> None:
        log.warning("disk tier: %s is unusable (%s); deleted, the block is a miss (recomputed)", p, why)
        self.failures += 1
        with self._lock:
            size = self.index.pop(key, None)
            if size is not None:
                self.nbytes -= size
        p.unlink(missing_ok=True)
        if size is not None and self.listener is not None:
            self.listener.tier_removed(self.medium, key)

    # ------------------------------------------------------------------ writes (the writer thread)

    def put(self, key: Key, t: torch.Tensor) -> None:
        """Write ``t`` (not changed afterwards by the caller) to its file, on the writer thread (:meth:`write` writes
        on the caller's: the KV offload's copy worker, :mod:`.copy_worker`)."""
        if key in self:
            self.touch(key)
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._writer, name="inferhal-kv-disk", daemon=True)
                self._thread.start()
                atexit.register(_close_at_exit, weakref.ref(self))
        self._queue.put((key, t))

    def _encode(self, key: Key, t: torch.Tensor) -> bytes:
        payload = t.contiguous().view(torch.uint8).numpy().tobytes()
        head = json.dumps({"group": key[0], "hash": key[1].hex(), "dtype": str(t.dtype).replace("torch.", ""),
                           "shape": list(t.shape), "nbytes": len(payload), "crc32": zlib.crc32(payload)}).encode()
        return MAGIC + struct.pack("<I", len(head)) + head + payload

    def _write_file(self, p: pathlib.Path, data: bytes) -> None:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def write(self, key: Key, t: torch.Tensor) -> bool:
        """Write ``t`` to its file now, on this thread (a temporary name renamed into place, so a cut-short write
        leaves no file a restart would read); False when it was not written (a failure is reported once per kind
        of error, the block is simply not there)."""
        if key in self:
            self.touch(key)
            return True
        data = self._encode(key, t)
        if self.capacity and len(data) > self.capacity:
            return False
        try:
            self._write_file(self.path(key), data)
        except OSError as e:
            self.failures += 1
            kind = e.strerror or type(e).__name__
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("disk tier %s: cannot write a block (%s: %s); blocks that fail so are not kept "
                            "there (a later hit on them recomputes)", self.dir, kind, e.filename or "")
            return False
        with self._lock:
            self.index[key] = len(data)
            self.nbytes += len(data)
        self.stores += 1
        if self.listener is not None:
            self.listener.tier_stored(self.medium, key)
        self._trim()
        return True

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self.write(*item)
            except Exception:  # pragma: no cover - the writer must outlive one bad block
                log.exception("disk tier: writing a block failed")
            finally:
                self._queue.task_done()

    def _trim(self) -> None:
        while True:
            with self._lock:
                if not self.capacity or self.nbytes <= self.capacity or not self.index:
                    return
                key, size = self.index.popitem(last=False)
                self.nbytes -= size
            self.path(key).unlink(missing_ok=True)
            self.evictions += 1
            if self.listener is not None:
                self.listener.tier_removed(self.medium, key)

    def flush(self) -> None:
        """Wait until every block handed to :meth:`put` is written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=30)

    def keys(self) -> Iterable[Key]:
        with self._lock:
            return list(self.index)
