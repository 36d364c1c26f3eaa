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
  starts with the previous turn's prompt and answer, which that rank's cache holds. A request carrying a
  session key (``prompt_cache_key`` or ``X-Session-Id``, :mod:`~inferhal.core.server.protocol`) whose key was
  placed before goes to that key's rank, ahead of any prefix, unless that rank's load exceeds the least loaded
  rank's by more than ``margin`` tokens: then it is placed as above and its key moves to the rank it gets.
  The key -> rank table (:class:`Sessions`) is a function of the placement sequence, so every rank keeps it
  alike; it remembers the :data:`MAX_SESSIONS` keys placed last.
- ``vllm``: vLLM's DP score ``waiting * 4 + running``, the lowest first (ties: the lowest rank); each
  request placed counts as waiting. No cache, no tokens, no session keys.
- ``round_robin``: the ``n``-th request of the server's life goes to rank ``n mod dp`` (no session keys).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from inferhal.core.parallel.dp_frontend import common_blocks

POLICIES = ("tokens_cache", "vllm", "round_robin")
#: session keys a :class:`Sessions` table remembers (each at most MAX_SESSION_KEY characters, server/protocol.py)
MAX_SESSIONS = 16_384


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


class Sessions:
    """Session key -> the rank its latest request was placed on, at most ``size`` keys (the least recently
    placed one is forgotten first). Changed only by :func:`place`, so ranks placing alike keep equal tables."""

    def __init__(self, size: int = MAX_SESSIONS) -> None:
        if size < 1:
            raise ValueError(f"a session table holds at least one key, not {size}")
        self.size = int(size)
        self._rank: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rank)

    def get(self, key: str) -> Optional[int]:
        return self._rank.get(key)

    def put(self, key: str, rank: int) -> None:
        self._rank[key] = rank
        self._rank.move_to_end(key)
        while len(self._rank) > self.size:
            self._rank.popitem(last=False)

    def items(self) -> list[tuple[str, int]]:
        """(key, rank), least recently placed first."""
        return list(self._rank.items())


def place(policy: str, loads: Sequence[TokenLoad], cached_blocks: Sequence[Sequence[int]],
          block_hashes: Sequence[Sequence[bytes]], prompt_lens: Sequence[int], margin: int,
          start: int = 0, keys: Optional[Sequence[Optional[str]]] = None,
          sessions: Optional[Sessions] = None) -> list[int]:
    """The rank of each new request.

    :param loads: per rank, its load before the placement.
    :param cached_blocks: ``[rank][request]`` leading prompt blocks that rank's prefix cache holds.
    :param block_hashes: per request, its prompt's chained block hashes (affinity within the batch).
    :param prompt_lens: per request, its prompt tokens.
    :param margin: ``tokens_cache``: tokens a rank holding the prefix may carry beyond the least loaded one.
    :param start: ``round_robin``: requests placed before this batch.
    :param keys: ``tokens_cache``: per request, its session key or None.
    :param sessions: ``tokens_cache``: the key -> rank table, read and updated here (one table per server life,
        changed by nothing else).
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
        key = keys[i] if keys is not None and sessions is not None else None
        least = min(range(n), key=lambda q: (tokens[q], q))
        home = sessions.get(key) if key is not None else None
        if home is not None and home < n and tokens[home] - tokens[least] <= margin:
            r = home  # its session's rank
        else:
            hit = [max([cached_blocks[r][i]] + [common_blocks(hashes, block_hashes[j]) for j in placed[r]])
                   for r in range(n)]
            best = max(hit)
            r = least
            if best > 0:
                holder = min((q for q in range(n) if hit[q] == best), key=lambda q: (tokens[q], q))
                if tokens[holder] - tokens[least] <= margin:
                    r = holder
        if key is not None:
            sessions.put(key, r)
        tokens[r] += int(prompt_lens[i])
        placed[r].append(i)
        out.append(r)
    return out


def balance(values: Sequence[float]) -> float:
    """max / mean of per-rank figures (1.0: even; 0 when all are 0): the balance figure /metrics shows."""
    vals = [float(v) for v in values]
    mean = sum(vals) / len(vals) if vals else 0.0
    return max(vals) / mean if mean > 0 else 0.0
