"""Bounded sliding-window replay: how far back a preempted request must recompute.

The rule (``scheduler.sliding_replay``), for a request preempted after computing ``C`` tokens:

- It applies only when every KV group of the model is ``sliding``; a full or compressed group keeps
  KV for the whole context, so such a model recomputes from the prefix-cache hit as usual.
- The next token (position ``C``) reads keys ``C-w+1 .. C-1`` of every sliding layer. Layer ``l``'s
  KV at position ``p`` depends on tokens ``p - (l-1)(w-1) .. p``, so recomputing from
  ``max(0, C - sum over layers of (w_l - 1))`` rebuilds exactly the KV those keys hold: ``exact`` mode,
  the default. Tokens before the replay start get no KV (their block slots hold stale values that no
  exact position reads).
- ``window`` mode recomputes from ``max(0, C - w)`` (the largest window): exact for a single sliding
  layer, an approximation for a deeper stack (the DeepSeek-V4 engines' rule). ``off`` recomputes all.
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
    if mode == "off" or not specs or any(s.kind != "sliding" for s in specs):
        return None
    if mode == "window":
        return max(s.window for s in specs)
    return sum((s.window - 1) * len(s.layers) for s in specs)


def replay_start(num_computed: int, span: Optional[int]) -> int:
    """First position to recompute for a request preempted after ``num_computed`` tokens."""
    if span is None:
        return 0
    return max(0, num_computed - span)
