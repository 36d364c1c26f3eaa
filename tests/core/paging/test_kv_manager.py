"""KV manager over hybrid groups: sliding release, compressed block counts, hybrid prefix hits, planning."""

from __future__ import annotations

import torch

from inferhal.backends.reference.device import TorchKVStorage
from inferhal.core.paging import planning
from inferhal.core.paging.kv_manager import KVCacheManager, blocks_needed
from inferhal.core.paging.replay import replay_span, replay_start
from inferhal.core.paging.spec import KVGroupSpec

FULL = KVGroupSpec("full", "full", (0, 2), (2, 1, 8), torch.float32)
SLIDE = KVGroupSpec("swa", "sliding", (1, 3), (2, 1, 8), torch.float32, window=6)
CSA = KVGroupSpec("csa", "compressed", (4,), (16,), torch.bfloat16, tokens_per_slot=4)


def test_blocks_needed_per_kind():
    assert blocks_needed(FULL, 8, 17) == 3
    assert blocks_needed(CSA, 8, 17) == 2  # 4 entries, 2 per block
    assert blocks_needed(CSA, 8, 15) == 2  # 3 entries
    assert blocks_needed(CSA, 8, 7) == 1  # 1 entry
    assert blocks_needed(CSA, 8, 3) == 0


def test_sliding_blocks_released_out_of_window():
    kv = KVCacheManager([FULL, SLIDE], 4, 32)
    assert kv.allocate("r", 0, 8)
    assert kv.block_ids("r")["swa"].count(-1) == 0
    assert kv.allocate("r", 8, 1)  # query at 8 reads keys 3..8: block 0 (tokens 0..3) still live
    assert kv.block_ids("r")["swa"][0] != -1
    assert kv.allocate("r", 12, 1)  # query 12 reads 7..12: blocks 0 (0-3) released, block 1 (4-7) live
    ids = kv.block_ids("r")
    assert ids["swa"][0] == -1 and ids["swa"][1] != -1 and -1 not in ids["full"]
    kv.check()
    kv.free("r")
    kv.check()
    assert kv.pool.num_free_blocks() == 32


def test_hybrid_prefix_hit_needs_only_the_window():
    kv = KVCacheManager([FULL, SLIDE], 4, 64)
    toks = list(range(40))
    kv.allocate("a", 0, 40)
    kv.cache_blocks("a", toks, 40)
    kv.free("a")
    hit = kv.find_prefix_hit("b", toks + [7], ())
    assert hit.num_tokens == 40
    # sliding group: next query at 40 reads keys 35..39 -> only block 8 (32-35) and 9 (36-39) are taken
    assert [b is None for b in hit.blocks["swa"]] == [True] * 8 + [False] * 2
    assert kv.allocate("b", 40, 1, hit)
    kv.check()
    # evict the sliding window block of the hit point: the hit falls back to a shorter prefix
    blk = hit.blocks["swa"][9]
    kv.free("b")
    kv.pool.get_new_blocks(kv.pool.num_free_blocks())  # evicts everything, LRU order
    assert kv.find_prefix_hit("c", toks + [7], ()).num_tokens == 0 and blk.block_hash is None


def test_hit_leaves_one_token_to_compute():
    kv = KVCacheManager([FULL], 4, 16)
    toks = list(range(8))
    kv.allocate("a", 0, 8)
    kv.cache_blocks("a", toks, 8)
    assert kv.find_prefix_hit("b", toks, ()).num_tokens == 4  # not 8: the last token must run for logits


def test_budget_to_blocks_matches_storage():
    specs = [FULL, SLIDE, CSA]
    groups = planning.layouts(specs, 8)
    per = planning.bytes_per_block(groups)
    n = planning.num_blocks_for_budget(10 * per + per // 2, groups)
    assert n == 10
    store = TorchKVStorage(planning.storage_request(specs, 8, n))
    assert store.nbytes() == n * per
    assert store.layer_cache("csa", 4).shape == (10, 2, 16)
    assert planning.compatible_block_size([CSA], 6) == 12


def test_replay_rule():
    s1 = KVGroupSpec("s", "sliding", (0, 1, 2), (1,), torch.float32, window=5)
    assert replay_span([s1], "exact") == 12 and replay_span([s1], "window") == 5
    assert replay_span([s1, FULL]) is None and replay_span([s1], "off") is None
    assert replay_start(30, 12) == 18 and replay_start(7, 12) == 0 and replay_start(30, None) == 0
