"""Pool blocks whose save to a lower tier has not finished (:mod:`.offload`): the pending-store state.

A save is queued when the prefix cache registers a block (write-through) and runs later on the copy worker
(:mod:`.copy_worker`). From its queueing until it finished the block is *pinned*: it holds one more reference
(:meth:`~inferhal.core.paging.block_pool.BlockPool.touch`), so it never joins a free queue, the free-block count the
scheduler sees excludes it, and nothing is written into it while the worker reads it. Like vLLM's connector, which
delays freeing a finished request's blocks while their stores run, a block whose request ended meanwhile is freed
when its save is done (:meth:`PendingStores.reap`, on the thread that owns the pools; a sliding group's block joins
the kept queue, as :meth:`~inferhal.core.paging.kv_manager.KVCacheManager.free` would have put it).

When an allocation finds no other free block, :meth:`PendingStores.make_room` frees pinned blocks oldest first:

- a save already handed to the worker: the allocation waits for it (counted in ``wait_s`` / ``waits``);
- a save still queued, synchronous scheduling (nothing in flight): the queued copies go to the worker now, then wait;
- a save still queued, asynchronous scheduling (the step writing its block may be in flight, so the worker may not
  read it yet): the block is released at once and its save becomes *urgent*: the step thread runs it itself before
  the next step's forward, which is before any write to the block (the tiers' synchronous behaviour; counted too).

The state changes between "queued", "submitted" and "urgent" under one lock, so a save is either read by the
worker before its block is released or run by the step thread before the block's next write.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional

from inferhal.core.paging.block_pool import Block, BlockHash, BlockPool


class Store:
    """One block's save: ``submitted`` to the worker, or ``urgent`` (run on the step thread), ``done`` when over."""

    __slots__ = ("group", "block", "hash", "submitted", "urgent", "done", "pinned")

    def __init__(self, group: str, block: Optional[Block], h: BlockHash) -> None:
        self.group, self.block, self.hash = group, block, h
        self.submitted = self.urgent = False
        self.pinned = block is not None
        self.done = threading.Event()

    @property
    def block_id(self) -> int:
        return -1 if self.block is None else self.block.block_id


class PendingStores:
    def __init__(self) -> None:
        self.pools: Optional[Mapping[str, BlockPool]] = None
        self.keep_groups: frozenset[str] = frozenset()
        self._pinned: collections.OrderedDict[tuple[str, int], Store] = collections.OrderedDict()  # oldest first
        self._finished: collections.deque[Store] = collections.deque()  # done on the worker, not reaped yet
        self._lock = threading.Lock()
        self.wait_s = 0.0  # seconds allocations waited for saves to finish (and urgent saves on the step thread)
        self.waits = 0

    def bind(self, pools: Mapping[str, BlockPool], keep_groups: Iterable[str] = ()) -> None:
        """The pools whose blocks are pinned (a KV manager's ``attach``); unbound, nothing is pinned."""
        self.pools, self.keep_groups = pools, frozenset(keep_groups)

    def __len__(self) -> int:
        """Blocks pinned now (pending stores)."""
        return len(self._pinned)

    # ------------------------------------------------------------------ the pools' thread

    def pin(self, group: str, block: Block, h: BlockHash) -> Store:
        if self.pools is None:
            return Store(group, None, h)
        st = Store(group, block, h)
        self.pools[group].touch([block])
        self._pinned[(group, block.block_id)] = st
        return st

    def _unpin(self, st: Store) -> None:
        if not st.pinned:
            return
        st.pinned = False
        if self._pinned.get((st.group, st.block.block_id)) is st:
            del self._pinned[(st.group, st.block.block_id)]
        self.pools[st.group].free_blocks([st.block], keep=st.group in self.keep_groups)

    def reap(self) -> None:
        """Free the pins of the saves that finished."""
        while self._finished:
            self._unpin(self._finished.popleft())

    def refs(self) -> dict[str, dict[int, int]]:
        """Group → block id → 1 for each pinned block (the references a pool check expects besides requests')."""
        out: dict[str, dict[int, int]] = {}
        for (g, b), st in self._pinned.items():
            if st.pinned:
                out.setdefault(g, {})[b] = 1
        return out

    def make_room(self, short: Callable[[], set[str]], submit_queued: Optional[Callable[[], None]]) -> bool:
        """Free pinned blocks of the groups ``short()`` names, oldest first, until it names none (True) or no
        pinned block that only its save holds is left in them (False). ``submit_queued``: hand the queued copies
        to the worker now (synchronous scheduling), None when a step may be in flight (then queued saves go
        urgent)."""
        self.reap()
        groups = short()
        while groups:
            st = next((s for s in self._pinned.values() if s.group in groups and s.block.ref_cnt == 1), None)
            if st is None:
                return False
            t0 = time.perf_counter()
            if not st.submitted and submit_queued is not None:
                submit_queued()
            with self._lock:
                if not st.submitted:  # still queued, or taken by a step that has not run yet
                    st.urgent = True
            if st.urgent:
                self._unpin(st)
            else:
                st.done.wait()
                self.reap()
                self._unpin(st)
            self.wait_s += time.perf_counter() - t0
            self.waits += 1
            groups = short()
        return True

    # ------------------------------------------------------------------ the step thread and the worker

    def claim(self, stores: Iterable[Store]) -> tuple[list[Store], list[Store]]:
        """The step thread takes a step's saves: → (urgent ones, to run now; the others, now submitted)."""
        urgent, later = [], []
        with self._lock:
            for st in stores:
                if st.urgent:
                    urgent.append(st)
                else:
                    st.submitted = True
                    later.append(st)
        return urgent, later

    def finished(self, stores: Iterable[Store]) -> None:
        """The saves no longer read their blocks (gathered, or failed: then the block is simply not in the tier)."""
        for st in stores:
            if st.pinned and not st.done.is_set():
                self._finished.append(st)
            st.done.set()

    def stats(self) -> dict[str, Any]:
        return {"pending_stores": len(self._pinned), "store_wait_s": self.wait_s, "store_waits": self.waits}
