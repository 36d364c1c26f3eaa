"""When to rebalance: every ``step_interval`` steps, or on demand."""

from __future__ import annotations


class RebalanceTrigger:
    """``due(step)`` is True every ``step_interval`` completed steps (0 = never by count) or once after
    :meth:`request`. :meth:`fired` re-arms it. Under EP every rank must evaluate it at the same step."""

    def __init__(self, step_interval: int, min_steps: int = 1) -> None:
        if step_interval < 0:
            raise ValueError(f"step_interval must be >= 0, got {step_interval}")
        self.step_interval, self.min_steps = step_interval, max(1, min_steps)
        self._requested = False
        self._last = 0

    def request(self) -> None:
        """Ask for a rebalance at the next :meth:`due` check (e.g. an operator command)."""
        self._requested = True

    def due(self, step: int) -> bool:
        if step - self._last < self.min_steps:
            return False
        return self._requested or (self.step_interval > 0 and step - self._last >= self.step_interval)

    def fired(self, step: int) -> None:
        self._requested = False
        self._last = step
