"""KV events as a vLLM-style router consumes them: a ZMQ subscriber decoding vLLM's ``KVEventBatch`` layout with
msgspec (``array_like`` structs, tagged events) rebuilds the pool's block set exactly, per group, after a random
workload of allocations, hits, evictions, window releases and resets; a late subscriber rebuilds it from the
replay socket; tier stores and removals arrive under their own media."""

from __future__ import annotations

import random
import time
from typing import Any, Optional, Union

import msgspec
import pytest
import torch
import zmq

from inferhal.core.paging import planning
from inferhal.core.paging.events import WIRE_VERSION, KVEventLog, ZmqEventPublisher, external_hash
from inferhal.core.paging.kv_manager import KVCacheManager
from inferhal.core.paging.offload import KVOffload, TorchBlockCopier
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.core.paging.tiers import HostTier
from inferhal.backends.reference.device import TorchKVStorage


# what a consumer written for vLLM declares (vLLM's field order; our own declarations)
class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class Event(msgspec.Struct, array_like=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str] = None
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(Event):
    pass


class EventBatch(Batch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODE = msgspec.msgpack.Decoder(EventBatch)
BS = 4
SPECS = (KVGroupSpec("full", "full", (0,), (8,), torch.float32),
         KVGroupSpec("swa", "sliding", (1,), (8,), torch.float32, window=6))


class Index:
    """A router's view: (medium, group_idx) -> block hashes."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, int], set[int]] = {}
        self.seq = -1

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.seq + 1, f"batch {seq} after {self.seq}"
        self.seq = seq
        for ev in DECODE.decode(payload).events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == BS and len(ev.token_ids) in (0, BS * len(ev.block_hashes))
                self.blocks.setdefault((ev.medium, ev.group_idx), set()).update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                got = self.blocks.setdefault((ev.medium, ev.group_idx), set())
                assert set(ev.block_hashes) <= got, "removed a block never stored"
                got.difference_update(ev.block_hashes)
            else:
                for key in [k for k in self.blocks if k[0] == "GPU"]:
                    del self.blocks[key]

    def of(self, medium: str) -> dict[int, set[int]]:
        return {g: h for (m, g), h in self.blocks.items() if m == medium and h}


def _pool_sets(kv) -> dict[int, set[int]]:
    out = {}
    for i, s in enumerate(kv.specs):
        hs = {external_hash(h) for (_, h) in kv.pools[s.name].cached}
        if hs:
            out[i] = hs
    return out


def _workload(kv, rng: random.Random, steps: int = 120) -> None:
    """Requests over a few shared prefixes: prefix hits, window releases, evictions, and two resets."""
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice((8, 12, 20)))] for _ in range(4)]
    live: dict[str, list[int]] = {}
    for step in range(steps):
        if live and (rng.random() < 0.4 or len(live) > 3):
            rid = rng.choice(sorted(live))
            toks = live.pop(rid)
            kv.cache_blocks(rid, toks, len(toks))
            kv.free(rid)
        else:
            rid = f"r{step}"
            toks = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
            hit = kv.find_prefix_hit(rid, toks)
            if kv.allocate(rid, hit.start, len(toks) - hit.start, hit):
                kv.cache_blocks(rid, toks, len(toks))
                live[rid] = toks
            else:
                kv.free(rid)
        if kv.offload is not None:
            kv.offload.run(kv.offload.take())
        if step in (50, 90):
            if step == 50:
                kv.pools["swa"].reset_prefix_cache()  # one pool: its blocks removed one by one
            else:
                kv.reset_prefix_cache()  # all of them: AllBlocksCleared
    kv.check()


def _sub(port: int, topic: bytes = b"") -> Any:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    return sub


def _drain(sock, index: Index) -> None:
    while sock.poll(200):
        topic, seq, payload = sock.recv_multipart()
        index.apply(int.from_bytes(seq, "big"), payload)


def _replay(endpoint: str, start: int, index: Index) -> None:
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
    req.send_multipart((b"", start.to_bytes(8, "big")))
    while req.poll(2000):
        _, seq, payload = req.recv_multipart()
        if not payload:
            assert int.from_bytes(seq, "big", signed=True) == -1
            break
        index.apply(int.from_bytes(seq, "big"), payload)
    req.close(0)


@pytest.fixture
def setup():
    kv = KVCacheManager(SPECS, BS, 10)
    storage = TorchKVStorage(planning.storage_request(SPECS, BS, 10))
    log = KVEventLog(SPECS, BS)
    tiers = KVOffload(SPECS, TorchBlockCopier(storage), HostTier(40 * 4 * 8 * 4, log))  # ~40 blocks of each
    kv.attach(tiers, log)
    pub = ZmqEventPublisher(log, "tcp://*:0", "tcp://*:0", topic="kv", buffer_steps=100000)
    yield kv, pub
    pub.close()


def test_a_subscriber_rebuilds_the_pool_and_host_tier_exactly(setup):
    kv, pub = setup
    assert WIRE_VERSION == 1
    port = int(pub.endpoint.rsplit(":", 1)[1])
    sub = _sub(port, b"kv")
    time.sleep(0.3)  # a SUB socket receives only what is sent after its subscription arrives
    _workload(kv, random.Random(7))
    assert pub.flush()
    live = Index()
    _drain(sub, live)
    sub.close(0)
    assert live.seq >= 0 and kv.num_evictions() > 0
    assert live.of("GPU") == _pool_sets(kv)  # exactly the pool's cached blocks, group by group
    host = {}
    for (g, h) in kv.offload.host.entries:
        host.setdefault(kv.specs.index(next(s for s in kv.specs if s.name == g)), set()).add(external_hash(h))
    assert live.of("CPU") == host and kv.offload.host.evictions > 0

    late = Index()  # a router that starts now: the replay socket gives it everything buffered
    _replay(pub.replay_endpoint, 0, late)
    assert late.blocks == live.blocks and late.seq == live.seq


def test_stored_events_carry_the_chain_and_tokens(setup):
    kv, pub = setup
    port = int(pub.endpoint.rsplit(":", 1)[1])
    sub = _sub(port)
    time.sleep(0.3)
    toks = list(range(1, 14))  # 3 full blocks
    assert kv.allocate("a", 0, 13)
    kv.cache_blocks("a", toks, 13)
    assert pub.flush()
    got = []
    while sub.poll(200):
        got += DECODE.decode(sub.recv_multipart()[2]).events
    sub.close(0)
    full = [e for e in got if isinstance(e, BlockStored) and e.group_idx == 0 and e.medium == "GPU"]
    hashes = kv.block_hashes("a", toks)
    assert len(full) == 1 and full[0].block_hashes == [external_hash(h) for h in hashes]
    assert full[0].parent_block_hash is None and full[0].token_ids == toks[:12]
    assert full[0].kv_cache_spec_kind == "full"
    swa = [e for e in got if isinstance(e, BlockStored) and e.group_idx == 1]
    assert swa and all(e.kv_cache_spec_sliding_window == 6 for e in swa)


def test_a_bad_endpoint_is_refused_naming_the_field():
    from inferhal.core.errors import UserError

    with pytest.raises(UserError, match="cache.kv_events_endpoint"):
        ZmqEventPublisher(KVEventLog(SPECS, BS), "nonsense://x")
