"""Helpers for the DeepSeek-V4 tests: a paged driver (contiguous block allocator + TorchKVStorage +
build_attn_batches, exactly what the engine's model runner feeds the model) and transformers oracles."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inferhal.backends.reference.device import TorchKVStorage
from inferhal.core.backend import KVGroupLayout, KVStorageRequest
from inferhal.core.models.base import ForwardBatch
from inferhal.core.paging.batch import SeqSlice, build_attn_batches


class PagedDriver:
    """Runs a model step by step over the paged KV cache, one growing block table per sequence."""

    def __init__(self, model, block_size: int = 0, num_blocks: int = 512) -> None:
        self.specs = list(model.kv_groups())
        # smallest block holding whole slots of every group (and not larger than needed)
        block_size = block_size or max([16] + [s.tokens_per_slot for s in self.specs])
        self.model, self.block_size = model, block_size
        layouts = tuple(KVGroupLayout(s.name, s.layers, s.slots_per_block(block_size), s.slot_shape, s.dtype)
                        for s in self.specs)
        self.kv = TorchKVStorage(KVStorageRequest(num_blocks, block_size, layouts))
        self.num_blocks = num_blocks
        self._next = 0
        self.tables: dict[int, dict[str, list[int]]] = {}
        self.computed: dict[int, int] = {}

    def _grow(self, sid: int, total: int) -> dict[str, list[int]]:
        tab = self.tables.setdefault(sid, {s.name: [] for s in self.specs})
        need = -(-total // self.block_size)
        for name, blocks in tab.items():
            while len(blocks) < need:
                assert self._next < self.num_blocks, "test allocator ran out of blocks"
                blocks.append(self._next)
                self._next += 1
        return tab

    def batch(self, steps: dict[int, list[int]]) -> ForwardBatch:
        seqs, ids = [], []
        for sid, new in steps.items():
            nc = self.computed.get(sid, 0)
            seqs.append(SeqSlice(nc, len(new), self._grow(sid, nc + len(new))))
            ids.extend(new)
        pos, qsl, attn = build_attn_batches(self.specs, self.block_size, seqs)
        return ForwardBatch(torch.tensor(ids, dtype=torch.long), pos, qsl, attn, (qsl[1:] - 1).long())

    def step(self, steps: dict[int, list[int]], all_logits: bool = False) -> torch.Tensor:
        """Run one step (seq id -> new token ids); logits of each sequence's last token (or every token)."""
        b = self.batch(steps)
        if all_logits:
            b = ForwardBatch(b.input_ids, b.positions, b.query_start_loc, b.attn, torch.arange(len(b.input_ids)))
        out = self.model.forward(b, self.kv)
        for sid, new in steps.items():
            self.computed[sid] = self.computed.get(sid, 0) + len(new)
        return out


@pytest.fixture(scope="session")
def reference_backend():
    from inferhal.core.config.schema import BackendConfig
    from inferhal.core.registry import BackendRegistry

    return BackendRegistry.discover().select(BackendConfig(name="reference"))


@pytest.fixture(scope="session")
def v4():
    return SimpleNamespace(PagedDriver=PagedDriver)
