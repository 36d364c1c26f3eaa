"""The router's hint of what each prefill instance's prefix cache holds (placement by prefix, :mod:`.router`):
per instance, the chained hashes of the leading full blocks of the prompts the router sent there. A hint,
not a mirror: an instance may have evicted them since, and then the prefill is computed again there."""

from __future__ import annotations

import collections

#: a prefix hit is given up for load when the hit's instance has this many more blocks' worth of prompt
#: tokens still to prefill than the least loaded prefill instance
PREFIX_SLACK = 64


class Prefixes:
    """Per prefill instance, the chained hashes of the leading full blocks of the prompts the router sent it
    (the last ``cap`` of them): which instance's prefix cache most likely holds a new prompt's prefix."""

    def __init__(self, block_size: int, cap: int = 65536, max_blocks: int = 256) -> None:
        self.block_size, self.cap, self.max_blocks = int(block_size), cap, max_blocks
        self.seen: dict[str, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)

    def keys(self, prompt: list) -> list[int]:
        out, h, b = [], 0, self.block_size
        for i in range(min(len(prompt) // b, self.max_blocks)):
            h = hash((h, tuple(prompt[i * b:(i + 1) * b])))
            out.append(h)
        return out

    def hit(self, name: str, keys: list[int]) -> int:
        """Leading blocks of ``keys`` that ``name`` was sent."""
        seen, n = self.seen.get(name, {}), 0
        for k in keys:
            if k not in seen:
                break
            n += 1
        return n

    def add(self, name: str, keys: list[int]) -> None:
        seen = self.seen[name]
        for k in keys:
            seen[k] = None
            seen.move_to_end(k)
        while len(seen) > self.cap:
            seen.popitem(last=False)

    def forget(self, name: str) -> None:
        self.seen.pop(name, None)
