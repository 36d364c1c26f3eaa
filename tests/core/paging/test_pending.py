"""Tier saves off the step's critical path (core/paging/pending.py, offload.py, copy_worker.py): handing a step's
saves over does not wait for them, a block is pinned (not free, not handed out) until its save is over, an allocation
with no other free block waits for the oldest save and that wait is counted, the bytes saved are the bytes the block
held when it was let go even when the copier is slowed down on purpose, and shutdown leaves no thread."""

from __future__ import annotations

import threading
import time

import torch

from inferhal.backends.reference.device import TorchKVCopier, TorchKVStorage
from inferhal.core.paging import planning
from inferhal.core.paging.kv_manager import KVCacheManager
from inferhal.core.paging.offload import KVOffload
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.core.paging.tiers import DiskTier, HostTier

BS = 4
FULL = KVGroupSpec("full", "full", (0, 2), (2, 1, 8), torch.float32)
SLIDE = KVGroupSpec("swa", "sliding", (1,), (2, 1, 8), torch.bfloat16, window=6)
SPECS = (FULL, SLIDE)
DELAY = 0.4  # seconds the slowed copier sleeps before it reads the pool


class SlowCopier(TorchKVCopier):
    """The reference copier, its gather started late on purpose: a block reused before its save finished would be
    read after the new owner wrote it."""

    def __init__(self, storage, delay=DELAY):
        super().__init__(storage)
        self.delay, self.threads = delay, set()

    def gather(self, group, layers, block_ids):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        return super().gather(group, layers, block_ids)


def _setup(num_blocks=3, eager=True, delay=DELAY, disk=None, asynchronous=True):
    kv = KVCacheManager(SPECS, BS, num_blocks)
    storage = TorchKVStorage(planning.storage_request(SPECS, BS, num_blocks))
    for s in SPECS:
        for layer in s.layers:
            c = storage.layer_cache(s.name, layer)
            c.copy_(torch.randint(0, 120, c.shape, generator=torch.Generator().manual_seed(layer)).to(c.dtype))
    copier = SlowCopier(storage, delay)
    tiers = KVOffload(SPECS, copier, HostTier(10**7), disk, eager, asynchronous)
    kv.attach(tiers)
    return kv, storage, tiers, copier


def _block(storage, spec, block_id):
    return torch.stack([storage.layer_cache(spec.name, layer)[block_id] for layer in spec.layers]).clone()


def _computed(kv, tiers, rid, toks):
    """``rid`` computed ``toks`` (its blocks registered, their saves handed to the worker by the next step)."""
    assert kv.allocate(rid, 0, len(toks))
    kv.cache_blocks(rid, toks, len(toks))
    t0 = time.perf_counter()
    tiers.run(tiers.take())  # the next step's copies, before its forward
    return time.perf_counter() - t0


def test_a_step_hands_its_saves_over_without_waiting_and_the_blocks_stay_pinned():
    kv, storage, tiers, copier = _setup(num_blocks=6)
    toks = list(range(1, 13))  # 3 blocks
    handed = _computed(kv, tiers, "a", toks)
    assert handed < DELAY / 2  # the step went on while the worker sleeps
    kv.free("a")
    assert tiers.stats()["pending_stores"] == 6 and kv.num_free_blocks() == {"full": 3, "swa": 3}
    kv.check()  # the pins are the references the pools hold besides requests'
    tiers.flush()
    assert tiers.stats()["pending_stores"] == 0 and kv.num_free_blocks() == {"full": 6, "swa": 6}
    assert len(tiers.host) == 6 and copier.threads == {"inferhal-kv-copy"}
    assert tiers.stats()["store_waits"] == 0 and tiers.stats()["save_s"] < tiers.stats()["store_s"]
    kv.check()
    tiers.close()


def test_a_block_is_not_reused_before_its_save_read_it():
    kv, storage, tiers, _ = _setup(num_blocks=3)
    toks = list(range(1, 13))
    _computed(kv, tiers, "a", toks)
    ids = dict(kv.block_ids("a"))
    want = {s.name: [_block(storage, s, b) for b in ids[s.name]] for s in SPECS}  # what a let go of
    kv.free("a")
    t0 = time.perf_counter()
    assert kv.allocate("b", 0, 12)  # no other free block: waits for a's saves
    waited = time.perf_counter() - t0
    for s in SPECS:  # b writes every block it got
        for layer in s.layers:
            storage.layer_cache(s.name, layer)[kv.block_ids("b")[s.name]] = 0
    tiers.flush()
    hashes = kv.block_hashes("probe", toks)
    for s in SPECS:
        for j in range(3):
            assert torch.equal(tiers.host.get((s.name, hashes[j])), want[s.name][j]), (s.name, j)
    st = tiers.stats()
    assert st["store_waits"] >= 1 and st["store_wait_s"] > 0 and waited >= st["store_wait_s"] * 0.99
    kv.check()
    tiers.close()


def test_asynchronous_scheduling_runs_a_released_save_before_the_next_step():
    """With a step possibly in flight a queued save cannot go to the worker: an allocation that needs its block
    releases it and the next step's copies run that save on the step thread, before anything writes the block."""
    kv, storage, tiers, copier = _setup(num_blocks=3, eager=False, delay=0.0)
    toks = list(range(1, 13))
    assert kv.allocate("a", 0, 12)
    kv.cache_blocks("a", toks, 12)  # queued, the step that wrote them maybe still in flight
    want = _block(storage, FULL, kv.block_ids("a")["full"][0])
    kv.free("a")
    assert kv.allocate("b", 0, 12)
    tiers.run(tiers.take())  # the next step's copies: the released saves run here, on this thread
    assert copier.threads == {threading.current_thread().name}
    storage.layer_cache("full", 0)[kv.block_ids("b")["full"]] = 0  # then the step writes
    assert torch.equal(tiers.host.get(("full", kv.block_hashes("p", toks)[0])), want)
    assert tiers.stats()["store_waits"] == 6
    kv.check()
    tiers.close()


def test_a_failing_copy_is_a_miss_and_the_worker_lives_on(caplog):
    kv, storage, tiers, copier = _setup(num_blocks=6, delay=0.0)
    gather = copier.gather
    copier.gather = lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    _computed(kv, tiers, "a", list(range(1, 13)))
    tiers.flush()
    assert len(tiers.host) == 0 and tiers.stats()["pending_stores"] == 0  # pins released, nothing stored
    assert "KV tier copy failed" in caplog.text and tiers.worker.alive
    copier.gather = gather
    _computed(kv, tiers, "b", list(range(20, 32)))
    tiers.flush()
    assert len(tiers.host) == 6
    kv.check()
    tiers.close()


def test_close_drains_the_disk_writes_and_leaves_no_thread(tmp_path):
    expect = {s.name: (s.dtype, (len(s.layers), s.slots_per_block(BS), *s.slot_shape)) for s in SPECS}
    before = set(threading.enumerate())
    kv, storage, tiers, _ = _setup(num_blocks=6, disk=DiskTier(str(tmp_path), "fp", 0, expect), delay=0.1)
    _computed(kv, tiers, "a", list(range(1, 13)))
    assert tiers.worker.alive
    tiers.close()
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 6 and not [f for f in files if ".tmp" in f]
    assert tiers.stats()["pending_stores"] == 0


def test_close_without_draining_drops_queued_saves_cleanly():
    kv, storage, tiers, _ = _setup(num_blocks=12, delay=0.2)
    _computed(kv, tiers, "a", list(range(1, 13)))  # the worker is in this job
    _computed(kv, tiers, "b", list(range(20, 32)))  # queued behind it
    tiers.close(drain=False)
    assert not tiers.worker.alive and tiers.stats()["pending_stores"] == 0
    assert len(tiers.host) == 6  # the job under way finished; the queued one was dropped
    kv.free("a"), kv.free("b")
    kv.check()


def test_synchronous_saves_run_on_the_step_thread():
    """``asynchronous=False``: the copies of the tiers as they were first built (the measurement's baseline)."""
    kv, storage, tiers, copier = _setup(num_blocks=6, delay=0.05, asynchronous=False)
    handed = _computed(kv, tiers, "a", list(range(1, 13)))
    assert handed >= 0.05 and copier.threads == {threading.current_thread().name} and len(tiers.host) == 6
    kv.free("a")
    assert kv.num_free_blocks() == {"full": 6, "swa": 6}
    tiers.close()


def test_an_idle_worker_thread_ends_and_the_next_copy_starts_another():
    kv, storage, tiers, _ = _setup(num_blocks=12, delay=0.0)
    tiers.worker.idle_s = 0.05
    _computed(kv, tiers, "a", list(range(1, 13)))
    tiers.flush()
    deadline = time.monotonic() + 5
    while tiers.worker.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tiers.worker.alive  # a dropped engine leaves no thread behind
    _computed(kv, tiers, "b", list(range(20, 32)))
    tiers.flush()
    assert len(tiers.host) == 12
    tiers.close()
