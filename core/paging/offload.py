"""Moving blocks between the pool and its lower tiers (:mod:`.tiers`), in step order.

**Down (write-through).** When the prefix cache registers a block (full and computed:
:meth:`~inferhal.core.paging.kv_manager.KVCacheManager.cache_blocks`), a *save* is queued unless every tier holds
its hash already; it copies the block to the host tier and hands that copy to the disk tier's writer. So a block
the pool evicts later is already below, and a restarted server finds on disk every block it cached.

**Up (restore).** A prefix hit (:meth:`~inferhal.core.paging.kv_manager.KVCacheManager.find_prefix_hit`) takes,
past the blocks the pool holds, those a tier holds (:class:`TierBlock`: the host tier first, then the disk tier,
whose entry is read and checked then, and kept in the host tier). :meth:`allocate` puts each in a fresh pool
block, registered in the prefix cache at once, and queues a *load*. A tier entry that fails its checks ends the
hit there: the rest is computed.

**When copies run.** The engine hands each step the copies queued since the one before (:meth:`KVOffload.take`
when it is scheduled, :meth:`KVOffload.run` on the step thread before its forward). Every write of a block happens
in a step (or right after it, a drafter's, on the same thread), so at that point every block a queued save reads
is written, under asynchronous scheduling too (where ``cache_blocks`` counts a step still in flight). ``run``
hands the saves to the copy worker (:mod:`.copy_worker`), which gathers the blocks and fills the host tier and the
disk tier's files while the step runs; the loads run there and then (a restore's fresh block must hold its bytes
before the step reads it). A block with a save pending is pinned (:mod:`.pending`): no free queue holds it until
the save is over, so nothing writes into it while the worker reads it; an allocation that finds no other free
block waits for the oldest save (counted: ``store_wait_s``). Queued copies also go to the worker when the engine
goes idle (:meth:`KVOffload.idle`). ``KVOffload(asynchronous=False)`` runs the saves on the step thread instead.

Loads stay on the step thread (and a disk tier's file read on the scheduler's, at the hit): a restore is a
scatter of bytes already in host memory (tens of microseconds a token, against milliseconds a token to recompute,
docs/performance.md), and a request waiting for its blocks while others step (vLLM's WAITING_FOR_REMOTE_KVS) would
need a scheduler state that re-admits it once its blocks arrive.

**Who copies.** A :class:`KVBlockCopier` from the backend's ``inferhal_kv_block_copier`` hook (a GPU backend
copies with its own engine, into pinned memory), else :class:`TorchBlockCopier`: plain torch, any torch device.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any, Optional, Protocol, Sequence

import torch

from inferhal.core.errors import UserError
from inferhal.core.paging.block_pool import BlockHash
from inferhal.core.paging.copy_worker import CopyWorker
from inferhal.core.paging.pending import PendingStores, Store
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.core.paging.tiers import DiskTier, HostTier, Key, entry_bytes, fingerprint


class KVBlockCopier(Protocol):
    """Copies whole blocks of one KV group between the pool's storage and host memory."""

    def gather(self, group: str, layers: Sequence[int], block_ids: Sequence[int]) -> list[torch.Tensor]:
        """One host tensor per block, ``[len(layers), slots_per_block, *slot_shape]`` in the storage dtype, holding
        the block's bytes when this returns and owned by the caller (later writes to the block do not reach it)."""

    def scatter(self, group: str, layers: Sequence[int], block_ids: Sequence[int],
                blocks: Sequence[torch.Tensor]) -> None:
        """Write each tensor (as :meth:`gather` gives) into its block, before any later step reads the block."""


class TorchBlockCopier:
    """:class:`KVBlockCopier` in plain torch over a :class:`~inferhal.core.backend.KVStorage`."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage

    def gather(self, group: str, layers: Sequence[int], block_ids: Sequence[int]) -> list[torch.Tensor]:
        caches = [self.storage.layer_cache(group, layer) for layer in layers]
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=caches[0].device)
        stacked = torch.stack([c.index_select(0, idx) for c in caches], dim=1).cpu()  # [n, L, slots, *slot]
        return [t.clone() for t in stacked.unbind(0)]

    def scatter(self, group: str, layers: Sequence[int], block_ids: Sequence[int],
                blocks: Sequence[torch.Tensor]) -> None:
        stacked = torch.stack(list(blocks))  # [n, L, slots, *slot]
        for i, layer in enumerate(layers):
            c = self.storage.layer_cache(group, layer)
            idx = torch.tensor(list(block_ids), dtype=torch.long, device=c.device)
            c.index_copy_(0, idx, stacked[:, i].to(c.device, c.dtype))


class TierBlock:
    """A block a prefix hit takes from a lower tier (in :attr:`PrefixHit.blocks` beside pool blocks): no pool
    block yet (``ref_cnt`` 0: allocation counts it as a new block), ``data`` is what the load writes."""

    __slots__ = ("key", "data", "tier")
    ref_cnt = 0
    block_id = -1

    def __init__(self, key: Key, data: torch.Tensor, tier: str) -> None:
        self.key, self.data, self.tier = key, data, tier


class KVOffload:
    """The tiers behind one engine's prefix cache and the copies between them and the pool (module docstring)."""

    def __init__(self, specs: Sequence[KVGroupSpec], copier: KVBlockCopier, host: Optional[HostTier] = None,
                 disk: Optional[DiskTier] = None, eager: bool = True, asynchronous: bool = True) -> None:
        """``eager``: no step is ever in flight between two steps (synchronous scheduling); ``asynchronous``: saves
        run on the copy worker (False: on the step thread, before the step, as the tiers first did)."""
        if host is None and disk is None:
            raise ValueError("KVOffload needs a host or a disk tier")
        self.layers = {s.name: tuple(s.layers) for s in specs}
        self.copier, self.host, self.disk, self.eager = copier, host, disk, eager
        self.tiers = [t for t in (host, disk) if t is not None]
        self._ops: list[tuple] = []  # ("save", group, block id, Store) | ("load", group, block id, data), in order
        self.pending = PendingStores()  # the pinned blocks of saves not finished (pending.py)
        self.worker = CopyWorker(inline=not asynchronous)
        self._stats_lock = threading.Lock()
        self.store_s = 0.0  # seconds in saves wherever they ran (the worker's, or the step thread's when inline/urgent)
        self.restored = {t.name: 0 for t in self.tiers}  # blocks brought back from each tier
        self.restored_bytes = {t.name: 0 for t in self.tiers}
        self.saved = self.saved_bytes = 0
        self.save_s = self.load_s = 0.0  # step-thread time in copies (saves: handing over, or running them; loads)
        self.fetch_s = {t.name: 0.0 for t in self.tiers}  # time taking blocks from each tier (a file read and check)
        self.restored_groups: dict[str, int] = {}  # blocks restored per KV group (tokens = blocks x block size)

    # ------------------------------------------------------------------ lookups (the scheduler's thread)

    def holds(self, group: str, h: BlockHash) -> bool:
        key = (group, h)
        return any(key in t for t in self.tiers)

    def fetch(self, group: str, h: BlockHash) -> Optional[TierBlock]:
        """The block from the highest tier holding it, or None (not there, or its file failed a check)."""
        key = (group, h)
        if self.host is not None:
            t0 = time.perf_counter()
            t = self.host.get(key)
            self.fetch_s[self.host.name] += time.perf_counter() - t0
            if t is not None:
                return TierBlock(key, t, self.host.name)
        if self.disk is not None:
            t0 = time.perf_counter()
            t = self.disk.get(key)
            if t is not None and self.host is not None:
                self.host.put(key, t)
            self.fetch_s[self.disk.name] += time.perf_counter() - t0
            if t is not None:
                return TierBlock(key, t, self.disk.name)
        return None

    # ------------------------------------------------------------------ the KV manager's events (the pools' thread)

    def bind(self, pools: Any, keep_groups: Sequence[str] = ()) -> None:
        """The KV manager's pools: blocks with a save pending are pinned there (:mod:`.pending`)."""
        self.pending.bind(pools, keep_groups)

    def saving(self, group: str, block: Any, h: BlockHash) -> None:
        """The pool registered ``block`` under ``h``: queue its save unless every tier holds ``h`` (the block is
        pinned until the save is over)."""
        key = (group, h)
        missing = [t for t in self.tiers if key not in t]
        for t in self.tiers:
            t.touch(key)
        if not missing:
            return
        if self.disk is not None and missing == [self.disk] and self.host is not None:
            data = self.host.peek(key)  # the host copy goes down as it is, on the worker
            if data is not None:
                self.worker.submit(self.disk.write, key, data)
                return
        self._ops.append(("save", group, block.block_id, self.pending.pin(group, block, h)))

    def restoring(self, group: str, block_id: int, tb: TierBlock) -> None:
        """``tb`` goes into the fresh pool block ``block_id`` before the next step."""
        self._ops.append(("load", group, block_id, tb.data))
        self.restored[tb.tier] += 1
        self.restored_bytes[tb.tier] += entry_bytes(tb.data)
        self.restored_groups[group] = self.restored_groups.get(group, 0) + 1

    def evicting(self, group: str, block_id: int) -> None:
        """The pool hands ``block_id`` out again: never one with a save pending (pinned), unless
        :meth:`make_room` released it (its save runs on the step thread before the block's next write)."""

    def reap(self) -> None:
        """Unpin the blocks whose saves finished."""
        self.pending.reap()

    def make_room(self, short: Any) -> bool:
        """An allocation found no other free block: free pinned ones (:meth:`PendingStores.make_room`)."""
        return self.pending.make_room(short, self.idle if self.eager else None)

    # ------------------------------------------------------------------ the copies (the step thread)

    def take(self) -> list[tuple]:
        """The copies queued since the last call, for the next step to run first."""
        ops, self._ops = self._ops, []
        return ops

    def run(self, ops: Sequence[tuple]) -> None:
        """Run ``ops`` (from :meth:`take`): the saves go to the copy worker (those :meth:`make_room` made urgent
        run here, first), then the loads run here, batched per group (their blocks are fresh: no save reads them)."""
        if not ops:
            return
        t0 = time.perf_counter()
        urgent, later = self.pending.claim(op[3] for op in ops if op[0] == "save")
        if urgent:
            self._save(urgent)
            self.pending.wait_s += time.perf_counter() - t0
        if later:
            self.worker.submit(self._save, later, on_error=lambda e, st=later: self.pending.finished(st))
        t1 = time.perf_counter()
        for group, items in _by_group(op for op in ops if op[0] == "load").items():
            self.copier.scatter(group, self.layers[group], [b for b, _ in items], [d for _, d in items])
        self.save_s += t1 - t0
        self.load_s += time.perf_counter() - t1

    def _save(self, stores: Sequence[Store]) -> None:
        """Copy the blocks of ``stores`` down (the worker, or the step thread for urgent ones); each block is
        unpinned once gathered, before the tiers' puts and file writes."""
        t0 = time.perf_counter()
        try:
            by_group: dict[str, list[Store]] = {}
            for st in stores:
                by_group.setdefault(st.group, []).append(st)
            for group, items in by_group.items():
                blocks = self.copier.gather(group, self.layers[group], [st.block_id for st in items])
                self.pending.finished(items)  # the copies are ours now: the blocks may be handed out again
                for st, data in zip(items, blocks):
                    key = (group, st.hash)
                    if self.host is not None:
                        self.host.put(key, data)
                    if self.disk is not None:
                        self.disk.write(key, data)
                    with self._stats_lock:
                        self.saved += 1
                        self.saved_bytes += entry_bytes(data)
        finally:
            with self._stats_lock:
                self.store_s += time.perf_counter() - t0
            self.pending.finished(stores)

    def idle(self) -> None:
        """No step in flight: hand what is queued to the worker now (loads run here)."""
        self.run(self.take())

    def flush(self) -> None:
        """Everything queued reaches its tier (the disk tier's files written); call with no step in flight."""
        self.idle()
        self.worker.drain()
        if self.disk is not None:
            self.disk.flush()
        self.pending.reap()

    def close(self, drain: bool = True) -> None:
        """Stop the copy worker (``drain``: after the queued copies; else they are dropped, the blocks simply not in
        the tiers) and the disk tier's writer: no thread is left."""
        if drain:
            self.flush()
        else:
            for op in self.take():
                if op[0] == "save":
                    self.pending.finished([op[3]])
        self.worker.close(drain)
        if self.disk is not None:
            self.disk.close()
        self.pending.reap()

    def stats(self) -> dict[str, Any]:
        """Per tier: blocks and bytes held, blocks and bytes restored from it, its failures and the seconds spent
        taking blocks from it (``fetch_s``). Besides: blocks and bytes saved, the step thread's seconds in saves
        (``save_s``: handing them to the worker, or urgent ones run there) and in loads (``load_s``), ``restore_s``
        (every tier's ``fetch_s`` + ``load_s``: what bringing blocks back cost), the blocks restored per KV group
        (``restored_groups``), ``store_s`` (seconds in saves wherever they ran), ``pending_stores`` (blocks pinned
        now) and ``store_wait_s`` / ``store_waits`` (what allocations and steps waited for saves to finish)."""
        out = {}
        for t in self.tiers:
            out[t.name] = {"blocks": len(t), "bytes": t.nbytes, "restored": self.restored[t.name],
                           "restored_bytes": self.restored_bytes[t.name], "evictions": t.evictions,
                           "failures": t.failures, "fetch_s": self.fetch_s[t.name]}
        return {"tiers": out, "saved": self.saved, "saved_bytes": self.saved_bytes, "save_s": self.save_s,
                "load_s": self.load_s, "restore_s": sum(self.fetch_s.values()) + self.load_s,
                "restored_groups": dict(self.restored_groups), "store_s": self.store_s, **self.pending.stats()}


def build(specs: Sequence[KVGroupSpec], block_size: int, copier: KVBlockCopier, host_bytes: int = 0,
          disk_dir: str = "", disk_bytes: int = 0, layout: Optional[dict] = None, eager: bool = True,
          listener: Any = None, asynchronous: bool = True) -> Optional[KVOffload]:
    """The tiers ``cache.host_tier_bytes`` / ``cache.disk_tier_dir`` / ``cache.disk_tier_bytes`` ask for (None: no
    tier); ``layout`` describes the model and KV layout for the disk tier's folder (:func:`describe`)."""
    for name, v in (("host_tier_bytes", host_bytes), ("disk_tier_bytes", disk_bytes)):
        if v < 0:
            raise UserError(f"cache.{name} must be >= 0, got {v}")
    if disk_bytes and not disk_dir:
        raise UserError(f"cache.disk_tier_bytes={disk_bytes} needs cache.disk_tier_dir (the disk tier's folder)")
    if not host_bytes and not disk_dir:
        return None
    host = HostTier(host_bytes, listener) if host_bytes else None
    disk = None
    if disk_dir:
        expect = {s.name: (s.dtype, (len(s.layers), s.slots_per_block(block_size), *s.slot_shape)) for s in specs}
        disk = DiskTier(disk_dir, fingerprint({**(layout or {}), "block_size": block_size}), disk_bytes, expect,
                        listener)
    return KVOffload(specs, copier, host, disk, eager, asynchronous)


def describe(loaded: Any, specs: Sequence[KVGroupSpec]) -> dict[str, Any]:
    """What must match for a disk tier's blocks to be this model's: its name, family and file (size and
    modification time), every KV group, and a sample of its weights where the model keeps a ``weights`` mapping
    (a randomly initialised test model has no file)."""
    info = dict(getattr(loaded, "info", None) or {})
    path = info.get("path")
    out: dict[str, Any] = {"model": getattr(loaded, "name", "?"), "family": getattr(loaded, "family", "?"),
                           "path": path, "dtype": info.get("dtype"),
                           "groups": [[s.name, s.kind, list(s.layers), list(s.slot_shape), str(s.dtype),
                                       s.tokens_per_slot, s.window, s.record] for s in specs]}
    if path and os.path.exists(str(path)):
        st = os.stat(str(path))
        out["file"] = [st.st_size, st.st_mtime_ns]
    weights = getattr(getattr(loaded, "model", None), "weights", None)
    if isinstance(weights, dict):
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(weights):
            w = weights[name]
            h.update(name.encode())
            if isinstance(w, torch.Tensor):
                h.update(repr((tuple(w.shape), str(w.dtype))).encode())
                h.update(w.detach().reshape(-1)[:16].float().cpu().numpy().tobytes())
        out["weights"] = h.hexdigest()
    return out


def _by_group(ops: Any) -> dict[str, list[tuple[int, Any]]]:
    out: dict[str, list[tuple[int, Any]]] = {}
    for _, group, block_id, x in ops:
        out.setdefault(group, []).append((block_id, x))
    return out
