"""Bounded sliding-window replay: how far back a request must recompute when its window KV is gone.

The rule (``scheduler.sliding_replay``), for a request that resumes at ``C`` computed tokens (after a
preemption, or on a prefix-cache hit whose full and compressed blocks are cached but whose window blocks
were evicted):

- Sliding layers need keys ``C-w+1 .. C-1``. Layer ``l``'s KV at position ``p`` depends on tokens
  ``p - sum over the sliding layers below it of (w - 1) .. p`` (full and compressed layers read exact
  cached KV and add nothing), so recomputing from ``max(0, C - sum over sliding layers of (w_l - 1))``
  rebuilds exactly the KV those keys hold: ``exact`` mode, the default. The recomputed tokens below ``C``
  write only the sliding groups (the full and compressed KV below ``C`` is cached and exact; a recomputed
  value near the start of the replay is not). Tokens before the replay start get no KV (their window
  slots hold stale values that no exact position reads).
- ``window`` mode recomputes from ``max(0, C - w)`` (the largest window): exact for a single sliding
  layer, an approximation for a deeper stack (the DeepSeek-V4 engines' rule). ``off`` recomputes all.
- A model whose groups are all sliding resumes from a preemption this way without any cache; a hybrid
  model needs its full and compressed blocks from the prefix cache.
"""

from __future__ import annotations

from typing import Optional, Sequence

from inferhal.core.errors import UserError
from inferhal.core.paging.spec import KVGroupSpec

MODES = ("exact", "window", "off")


class ReplayModeError(UserError, ValueError):
    """``scheduler.sliding_replay`` names no mode (the CLI prints it and exits 2)."""


def replay_span(specs: Sequence[KVGroupSpec], mode: str = "exact") -> Optional[int]:
    """Tokens before ``C`` a resumed request must recompute, or None when it must recompute all."""
    if mode not in MODES:
        raise ReplayModeError(f"scheduler.sliding_replay must be one of {MODES}, got {mode!r}")
    if mode == "off" or not any(s.kind == "sliding" for s in specs):
        return None
    if mode == "window":
        return max(s.window for s in specs if s.kind == "sliding")
    return sum((s.window - 1) * len(s.layers) for s in specs if s.kind == "sliding")


def replay_start(num_computed: int, span: Optional[int]) -> int:
    """First position to recompute for a request preempted after ``num_computed`` tokens."""
    if span is None:
        return 0
    return max(0, num_computed - span)
