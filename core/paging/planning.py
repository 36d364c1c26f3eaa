"""Memory planning for the shared KV pool: page size, bytes per block, blocks per byte budget.

One formula serves the planner and the storage backends (``TorchKVStorage`` uses :func:`page_bytes`):
every group's page (``slots_per_block * slot_bytes``) is padded up to the largest one, rounded to
:data:`PAGE_ALIGN` bytes; the i-th layer of every group shares one ``[num_blocks, page_bytes]`` buffer,
so a block costs ``page_bytes * max(layers per group)`` bytes.
"""

from __future__ import annotations

from typing import Sequence

from inferhal.core.backend import KVGroupLayout, KVStorageRequest
from inferhal.core.paging.spec import KVGroupSpec

PAGE_ALIGN = 16


def layouts(specs: Sequence[KVGroupSpec], block_size: int) -> tuple[KVGroupLayout, ...]:
    return tuple(KVGroupLayout(s.name, tuple(s.layers), s.slots_per_block(block_size), tuple(s.slot_shape), s.dtype)
                 for s in specs)


def page_bytes(groups: Sequence[KVGroupLayout]) -> int:
    """Bytes of one block of one layer slot, the same for every group (padded to the largest page)."""
    p = max((g.slots_per_block * g.slot_bytes for g in groups), default=0)
    return p + (-p % PAGE_ALIGN)


def layer_slots(groups: Sequence[KVGroupLayout]) -> int:
    """Number of ``[num_blocks, page_bytes]`` buffers: the most layers any group has."""
    return max((len(g.layers) for g in groups), default=0)


def bytes_per_block(groups: Sequence[KVGroupLayout]) -> int:
    return page_bytes(groups) * layer_slots(groups)


def num_blocks_for_budget(budget_bytes: int, groups: Sequence[KVGroupLayout]) -> int:
    per = bytes_per_block(groups)
    return int(budget_bytes // per) if per else 0


def storage_request(specs: Sequence[KVGroupSpec], block_size: int, num_blocks: int) -> KVStorageRequest:
    return KVStorageRequest(num_blocks=num_blocks, block_size=block_size, groups=layouts(specs, block_size))


def compatible_block_size(specs: Sequence[KVGroupSpec], block_size: int) -> int:
    """The smallest multiple of ``block_size`` that every group's ``tokens_per_slot`` divides."""
    import math

    lcm = 1
    for s in specs:
        lcm = lcm * s.tokens_per_slot // math.gcd(lcm, s.tokens_per_slot)
    return block_size * lcm // math.gcd(block_size, lcm)
