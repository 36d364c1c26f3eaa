"""Block pool: LRU free queue, ref counts, prefix-cache registration and eviction order."""

from __future__ import annotations

import pytest

from inferhal.core.paging.block_pool import BlockPool
from inferhal.core.paging.hashing import ROOT_HASH, extend_block_hashes, hash_block


def test_lru_eviction_order_and_refcounts():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2] and pool.num_free_blocks() == 1
    for i, b in enumerate(a):
        pool.cache_block("g", b, bytes([i]))
    pool.free_blocks(reversed(a))  # tail first: block 2 is evicted first
    pool.check()
    assert pool.num_free_blocks() == 4
    hit = pool.get_cached_block("g", bytes([0]))
    pool.touch([hit])  # a cache hit leaves the free queue
    assert hit.ref_cnt == 1 and pool.num_free_blocks() == 3
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [3, 2]  # never-used block first, then LRU cached block 2
    assert pool.get_cached_block("g", bytes([2])) is None and pool.num_evictions == 1
    assert pool.get_cached_block("g", bytes([1])) is not None
    pool.check({0: 1, 3: 1, 2: 1})
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    pool.free_blocks([hit])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([hit])


def test_shared_block_stays_until_last_reference():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks() == 1
    pool.free_blocks([b])
    assert pool.num_free_blocks() == 2


def test_caching_off_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block("g", b, b"h")
    assert pool.get_cached_block("g", b"h") is None


def test_chained_hashes_cover_prefix_and_extra_keys():
    toks = list(range(10))
    h = extend_block_hashes([], toks, 4)
    assert len(h) == 2  # only full blocks
    assert h[1] == hash_block(hash_block(ROOT_HASH, toks[:4]), toks[4:8])
    other = extend_block_hashes([], [99] + toks[1:], 4)
    assert other[0] != h[0] and other[1] != h[1]  # a different first block changes every later hash
    assert extend_block_hashes([], toks, 4, ("lora-a",))[0] != h[0]
    assert extend_block_hashes(list(h[:1]), toks, 4) == h  # incremental extension


def test_kept_blocks_are_evicted_after_every_other_free_block():
    pool = BlockPool(6, keep_limit=2)
    evicted = []

    class Listener:
        def evicted(self, group, h, block_id):
            evicted.append(block_id)

    pool.listener = Listener()
    blocks = pool.get_new_blocks(6)
    for i, b in enumerate(blocks):
        pool.cache_block("g", b, bytes([i]))
    pool.free_blocks(blocks[:3], keep=True)  # a finished request's window: 0, 1, 2 (the limit keeps the last two)
    pool.free_blocks(blocks[3:5])  # other free blocks: 3, 4
    pool.check()
    assert [b.block_id for b in pool.kept] == [1, 2] and [b.block_id for b in pool.free_queue] == [0, 3, 4]
    assert pool.num_free_blocks() == 5
    pool.touch([blocks[2]])  # a hit takes a kept block back
    assert [b.block_id for b in pool.kept] == [1] and blocks[2].ref_cnt == 1
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [0, 3, 4, 1] and evicted == [0, 3, 4, 1]  # kept last
    pool.check()
    pool.free_blocks(got, keep=True)
    fresh = pool.get_new_blocks(1)[0]
    pool.free_blocks([fresh], keep=True)  # no hash: nothing to keep, it joins the free queue
    assert not fresh.kept
    pool.check()


def test_reset_reports_every_cached_block():
    pool = BlockPool(3)
    seen = []

    class Listener:
        def cleared(self, keys):
            seen.extend(keys)

    pool.listener = Listener()
    for i, b in enumerate(pool.get_new_blocks(2)):
        pool.cache_block("g", b, bytes([i]))
    pool.reset_prefix_cache()
    assert sorted(seen) == [("g", b"\x00"), ("g", b"\x01")] and not pool.cached
