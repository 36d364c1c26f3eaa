"""What an engine that hands requests to another engine, or adopts them from one, does besides stepping.

Prefill/decode disaggregation (core/disagg) implements it: its prefill side exports each request once its
first token is sampled, its decode side adopts requests prefilled elsewhere. The engine only calls these
four points of its loop and knows nothing of wires, payloads or roles.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class KVTransfer(Protocol):
    role: str  # "prefill" or "decode": what `inferhal serve parallel.role=...` runs

    def bind(self, engine: Any) -> None:
        """Called once by the engine's constructor, when it is built; raises a UserError where this engine
        cannot play the role (e.g. a prefill side with asynchronous scheduling)."""

    def before_step(self) -> None:
        """At the start of every step (the decode side adopts what waited for room)."""

    def after_update(self, changed: Sequence[Any]) -> None:
        """After a step's tokens are in (the prefill side exports the requests that got their first token)."""

    def abort(self, request_ids: Sequence[str]) -> None:
        """Requests aborted: anything held for them outside the scheduler is dropped."""

    def pending(self) -> Sequence[str]:
        """Requests held outside the scheduler that still need steps (the engine is not idle while any are)."""
