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
    assert kv.num_free_blocks() == {"full": 32, "swa": 32}


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
    pool = kv.pools["swa"]
    pool.get_new_blocks(pool.num_free_blocks())  # evicts every sliding block, LRU order
    assert kv.find_prefix_hit("c", toks + [7], ()).num_tokens == 0 and blk.block_hash is None


def test_hit_leaves_one_token_to_compute():
    kv = KVCacheManager([FULL], 4, 16)
    toks = list(range(8))
    kv.allocate("a", 0, 8)
    kv.cache_blocks("a", toks, 8)
    assert kv.find_prefix_hit("b", toks, ()).num_tokens == 4  # not 8: the last token must run for logits


def test_budget_to_blocks_matches_storage():
    """The planner's split of a budget, the manager's pools and the storage's bytes agree exactly."""
    specs = [FULL, SLIDE, CSA]
    lay = dict(zip(("full", "swa", "csa"), planning.layouts(specs, 8)))
    full_b, swa_b, csa_b = (planning.group_block_bytes(lay[g]) for g in ("full", "swa", "csa"))
    assert (full_b, swa_b, csa_b) == (8 * 2 * 8 * 4 * 2, 8 * 2 * 8 * 4 * 2, 2 * 16 * 2)  # each its own page, no padding
    budget = 1 << 20
    n = planning.blocks_for_budget(specs, 8, budget, max_num_seqs=4, max_step_tokens=16)
    # the window reserve: 4 requests x ceil((6 - 1 + 1) / 8) + 1 = 2 live blocks, plus one step of 16 tokens
    assert n["swa"] == 4 * 2 + 2
    # the growth groups split the rest, the same number of blocks each (a request needs ~L/8 of each)
    assert n["full"] == n["csa"] == (budget - n["swa"] * swa_b) // (full_b + csa_b)
    store = TorchKVStorage(planning.storage_request(specs, 8, n))
    assert store.nbytes() == planning.storage_bytes(planning.layouts(specs, 8, n)) <= budget
    assert store.layer_cache("csa", 4).shape == (n["csa"], 2, 16)
    assert store.layer_cache("swa", 3).shape == (n["swa"], 8, 2, 1, 8)
    kv = KVCacheManager(specs, 8, n)
    assert kv.num_blocks == n
    assert planning.compatible_block_size([CSA], 6) == 12


def test_sliding_reserve_is_capped_at_half_the_budget():
    specs = [FULL, SLIDE]
    lay = planning.layouts(specs, 8)
    budget = 40 * planning.group_block_bytes(lay[0])
    n = planning.blocks_for_budget(specs, 8, budget, max_num_seqs=1000, max_step_tokens=16)
    assert n["swa"] * planning.group_block_bytes(lay[1]) <= budget // 2 + planning.group_block_bytes(lay[1])
    assert n["full"] >= 19


def test_no_block_is_refused_with_the_bytes_one_block_needs():
    import pytest

    from inferhal.core.errors import UserError

    with pytest.raises(UserError, match=r"no block of group\(s\) full .* one block of every group takes"):
        planning.check_budget([FULL, SLIDE], 8, {"full": 0, "swa": 3})


def test_replay_rule():
    s1 = KVGroupSpec("s", "sliding", (0, 1, 2), (1,), torch.float32, window=5)
    assert replay_span([s1], "exact") == 12 and replay_span([s1], "window") == 5
    assert replay_span([s1, FULL]) == 12  # hybrid: the full group reads cached KV and adds nothing
    assert replay_span([FULL]) is None and replay_span([s1], "off") is None
    assert replay_start(30, 12) == 18 and replay_start(7, 12) == 0 and replay_start(30, None) == 0


def test_retained_windows_outlive_other_free_window_blocks():
    """cache.retain_windows: a finished request's last window survives the window blocks released by a request
    still running, so its next turn hits without replay; without retention the pool's LRU loses it first."""
    toks, other = list(range(100, 140)), list(range(300, 340))  # 10 blocks of 4 each

    def run(kv, rid, ids):  # 4 tokens a step: the window slides, releasing blocks as it goes
        for pos in range(0, 40, 4):
            assert kv.allocate(rid, pos, 4)
            kv.cache_blocks(rid, ids, pos + 4)

    hits = {}
    one = planning.live_blocks(SLIDE, 4)  # one request's window at most: what cache.retain_windows=1 keeps
    for keep in (0, one):
        kv = KVCacheManager([FULL, SLIDE], 4, {"full": 64, "swa": 8}, keep_blocks={"swa": keep})
        run(kv, "a", toks)
        kv.free("a")  # its last window (blocks 7, 8, 9) is kept with retention
        run(kv, "b", other)  # another request slides its window through the small swa pool
        kv.check()
        hits[keep] = kv.find_prefix_hit("c", toks + [1, 2]).num_tokens
    assert hits == {0: 0, one: 40}


def test_retention_keeps_the_window_a_hit_at_the_last_full_block_needs():
    """A request that decoded 3 tokens past its last full block boundary (C = 12, window 6, blocks of 4) no longer
    reads block 1 (tokens 4-7), but a hit at C does: with retention it is kept and goes to the kept queue, so the next
    turn hits at C after another request cycled the window pool; without retention the hit has no window to stand on."""
    toks, other = list(range(100, 115)), list(range(300, 340))
    hits, one = {}, planning.live_blocks(SLIDE, 4)
    for keep in (0, one):
        kv = KVCacheManager([FULL, SLIDE], 4, {"full": 64, "swa": 8}, keep_blocks={"swa": keep})
        assert kv.allocate("a", 0, 8)
        kv.cache_blocks("a", toks, 8)
        for pos in range(8, 15):  # decode: tokens 8..14 computed, 15 in all (C = 12)
            assert kv.allocate("a", pos, 1)
            assert len([b for b in kv.block_ids("a")["swa"] if b != -1]) <= one
            kv.cache_blocks("a", toks, pos + 1)
        assert (kv.block_ids("a")["swa"][1] != -1) == bool(keep)
        kv.free("a")
        for pos in range(0, 40, 4):
            assert kv.allocate("b", pos, 4)
            kv.cache_blocks("b", other, pos + 4)
        kv.check()
        hits[keep] = kv.find_prefix_hit("c", toks + [1, 2]).num_tokens
    assert hits == {0: 0, one: 12}
