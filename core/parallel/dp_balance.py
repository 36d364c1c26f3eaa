"""Which DP rank serves a new request under ``inferhal serve`` with data-parallel attention (``parallel.dp > 1``):
a pure function of every rank's load and prefix cache, chosen by ``parallel.dp_balance``.

Every rank is handed the same new requests in the same order; at the next step the ranks all-gather their
:class:`TokenLoad` and, per new request, how many of its leading prompt blocks their own prefix cache holds,
and each runs :func:`place` on the same data, so all agree without a coordinator (as
:mod:`.dp_frontend` does for ``inferhal generate``).

Policies, per request in arrival order:

- ``tokens_cache`` (the default): the rank whose prefix cache holds the longest run of the prompt (its
  cache, or a request placed on it earlier in the same batch sharing leading blocks; ties: the lighter),
  unless its load exceeds the least loaded rank's by more than ``margin`` tokens
  (``parallel.dp_balance_margin``); otherwise, and for a prompt no rank holds, the least loaded rank.
  Load counts tokens: prompt tokens still to prefill plus tokens whose KV is in use, each request placed in
  the batch adding its prompt. A multi-turn session stays on its rank by prefix: the next turn's prompt
  starts with the previous turn's prompt and answer, which that rank's cache holds.
- ``vllm``: vLLM's DP score ``waiting * 4 + running``, the lowest first (ties: the lowest rank); each
  request placed counts as waiting. No cache, no tokens.
- ``round_robin``: the ``n``-th request of the server's life goes to rank ``n mod dp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from inferhal.core.parallel.dp_frontend import common_blocks

POLICIES = ("tokens_cache", "vllm", "round_robin")


@dataclass
class TokenLoad:
    """One DP rank's load when new requests are placed."""

    waiting: int  # requests queued in its scheduler
    running: int  # requests it is running
    prefill_tokens: int  # prompt tokens of its requests not computed yet
    kv_tokens: int  # tokens of its running requests whose KV is computed

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.kv_tokens

    @property
    def vllm_score(self) -> int:
        return self.waiting * 4 + self.running


def place(policy: str, loads: Sequence[TokenLoad], cached_blocks: Sequence[Sequence[int]],
          block_hashes: Sequence[Sequence[bytes]], prompt_lens: Sequence[int], margin: int,
          start: int = 0) -> list[int]:
    """The rank of each new request.

    :param loads: per rank, its load before the placement.
    :param cached_blocks: ``[rank][request]`` leading prompt blocks that rank's prefix cache holds.
    :param block_hashes: per request, its prompt's chained block hashes (affinity within the batch).
    :param prompt_lens: per request, its prompt tokens.
    :param margin: ``tokens_cache``: tokens a rank holding the prefix may carry beyond the least loaded one.
    :param start: ``round_robin``: requests placed before this batch.
    """
    n = len(loads)
    if n == 0:
        raise ValueError("place needs at least one rank")
    if policy not in POLICIES:
        raise ValueError(f"unknown DP balance policy {policy!r} (one of {', '.join(POLICIES)})")
    if policy == "round_robin":
        return [(start + i) % n for i in range(len(block_hashes))]
    if policy == "vllm":
        score = [ld.vllm_score for ld in loads]
        out = []
        for _ in block_hashes:
            r = min(range(n), key=lambda q: (score[q], q))
            score[r] += 4
            out.append(r)
        return out
    tokens = [ld.tokens for ld in loads]
    placed: list[list[int]] = [[] for _ in range(n)]  # per rank, the requests of this batch placed there
    out = []
    for i, hashes in enumerate(block_hashes):
        hit = [max([cached_blocks[r][i]] + [common_blocks(hashes, block_hashes[j]) for j in placed[r]])
               for r in range(n)]
        least = min(range(n), key=lambda q: (tokens[q], q))
        best = max(hit)
        r = least
        if best > 0:
            holder = min((q for q in range(n) if hit[q] == best), key=lambda q: (tokens[q], q))
            if tokens[holder] - tokens[least] <= margin:
                r = holder
        tokens[r] += int(prompt_lens[i])
        placed[r].append(i)
        out.append(r)
    return out


def balance(values: Sequence[float]) -> float:
    """max / mean of per-rank figures (1.0: even; 0 when all are 0): the balance figure /metrics shows."""
    vals = [float(v) for v in values]
    mean = sum(vals) / len(vals) if vals else 0.0
    return max(vals) / mean if mean > 0 else 0.0
