"""The block pool: every KV block of the shared pool, ref counts, an LRU free queue and the prefix cache.

Invariants (checked by :meth:`BlockPool.check`, which the property tests call after every step):

- a block is in the free queue iff its ``ref_cnt`` is 0;
- a block with a ``block_hash`` is in the cache map under ``(group, hash)`` and vice versa;
- ``num_free_blocks()`` + blocks in use == ``num_blocks``.

Freed blocks keep their hash and content (an evictable cached block) until they are handed out again:
:meth:`get_new_blocks` takes from the head of the free queue (least recently freed first) and evicts
the taken block's hash. :meth:`free_blocks` appends to the tail, so callers free a request's blocks
tail first, which makes the end of a sequence the first to be evicted and keeps shared prefixes longest.

Retention (``cache.retain_windows``): blocks freed with ``keep=True`` join a second LRU queue, the *kept*
queue, which is taken from only when the free queue is empty; past ``keep_limit`` kept blocks the oldest
move to the head of the free queue. A pool's ``listener`` (KV events, tiers: :mod:`.events`) hears every
hash that leaves the cache map (``evicted``) and every :meth:`reset_prefix_cache` (``cleared``).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

BlockHash = bytes


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group", "prev", "next", "kept")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.kept = False  # free and in the kept queue (retention), not the free queue
        self.block_hash: Optional[BlockHash] = None
        self.group: Optional[str] = None  # group whose cache map holds this block (with block_hash)
        self.prev: Optional[Block] = None
        self.next: Optional[Block] = None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Block({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop-left, append and remove-from-middle."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self.head = Block(-1)  # sentinels
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, b: Block) -> None:
        last = self.tail.prev
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.num_free += 1

    def appendleft(self, b: Block) -> None:
        first = self.head.next
        self.head.next, b.prev, b.next, first.prev = b, self.head, first, b
        self.num_free += 1

    def popleft(self) -> Block:
        b = self.head.next
        if b is self.tail:
            raise IndexError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: Block) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next


class BlockPool:
    """``num_blocks`` blocks shared by every KV group; ``enable_caching`` turns the prefix cache on."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, keep_limit: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.kept = FreeBlockQueue(())
        self.keep_limit = keep_limit
        self.cached: dict[tuple[str, BlockHash], Block] = {}
        self.num_evictions = 0
        self.listener: Optional[Any] = None  # .evicted(group, hash, block id), .cleared([(group, hash), ...])

    def num_free_blocks(self) -> int:
        return self.free_queue.num_free + self.kept.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_blocks

    # ------------------------------------------------------------------ allocation

    def get_new_blocks(self, n: int) -> list[Block]:
        """``n`` fresh blocks with ref_cnt 1 (evicting cached content, LRU first)."""
        if n > self.num_free_blocks():
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks()} free")
        out = []
        for _ in range(n):
            if self.free_queue.num_free:
                b = self.free_queue.popleft()
            else:
                b = self.kept.popleft()
                b.kept = False
            if b.block_hash is not None:
                del self.cached[(b.group, b.block_hash)]
                if self.listener is not None:
                    self.listener.evicted(b.group, b.block_hash, b.block_id)
                b.block_hash = b.group = None
                self.num_evictions += 1
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                (self.kept if b.kept else self.free_queue).remove(b)
                b.kept = False
            b.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block], keep: bool = False) -> None:
        """Drop one reference on each block, in order; blocks reaching 0 join the free queue's tail (with
        ``keep`` and a ``keep_limit``, hashed ones join the kept queue's)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"block {b.block_id} freed more often than it was taken")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if keep and self.keep_limit and b.block_hash is not None:
                    b.kept = True
                    self.kept.append(b)
                else:
                    self.free_queue.append(b)
        while self.kept.num_free > self.keep_limit:  # the oldest kept block is now the oldest free one
            old = self.kept.popleft()
            old.kept = False
            self.free_queue.appendleft(old)

    # ------------------------------------------------------------------ prefix cache

    def get_cached_block(self, group: str, block_hash: BlockHash) -> Optional[Block]:
        if not self.enable_caching:
            return None
        return self.cached.get((group, block_hash))

    def cache_block(self, group: str, block: Block, block_hash: BlockHash) -> bool:
        """Register a full block's content under ``block_hash`` (first writer wins for duplicates); → whether
        it was registered now."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        key = (group, block_hash)
        if key in self.cached:
            return False  # an identical block is already cached; this one stays private
        block.block_hash, block.group = block_hash, group
        self.cached[key] = block
        return True

    def reset_prefix_cache(self) -> None:
        gone = list(self.cached)
        for b in list(self.cached.values()):
            b.block_hash = b.group = None
        self.cached.clear()
        if self.listener is not None and gone:
            self.listener.cleared(gone)

    # ------------------------------------------------------------------ invariants

    def check(self, expected_refs: Optional[dict[int, int]] = None) -> None:
        """Raise AssertionError if an invariant is broken; ``expected_refs`` maps block id → holders."""
        free_ids = [b.block_id for b in self.free_queue]
        kept_ids = [b.block_id for b in self.kept]
        assert len(free_ids) == self.free_queue.num_free and len(kept_ids) == self.kept.num_free, "free queue is corrupt"
        assert len(set(free_ids + kept_ids)) == len(free_ids) + len(kept_ids), "a block is free twice"
        assert len(kept_ids) <= self.keep_limit, f"{len(kept_ids)} kept blocks, limit {self.keep_limit}"
        free, kept = set(free_ids + kept_ids), set(kept_ids)
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref_cnt {b.ref_cnt}"
            assert b.kept == (b.block_id in kept), f"block {b.block_id}: kept flag vs kept queue"
            assert (b.ref_cnt == 0) == (b.block_id in free), f"block {b.block_id}: ref_cnt {b.ref_cnt} vs free queue"
            if b.block_hash is not None:
                assert self.cached.get((b.group, b.block_hash)) is b, f"block {b.block_id} hashed but not cached"
            if expected_refs is not None:
                want = expected_refs.get(b.block_id, 0)
                assert b.ref_cnt == want, f"block {b.block_id}: ref_cnt {b.ref_cnt}, held by {want}"
        for (g, h), b in self.cached.items():
            assert b.block_hash == h and b.group == g, "cache map points at a block with another hash"
