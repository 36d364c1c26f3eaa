"""Which DP rank serves a new request: a pure function of every rank's load and prefix cache.

Every DP rank is given the same new requests in the same order (the offline API and ``inferhal generate``
run the same program on every rank). At the next step each rank reports its :class:`RankLoad` and, per new
request, how many leading prompt blocks its own prefix cache holds; the reports are all-gathered and every
rank runs :func:`place_requests` on the same data, so all agree on the placement without a coordinator.

Rules, per request in arrival order:

1. **Prefix affinity.** The ranks with the longest prefix hit (its cache, or a request placed on it
   earlier in this same batch that shares leading blocks, whose KV will be cached there first) are
   preferred, as long as the best of them carries at most :data:`AFFINITY_SLACK` more requests than the
   least loaded rank. A hit shorter than one block counts as none.
2. **Load.** Otherwise the least loaded rank: fewest requests (waiting + running, counting the ones just
   placed), then the most free KV, then the lowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: extra requests a rank may carry beyond the least loaded one and still win a request by prefix affinity
AFFINITY_SLACK = 2


@dataclass
class RankLoad:
    """One DP rank's load when new requests are placed."""

    waiting: int  # requests queued in its scheduler
    running: int  # requests it is running
    free_kv: int  # free share of its fullest KV pool, in permille (1000 = empty)

    @property
    def requests(self) -> int:
        return self.waiting + self.running


def common_blocks(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """Leading block hashes two chained-hash lists share (equal hashes mean equal whole prefixes)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def place_requests(loads: Sequence[RankLoad], cached_blocks: Sequence[Sequence[int]],
                   block_hashes: Sequence[Sequence[bytes]], slack: int = AFFINITY_SLACK) -> list[int]:
    """The rank of each new request.

    :param loads: per rank, its load before the placement.
    :param cached_blocks: ``[rank][request]`` leading prompt blocks found in that rank's prefix cache.
    :param block_hashes: per request, its prompt's chained block hashes (for affinity within the batch).
    """
    n = len(loads)
    if n == 0:
        raise ValueError("place_requests needs at least one rank")
    reqs = [ld.requests for ld in loads]
    free = [ld.free_kv for ld in loads]
    placed: list[list[int]] = [[] for _ in range(n)]  # per rank, the requests of this batch placed there
    out = []
    for i, hashes in enumerate(block_hashes):
        hit = [max([cached_blocks[r][i]] + [common_blocks(hashes, block_hashes[j]) for j in placed[r]])
               for r in range(n)]
        least = min(reqs)
        best = max(hit)
        cands = [r for r in range(n) if best > 0 and hit[r] == best and reqs[r] <= least + slack]
        pool = cands or list(range(n))
        r = min(pool, key=lambda q: (reqs[q], -free[q], q))
        reqs[r] += 1
        placed[r].append(i)
        out.append(r)
    return out
