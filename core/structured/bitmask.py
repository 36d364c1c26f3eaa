"""A step's structured-output token bitmask, filled on a side thread while the model's forward runs.

The bitmask depends only on each request's grammar state and its drafts, not on the step's logits, so the
runner submits it before the forward and waits for it (if at all) before sampling. A job is one request's
rows: ``(first logits row, grammar, drafts, request id)``: the row of its last known token and one per draft
position, the matcher advanced through the drafts to fill each position's row, then rolled back (the tokens
that stand are accepted after sampling). A position no token may follow (a dead end) lets the
end-of-sequence tokens through, so the request stops instead of sampling from nothing; the fill reports it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch

from inferhal.core.structured.grammar import allocate_bitmask

#: (first logits row, the request's matcher, its drafts, request id)
Job = tuple[int, Any, Sequence[int], str]


class BitmaskFiller:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size, self.eos_token_ids = int(vocab_size), tuple(eos_token_ids)
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, jobs: Sequence[Job]) -> Future:
        """Fill ``jobs``' bitmask on the side thread → a future of :meth:`fill`'s result."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="inferhal-bitmask")
        return self._pool.submit(self.fill, jobs)

    def fill(self, jobs: Sequence[Job]) -> tuple[torch.Tensor, list[int], list[tuple[str, int]], float]:
        """→ ``(bitmask, logits row of each bitmask row, dead ends (request id, position), seconds)``."""
        t0 = time.perf_counter()
        span = [len(d) + 1 for _, _, d, _ in jobs]
        bitmask = allocate_bitmask(sum(span), self.vocab_size)
        at_rows, owner, k = [], [], 0
        for (row, g, drafts, rid), n in zip(jobs, span):
            at_rows.extend(range(row, row + n))
            owner.extend((rid, j) for j in range(n))
            if g.terminated:  # finished by its stop token in the step before (asynchronous scheduling ran this
                k += n  # one ahead): its token is dropped, any row will do
                continue
            advanced = 0
            for j in range(n):
                # positions after a draft the grammar refuses, or after its stop token, are never reached
                if advanced == j and not g.terminated:
                    g.fill(bitmask, k)
                k += 1
                if j < n - 1 and advanced == j and g.accept(drafts[j]):
                    advanced += 1
            g.rollback(advanced)
        dead = ~bitmask.ne(0).any(dim=1)
        ends = []
        if bool(dead.any()):
            for r in torch.nonzero(dead).flatten().tolist():
                for e in self.eos_token_ids:
                    word = (int(bitmask[r, e // 32]) & 0xFFFFFFFF) | (1 << (e % 32))
                    bitmask[r, e // 32] = word - (1 << 32) if word >= 1 << 31 else word
                ends.append(owner[r])
        return bitmask, at_rows, ends, time.perf_counter() - t0
