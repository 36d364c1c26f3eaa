"""Memory planning for the KV cache: one block pool per layer group, under one byte budget.

Each group has its own pool of blocks (a block holds ``block_size`` tokens of that group, in all of the
group's layers) and its own storage: ``num_blocks[g] x layers x page_bytes(g)``, with a group's page as
big as its own slots need (``slots_per_block * slot_bytes``, rounded to :data:`PAGE_ALIGN`). Nothing is
padded to another group's page, so a model whose groups differ by 100x in bytes per token (DeepSeek-V4:
a 128-token window of 1 KB slots beside HCA entries every 128 tokens) pays for what it stores.

Why pools per group rather than vLLM's one pool with per-group tokens per block: a group's need grows in
one of two ways, and each way has an exact budget rule.
- ``full`` and ``compressed`` groups grow with context: a request of L tokens needs about L / block_size
  blocks in *each* of them, whatever its ratio. So they get the same number of blocks each, and a budget
  of B bytes buys ``B // sum(bytes per block)`` of them: the bytes of one token are paid once per group,
  never padded.
- ``sliding`` groups hold a bounded window per request: ``live_blocks`` each, plus one step's new tokens.
  They get a reservation for ``max_num_seqs`` requests (at most half the budget; past that the scheduler
  preempts as it does when any pool is full), and the growth groups share the rest.
One formula serves the planner (``inferhal plan kv``), the engine and the storage backends
(``TorchKVStorage`` allocates exactly :func:`storage_bytes`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from inferhal.core.backend import KVGroupLayout, KVStorageRequest
from inferhal.core.errors import UserError
from inferhal.core.paging.kv_manager import blocks_needed
from inferhal.core.paging.spec import KVGroupSpec

PAGE_ALIGN = 16
SLIDING_SHARE = 0.5  # most of a budget that sliding-window reservations may take


def layouts(specs: Sequence[KVGroupSpec], block_size: int,
            num_blocks: Mapping[str, int] | None = None) -> tuple[KVGroupLayout, ...]:
    return tuple(KVGroupLayout(s.name, tuple(s.layers), s.slots_per_block(block_size), tuple(s.slot_shape), s.dtype,
                               int((num_blocks or {}).get(s.name, 0)))
                 for s in specs)


def page_bytes(group: KVGroupLayout) -> int:
    """Bytes of one block of one layer of ``group``."""
    p = group.slots_per_block * group.slot_bytes
    return p + (-p % PAGE_ALIGN)


def group_block_bytes(group: KVGroupLayout) -> int:
    """Bytes of one block of ``group``: its page in every one of its layers."""
    return page_bytes(group) * len(group.layers)


def storage_bytes(groups: Sequence[KVGroupLayout]) -> int:
    """Bytes a storage backend allocates for ``groups`` (each with its ``num_blocks``)."""
    return sum(g.num_blocks * group_block_bytes(g) for g in groups)


def live_blocks(spec: KVGroupSpec, block_size: int, step_tokens: int = 1) -> int:
    """Most blocks one request of a sliding group holds at a step of ``step_tokens`` new tokens."""
    return -(-(spec.window - 1 + step_tokens) // block_size) + 1


def blocks_for_budget(specs: Sequence[KVGroupSpec], block_size: int, budget_bytes: int, max_num_seqs: int,
                      max_step_tokens: int, max_model_len: int | None = None, retained: int = 0) -> dict[str, int]:
    """Blocks per group for a budget of ``budget_bytes`` (see the module docstring). ``max_model_len``
    caps each group at what ``max_num_seqs`` requests of that length could use; ``retained`` finished requests'
    windows (``cache.retain_windows``) join the sliding groups' reservation."""
    lay = dict(zip((s.name for s in specs), layouts(specs, block_size)))
    sliding = [s for s in specs if s.kind == "sliding"]
    growth = [s for s in specs if s.kind != "sliding"]
    want = {s.name: (max_num_seqs + retained) * live_blocks(s, block_size) + -(-max_step_tokens // block_size)
            for s in sliding}
    reserve = sum(want[s.name] * group_block_bytes(lay[s.name]) for s in sliding)
    cap = SLIDING_SHARE * budget_bytes if growth else budget_bytes
    out = {}
    if reserve > cap:  # scale the reservations down, never below one request at its largest step
        for s in sliding:
            floor = live_blocks(s, block_size, max_step_tokens)
            out[s.name] = max(floor, int(want[s.name] * cap / reserve))
    else:
        out.update(want)
    rest = budget_bytes - sum(out[s.name] * group_block_bytes(lay[s.name]) for s in sliding)
    per = sum(group_block_bytes(lay[s.name]) for s in growth)
    n = int(rest // per) if per and rest > 0 else 0
    for s in growth:
        out[s.name] = n
    if max_model_len:
        for s in growth:
            out[s.name] = min(out[s.name], max_num_seqs * blocks_needed(s, block_size, max_model_len) + 1)
    return out


def check_budget(specs: Sequence[KVGroupSpec], block_size: int, num_blocks: Mapping[str, int]) -> None:
    """Raise UserError when some group gets no block, naming it and the bytes one block needs."""
    lay = layouts(specs, block_size)
    empty = [(s, g) for s, g in zip(specs, lay) if num_blocks.get(s.name, 0) < 1]
    if empty:
        need = sum(group_block_bytes(g) for g in lay)
        names = ", ".join(f"{s.name} ({group_block_bytes(g):,} B a block)" for s, g in empty)
        raise UserError(f"the KV budget holds no block of group(s) {names}; one block of every group takes "
                        f"{need:,} B: raise cache.kv_cache_bytes (or set cache.num_blocks)")


def storage_request(specs: Sequence[KVGroupSpec], block_size: int, num_blocks: Mapping[str, int] | int) -> KVStorageRequest:
    if isinstance(num_blocks, int):
        num_blocks = {s.name: num_blocks for s in specs}
    groups = layouts(specs, block_size, num_blocks)
    return KVStorageRequest(num_blocks=max((g.num_blocks for g in groups), default=0), block_size=block_size,
                            groups=groups)


def compatible_block_size(specs: Sequence[KVGroupSpec], block_size: int) -> int:
    """The smallest multiple of ``block_size`` that every group's ``tokens_per_slot`` divides."""
    import math

    if block_size < 1:
        raise UserError(f"cache.block_size must be >= 1, got {block_size}")

    lcm = 1
    for s in specs:
        lcm = lcm * s.tokens_per_slot // math.gcd(lcm, s.tokens_per_slot)
    return block_size * lcm // math.gcd(block_size, lcm)
