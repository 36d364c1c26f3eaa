"""Per-request block tables over every KV group of a model, each group from its own :class:`BlockPool`
(block ids are per group; :mod:`.planning` sizes the pools under one budget).

Block-table rules per group kind (``bs`` = block size in tokens; a block always covers ``bs`` tokens):

- ``full``: logical block ``j`` holds tokens ``[j*bs, (j+1)*bs)``; kept for the whole request.
- ``sliding`` (window ``w``): a step whose first new token is at position ``s`` reads keys from
  ``s - w + 1`` on, so blocks wholly below ``(s - w + 1) // bs`` are released (set to ``None``, shown as
  ``-1`` in block tables) before the step is allocated.
- ``compressed`` (ratio ``r``): ``end // r`` entries for ``end`` tokens, ``bs // r`` per block, so
  ``ceil((end // r) / (bs // r))`` blocks; block ``j`` still holds the entries of tokens ``[j*bs, (j+1)*bs)``.

Prefix caching: block ``j`` of every group is cached under the request's chained hash ``j`` once all
its tokens are computed. A hit of ``n`` blocks (``C = n*bs`` tokens) needs blocks ``0..n-1`` of every
full/compressed group and, for a sliding group, only the blocks holding keys ``C-w+1 .. C-1``. With lower tiers
(:meth:`KVCacheManager.attach`, :mod:`.offload`) a needed block the pool no longer holds may come from a tier.

``keep_blocks`` (``cache.retain_windows``): a finished request's sliding-window blocks are freed into their
pool's kept queue (:mod:`.block_pool`), evicted only after every other free block, so a session's next turn
finds its windows: such a group keeps what a hit at the request's last full block boundary needs (at most a block more).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Optional, Sequence

from inferhal.core.paging.block_pool import Block, BlockHash, BlockPool
from inferhal.core.paging.hashing import extend_block_hashes
from inferhal.core.paging.offload import TierBlock
from inferhal.core.paging.spec import KVGroupSpec


_BELOW = object()  # a block only a lower tier holds (until _fetch brings it up)


def blocks_needed(spec: KVGroupSpec, block_size: int, num_tokens: int) -> int:
    """Logical blocks a group needs to hold ``num_tokens`` tokens of context."""
    if spec.kind == "compressed":
        spb = spec.slots_per_block(block_size)
        return -(-(num_tokens // spec.tokens_per_slot) // spb)
    return -(-num_tokens // block_size)


def first_live_block(spec: KVGroupSpec, block_size: int, first_query: int) -> int:
    """Lowest logical block a step starting at position ``first_query`` may read (0 unless sliding)."""
    if spec.kind != "sliding":
        return 0
    return max(0, first_query - spec.window + 1) // block_size


@dataclass
class PrefixHit:
    """Cached blocks a request can reuse: ``blocks[group][j]`` (None where the group needs nothing).

    ``num_tokens`` (``C``) tokens are covered; ``replay_from`` < ``C`` when the sliding groups' window blocks
    were not cached: the request recomputes from there, writing only its sliding groups below ``C``
    (:mod:`.replay`). A :class:`~inferhal.core.paging.offload.TierBlock` stands for a block a lower tier
    holds: allocation restores it into a fresh pool block."""

    num_tokens: int = 0
    blocks: dict[str, list[Optional[Block | TierBlock]]] = field(default_factory=dict)
    replay_from: Optional[int] = None
    hashes: Sequence[BlockHash] = ()
    token_ids: Sequence[int] = ()

    @property
    def num_restored(self) -> int:
        """Blocks of the hit that come from a lower tier (every group)."""
        return sum(isinstance(b, TierBlock) for bl in self.blocks.values() for b in bl)

    @property
    def start(self) -> int:
        """The first token the request computes."""
        return self.num_tokens if self.replay_from is None else self.replay_from


@dataclass
class _ReqBlocks:
    blocks: dict[str, list[Optional[Block]]]
    ids: dict[str, list[int]]
    hashes: list[BlockHash] = field(default_factory=list)
    num_cached: int = 0  # leading blocks already registered in the prefix cache
    extra_keys: tuple[Hashable, ...] = ()


class KVCacheManager:
    """Allocates, releases and caches the blocks of each request, for all groups at once."""

    def __init__(self, specs: Sequence[KVGroupSpec], block_size: int, num_blocks: int | Mapping[str, int],
                 enable_caching: bool = True, keep_blocks: Optional[Mapping[str, int]] = None) -> None:
        """``num_blocks``: blocks of each group's pool (one count for all, or a count per group name);
        ``keep_blocks``: group → most blocks its kept queue holds (window retention)."""
        if not specs:
            raise ValueError("KVCacheManager needs at least one KV group")
        for s in specs:
            s.slots_per_block(block_size)  # raises when block_size does not fit a compressed group
        self.specs = tuple(specs)
        self.block_size = block_size
        counts = {s.name: num_blocks for s in specs} if isinstance(num_blocks, int) else dict(num_blocks)
        missing = [s.name for s in specs if s.name not in counts]
        if missing:
            raise ValueError(f"KVCacheManager: no block count for group(s) {missing}")
        keep = dict(keep_blocks or {})
        self.pools = {s.name: BlockPool(int(counts[s.name]), enable_caching, int(keep.get(s.name, 0))) for s in specs}
        for p in self.pools.values():
            p.listener = self
        self.offload: Any = None  # a KVOffload: lower tiers (attach)
        self.events: Any = None  # a KVEventLog
        self._resetting = False
        self.reqs: dict[str, _ReqBlocks] = {}
        self._has_sliding = any(s.kind == "sliding" for s in specs)
        self._all_sliding = all(s.kind == "sliding" for s in specs)

    @property
    def enable_caching(self) -> bool:
        return next(iter(self.pools.values())).enable_caching

    @property
    def num_blocks(self) -> dict[str, int]:
        return {g: p.num_blocks for g, p in self.pools.items()}

    def num_free_blocks(self) -> dict[str, int]:
        if self.offload is not None:  # blocks whose tier save finished are free again
            self.offload.reap()
        return {g: p.num_free_blocks() for g, p in self.pools.items()}

    def usage(self) -> float:
        """The fullest pool's usage (the one that preempts first)."""
        return max(p.usage() for p in self.pools.values())

    def num_evictions(self) -> int:
        return sum(p.num_evictions for p in self.pools.values())

    def reset_prefix_cache(self) -> None:
        self._resetting = True
        try:
            for p in self.pools.values():
                p.reset_prefix_cache()
        finally:
            self._resetting = False
        if self.events is not None:
            self.events.cleared()

    def attach(self, offload: Any = None, events: Any = None) -> None:
        """Lower tiers (a :class:`~inferhal.core.paging.offload.KVOffload`) and a
        :class:`~inferhal.core.paging.events.KVEventLog`, either may be None."""
        self.offload, self.events = offload, events
        if hasattr(offload, "bind"):  # blocks with a tier save pending are pinned in these pools (pending.py)
            offload.bind(self.pools, [s.name for s in self.specs if s.kind == "sliding"])

    # the pools' listener (block_pool.py)
    def evicted(self, group: str, h: BlockHash, block_id: int) -> None:
        if self.events is not None:
            self.events.removed(group, [h])
        if self.offload is not None:
            self.offload.evicting(group, block_id)

    def cleared(self, keys: Sequence[tuple[str, BlockHash]]) -> None:
        if self.events is not None and not self._resetting:
            for g in dict.fromkeys(g for g, _ in keys):
                self.events.removed(g, [h for k, h in keys if k == g])

    # ------------------------------------------------------------------ sizing

    def blocks_for(self, num_tokens: int) -> dict[str, int]:
        """Blocks one request of ``num_tokens`` tokens of context holds in each group (sliding: its window)."""
        out = {}
        for s in self.specs:
            n = blocks_needed(s, self.block_size, num_tokens)
            out[s.name] = n - first_live_block(s, self.block_size, max(0, num_tokens - 1))
        return out

    def max_blocks_one_step(self, num_tokens: int, chunk: int) -> dict[str, int]:
        """Worst case each group's pool must hold for a lone request of ``num_tokens`` with steps of ``chunk``."""
        out = {}
        for s in self.specs:
            n = blocks_needed(s, self.block_size, num_tokens)
            if s.kind == "sliding":
                n -= first_live_block(s, self.block_size, self._release_point(s, max(0, num_tokens - chunk)))
            out[s.name] = n
        return out

    # ------------------------------------------------------------------ prefix cache lookup

    def _state(self, req_id: str, extra_keys: tuple = ()) -> _ReqBlocks:
        st = self.reqs.get(req_id)
        if st is None:
            st = _ReqBlocks({s.name: [] for s in self.specs}, {s.name: [] for s in self.specs}, extra_keys=extra_keys)
            self.reqs[req_id] = st
        return st

    def block_hashes(self, req_id: str, token_ids: Sequence[int], extra_keys: tuple = ()) -> list[BlockHash]:
        st = self._state(req_id, extra_keys)
        return extend_block_hashes(st.hashes, token_ids, self.block_size, st.extra_keys)

    def find_prefix_hit(self, req_id: str, token_ids: Sequence[int], extra_keys: tuple = (),
                        replay_span: Optional[int] = None) -> PrefixHit:
        """Longest reusable cached prefix of ``token_ids``, leaving at least one token to compute.

        With ``replay_span`` (a hybrid model's bounded replay, :mod:`.replay`), a prefix whose full and
        compressed blocks are cached but whose window blocks are not is still a hit: the sliding groups are
        rebuilt from ``C - replay_span`` (when that saves recompute over the hit the windows allow). Blocks the
        pool lacks are taken from the lower tiers where they hold them; one that fails to come back (a tier file
        that fails its checks) ends the hit before it."""
        if not self.enable_caching:
            return PrefixHit()
        hashes = self.block_hashes(req_id, token_ids, extra_keys)
        while True:
            hit = self._longest_hit(hashes, len(token_ids), replay_span)
            if self._fetch(hit, hashes):
                hit.hashes, hit.token_ids = hashes, token_ids
                return hit

    def _longest_hit(self, hashes: Sequence[BlockHash], num_tokens: int, replay_span: Optional[int]) -> PrefixHit:
        pools, bs, below = self.pools, self.block_size, self.offload

        def cached(s: KVGroupSpec, j: int) -> Any:
            b = pools[s.name].get_cached_block(s.name, hashes[j])
            if b is None and below is not None and below.holds(s.name, hashes[j]):
                return _BELOW
            return b

        full = min(len(hashes), (num_tokens - 1) // bs)
        for s in self.specs:  # full/compressed groups: every leading block
            if s.kind != "sliding":
                k = 0
                while k < full and cached(s, k) is not None:
                    k += 1
                full = k
        n = full
        for s in self.specs:  # sliding groups: only the window before the hit point
            if s.kind != "sliding":
                continue
            while n > 0 and any(cached(s, j) is None for j in range(first_live_block(s, bs, n * bs), n)):
                n -= 1
        replay_from = None
        if replay_span is not None and not self._all_sliding and full * bs - replay_span > n * bs:
            n, replay_from = full, full * bs - replay_span  # the windows are rebuilt, not taken from the cache
        if n == 0:
            return PrefixHit()
        hit = PrefixHit(num_tokens=n * bs, replay_from=replay_from)
        for s in self.specs:
            if replay_from is not None and s.kind == "sliding":
                hit.blocks[s.name] = []
                continue
            lo = first_live_block(s, bs, n * bs)
            hit.blocks[s.name] = [None] * lo + [cached(s, j) for j in range(lo, n)]
        return hit

    def _fetch(self, hit: PrefixHit, hashes: Sequence[BlockHash]) -> bool:
        """Bring the hit's lower-tier blocks up (as TierBlocks); False when one failed (it is gone from its tier)."""
        if self.offload is None:
            return True
        for name, bl in hit.blocks.items():
            for j, b in enumerate(bl):
                if b is _BELOW:
                    tb = self.offload.fetch(name, hashes[j])
                    if tb is None:
                        return False
                    bl[j] = tb
        return True

    # ------------------------------------------------------------------ allocation

    def _release_point(self, s: KVGroupSpec, first_query: int) -> int:
        """The query a sliding group's window is kept for: ``first_query``, or with retention its block boundary."""
        if self.enable_caching and self.pools[s.name].keep_limit > 0:
            return first_query - first_query % self.block_size
        return first_query

    def _release_out_of_window(self, st: _ReqBlocks, first_query: int) -> None:
        """Free the sliding groups' blocks a step from ``first_query`` no longer reads (with retention: those a hit
        at the last full block boundary still needs stay, for the request's end to hand to the kept queue)."""
        for s in self.specs:
            if s.kind != "sliding":
                continue
            lo = first_live_block(s, self.block_size, self._release_point(s, first_query))
            bl, ids = st.blocks[s.name], st.ids[s.name]
            dead = [b for b in bl[:lo] if b is not None]
            if dead:
                for j in range(min(lo, len(bl))):
                    bl[j] = None
                    ids[j] = -1
                self.pools[s.name].free_blocks(reversed(dead))

    def num_new_blocks(self, req_id: str, num_computed: int, num_new: int,
                       hit: Optional[PrefixHit] = None) -> dict[str, int]:
        """Blocks :meth:`allocate` would take from each group's free queue (cached hits with ref 0 count too)."""
        st = self.reqs.get(req_id)
        end = num_computed + num_new
        out = {}
        for s in self.specs:
            have = len(st.blocks[s.name]) if st else 0
            lo = first_live_block(s, self.block_size, num_computed)
            n = 0
            if hit is not None and hit.num_tokens:
                hb = hit.blocks[s.name]
                n += sum(1 for b in hb if b is not None and b.ref_cnt == 0)
                have = len(hb)
            out[s.name] = n + max(0, blocks_needed(s, self.block_size, end) - max(have, lo))
        return out

    def allocate(self, req_id: str, num_computed: int, num_new: int, hit: Optional[PrefixHit] = None) -> bool:
        """Make room for tokens ``[num_computed, num_computed + num_new)``; False (nothing changed) when
        some group's pool lacks blocks. A ``hit`` (from :meth:`find_prefix_hit`) is taken on first allocation."""
        st = self._state(req_id)
        if self._has_sliding:
            self._release_out_of_window(st, num_computed)
        need = self.num_new_blocks(req_id, num_computed, num_new, hit)
        if any(need[g] > p.num_free_blocks() for g, p in self.pools.items()):
            def short() -> set[str]:  # blocks pinned by pending tier saves come free (pending.py's make_room)
                n = self.num_new_blocks(req_id, num_computed, num_new, hit)
                return {g for g, p in self.pools.items() if n[g] > p.num_free_blocks()}
            if self.offload is None or not self.offload.make_room(short):
                return False
        end = num_computed + num_new
        if hit is not None and hit.num_tokens:
            for s in self.specs:  # every pool block of the hit leaves the free queue before a restore takes one
                self.pools[s.name].touch(b for b in hit.blocks[s.name] if isinstance(b, Block))
            for s in self.specs:
                hb = [self._restore(s.name, j, b, hit) if isinstance(b, TierBlock) else b
                      for j, b in enumerate(hit.blocks[s.name])]
                st.blocks[s.name] = hb
                st.ids[s.name] = [-1 if b is None else b.block_id for b in hb]
            st.num_cached = hit.num_tokens // self.block_size
        for s in self.specs:
            pool = self.pools[s.name]
            bl, ids = st.blocks[s.name], st.ids[s.name]
            lo = first_live_block(s, self.block_size, num_computed)
            if len(bl) < lo:  # e.g. a bounded replay that starts past the beginning
                ids.extend([-1] * (lo - len(bl)))
                bl.extend([None] * (lo - len(bl)))
            n = blocks_needed(s, self.block_size, end) - len(bl)
            if n > 0:
                new = pool.get_new_blocks(n)
                bl.extend(new)
                ids.extend(b.block_id for b in new)
        return True

    def _restore(self, group: str, j: int, tb: TierBlock, hit: PrefixHit) -> Block:
        """A fresh pool block for the hit's block ``j`` of ``group``, registered under its hash, its load queued."""
        (b,) = self.pools[group].get_new_blocks(1)
        self.pools[group].cache_block(group, b, tb.key[1])
        self.offload.restoring(group, b.block_id, tb)
        if self.events is not None:
            self.events.stored_runs(group, [j], hit.hashes, hit.token_ids)
        return b

    def cache_blocks(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register every full, computed block of the request in the prefix cache (and queue its save to the
        lower tiers, its KV event)."""
        if not self.enable_caching:
            return
        st = self.reqs[req_id]
        n_full = num_computed // self.block_size
        if n_full <= st.num_cached:
            return
        hashes = extend_block_hashes(st.hashes, token_ids, self.block_size, st.extra_keys)
        for s in self.specs:
            pool, bl, new = self.pools[s.name], st.blocks[s.name], []
            for j in range(st.num_cached, min(n_full, len(bl))):
                if bl[j] is not None and pool.cache_block(s.name, bl[j], hashes[j]):
                    new.append(j)
                    if self.offload is not None:
                        self.offload.saving(s.name, bl[j], hashes[j])
            if new and self.events is not None:
                self.events.stored_runs(s.name, new, hashes, token_ids)
        st.num_cached = n_full

    def skip_caching_below(self, req_id: str, num_blocks: int) -> None:
        """Never register the request's first ``num_blocks`` blocks (their KV is not exact, e.g. replayed)."""
        st = self.reqs[req_id]
        st.num_cached = max(st.num_cached, num_blocks)

    def free(self, req_id: str) -> None:
        """Drop everything the request holds (its cached blocks stay evictable in the prefix cache)."""
        st = self.reqs.pop(req_id, None)
        if st is None:
            return
        for s in self.specs:  # a sliding group's blocks here are its last window: kept (retention), if any
            self.pools[s.name].free_blocks((b for b in reversed(st.blocks[s.name]) if b is not None),
                                           keep=s.kind == "sliding")

    def reset_blocks(self, req_id: str) -> None:
        """Free the request's blocks but keep its hashes (preemption: it will be recomputed)."""
        st = self.reqs.get(req_id)
        if st is None:
            return
        for s in self.specs:
            self.pools[s.name].free_blocks(b for b in reversed(st.blocks[s.name]) if b is not None)
            st.blocks[s.name], st.ids[s.name] = [], []
        st.num_cached = 0

    def block_ids(self, req_id: str) -> dict[str, list[int]]:
        return self.reqs[req_id].ids

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        """Ref counts equal the number of request block tables holding each block; ids mirror blocks."""
        refs: dict[str, dict[int, int]] = {s.name: {} for s in self.specs}
        for st in self.reqs.values():
            for s in self.specs:
                bl, ids = st.blocks[s.name], st.ids[s.name]
                assert len(bl) == len(ids), "block ids out of sync with blocks"
                for b, i in zip(bl, ids):
                    assert (b is None and i == -1) or (b is not None and b.block_id == i), "block id mismatch"
                    if b is not None:
                        assert b is self.pools[s.name].blocks[b.block_id], f"group {s.name} holds another pool's block"
                        refs[s.name][b.block_id] = refs[s.name].get(b.block_id, 0) + 1
        pending = getattr(self.offload, "pending", None)
        for g, pins in (pending.refs() if pending is not None else {}).items():
            for b, n in pins.items():  # a block with a tier save pending holds one more reference
                refs[g][b] = refs[g].get(b, 0) + n
        for s in self.specs:
            self.pools[s.name].check(refs[s.name])
