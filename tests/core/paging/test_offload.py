"""Blocks written through to the tiers and restored by a prefix hit, at the KV manager: the bytes that come back
are the bytes that went down (quantised records included), a save runs before its block is handed out again,
copies wait for the step they belong to, and a tier block that fails its checks ends the hit before it."""

from __future__ import annotations

import torch

from inferhal.backends.reference.device import TorchKVCopier, TorchKVStorage
from inferhal.core.paging import planning
from inferhal.core.paging.kv_manager import KVCacheManager
from inferhal.core.paging.offload import KVOffload, TierBlock, TorchBlockCopier
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.core.paging.tiers import DiskTier, HostTier

BS = 4
FULL = KVGroupSpec("full", "full", (0, 2), (2, 1, 8), torch.float32)
SLIDE = KVGroupSpec("swa", "sliding", (1,), (2, 1, 8), torch.bfloat16, window=6)
REC = KVGroupSpec("csa", "compressed", (3,), (20,), torch.uint8, tokens_per_slot=2, record="fp8_ds_mla")
SPECS = (FULL, SLIDE, REC)


def _setup(num_blocks=12, host=10**7, disk=None, eager=True, copier=TorchKVCopier):
    kv = KVCacheManager(SPECS, BS, num_blocks)
    storage = TorchKVStorage(planning.storage_request(SPECS, BS, num_blocks))
    for s in SPECS:  # every slot a distinct value: a block's bytes say which block they came from
        for layer in s.layers:
            c = storage.layer_cache(s.name, layer)
            c.copy_(torch.randint(0, 120, c.shape, generator=torch.Generator().manual_seed(layer)).to(c.dtype))
    tiers = KVOffload(SPECS, copier(storage), HostTier(host) if host else None, disk, eager)
    kv.attach(tiers)
    return kv, storage, tiers


def _block(storage, spec, block_id):
    return torch.stack([storage.layer_cache(spec.name, layer)[block_id] for layer in spec.layers]).clone()


def _run(kv, storage, rid, toks):
    """A request computing ``toks``: allocated, cached, its copies run, freed (as a finished request)."""
    hit = kv.find_prefix_hit(rid, toks)
    assert kv.allocate(rid, hit.start, len(toks) - hit.start, hit)
    kv.offload.run(kv.offload.take())  # the step's copies, before its forward
    kv.cache_blocks(rid, toks, len(toks))
    snapshot = {s.name: {j: _block(storage, s, b) for j, b in enumerate(kv.block_ids(rid)[s.name]) if b >= 0}
                for s in SPECS}
    kv.free(rid)
    return hit, snapshot


def test_both_copiers_move_the_same_bytes():
    storage = TorchKVStorage(planning.storage_request(SPECS, BS, 6))
    for s in SPECS:
        for layer in s.layers:
            c = storage.layer_cache(s.name, layer)
            c.copy_(torch.randint(0, 100, c.shape).to(c.dtype))
    plain, ref = TorchBlockCopier(storage), TorchKVCopier(storage)
    for s in SPECS:
        a, b = plain.gather(s.name, s.layers, [4, 1]), ref.gather(s.name, s.layers, [4, 1])
        assert all(x.dtype == s.dtype and torch.equal(x, y) for x, y in zip(a, b))
        assert a[0].shape == (len(s.layers), s.slots_per_block(BS), *s.slot_shape)
        ref.scatter(s.name, s.layers, [0, 2], b)
        plain.scatter(s.name, s.layers, [3, 5], a)
        assert torch.equal(_block(storage, s, 0), _block(storage, s, 4)) and torch.equal(_block(storage, s, 5), b[1])
    b[0].fill_(0)  # the gathered copies are the caller's: the pool is untouched
    assert _block(storage, FULL, 4).abs().sum() > 0


def test_evicted_prefix_comes_back_bit_for_bit():
    kv, storage, tiers = _setup()
    prefix = list(range(100, 124))  # 6 blocks
    _, want = _run(kv, storage, "a", prefix + [1, 2])
    for k in range(3):  # other requests take every block of the 12-block pools
        _run(kv, storage, f"o{k}", list(range(200 + 40 * k, 240 + 40 * k)))
    hit = kv.find_prefix_hit("b", prefix + [5, 6, 7])
    assert hit.num_tokens == 24 and hit.num_restored > 0
    assert all(isinstance(b, TierBlock) for b in hit.blocks["full"])
    assert kv.allocate("b", hit.start, 3, hit)
    ops = tiers.take()
    assert {op[0] for op in ops} == {"load"}
    tiers.run(ops)
    kv.check()
    for s in SPECS:
        for j, b in enumerate(kv.block_ids("b")[s.name][:6]):
            if b >= 0:
                assert torch.equal(_block(storage, s, b), want[s.name][j]), (s.name, j)
    assert _block(storage, REC, kv.block_ids("b")["csa"][0]).dtype == torch.uint8  # records stay records
    st = tiers.stats()["tiers"]["host"]
    assert st["restored"] == hit.num_restored and st["restored_bytes"] > 0


def test_a_save_runs_before_its_block_is_handed_out_again():
    kv, storage, tiers = _setup(num_blocks=3, eager=True)
    toks = list(range(1, 13))  # 3 blocks
    assert kv.allocate("a", 0, 12)
    kv.cache_blocks("a", toks, 12)  # saves queued, not run
    ids = list(kv.block_ids("a")["full"])
    want = _block(storage, FULL, ids[0])
    kv.free("a")
    assert kv.allocate("b", 0, 12)  # takes a's blocks: their saves run first
    storage.layer_cache("full", 0)[ids[0]].fill_(-1.0)  # b writes them
    assert torch.equal(tiers.host.get(("full", kv.block_hashes("probe", toks)[0])), want)


def test_deferred_copies_wait_for_their_step():
    kv, storage, tiers = _setup(num_blocks=3, eager=False)  # asynchronous scheduling: nothing runs by itself
    toks = list(range(1, 13))
    assert kv.allocate("a", 0, 12)
    kv.cache_blocks("a", toks, 12)
    kv.free("a")
    assert kv.allocate("b", 0, 12)
    assert len(tiers.host) == 0
    ops = tiers.take()  # what the next step runs before its forward
    assert [op[0] for op in ops].count("save") == 9 and not tiers.take()
    tiers.run(ops)
    assert len(tiers.host) == 9


def test_a_bad_disk_block_ends_the_hit_and_nothing_is_served_from_it(tmp_path):
    expect = {s.name: (s.dtype, (len(s.layers), s.slots_per_block(BS), *s.slot_shape)) for s in SPECS}
    disk = DiskTier(str(tmp_path), "fp", 0, expect)
    kv, storage, tiers = _setup(host=0, disk=disk)
    prefix = list(range(100, 124))
    _run(kv, storage, "a", prefix + [1])
    tiers.flush()
    for k in range(3):
        _run(kv, storage, f"o{k}", list(range(200 + 40 * k, 240 + 40 * k)))
    h = kv.block_hashes("probe", prefix)
    p = disk.path(("full", h[3]))
    p.write_bytes(p.read_bytes()[:-5])  # block 3 of the full group truncated
    hit = kv.find_prefix_hit("b", prefix + [9])
    assert hit.num_tokens == 3 * BS  # blocks 0..2 restored, the rest recomputed
    assert ("full", h[3]) not in disk and not p.exists() and disk.failures == 1
    disk.close()
