"""Running the model runner's steps: inline (synchronous scheduling) or on one worker thread
(``scheduler.async_scheduling``), where the host schedules and prepares step N+1 while step N runs and
folds step N's sampled tokens in one step late, as vLLM does.

Steps execute strictly in submission order on one thread, so a step's KV writes land before any later
step reads them, whatever the host changed in between (blocks freed, preempted or reallocated); each
submitted step carries its own copies of block tables and of the requests it reads.

Either way the executor measures the device's busy time and the gaps between consecutive steps: the
host time between steps that the device waits out (all of the host's update and schedule in
synchronous mode, only what async does not hide otherwise).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

from inferhal.core.scheduler.output import SchedulerOutput


class StepExecutor:
    def __init__(self, runner: Any, asynchronous: bool = False) -> None:
        self.runner = runner
        self.asynchronous = asynchronous
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inferhal-step") if asynchronous else None
        self._queue: deque[tuple[SchedulerOutput, Future]] = deque()
        self.reset()

    def reset(self) -> None:
        """Zero the timing (e.g. after a warm-up)."""
        self.busy_s = 0.0  # device time in steps
        self.gap_s = 0.0  # device time idle between consecutive steps
        self.num_steps = 0
        self._last_end: float | None = None

    def _execute(self, out: SchedulerOutput, requests: Mapping[str, Any], **extra: Any) -> Any:
        t0 = time.perf_counter()
        if self._last_end is not None:
            self.gap_s += t0 - self._last_end
        try:
            return self.runner.execute(out, requests, **extra)
        finally:
            self._last_end = time.perf_counter()
            self.busy_s += self._last_end - t0
            self.num_steps += 1

    def run(self, out: SchedulerOutput, requests: Mapping[str, Any]) -> Any:
        """Execute ``out`` now, on this thread (synchronous scheduling)."""
        return self._execute(out, requests)

    def submit(self, out: SchedulerOutput, requests: Mapping[str, Any], **extra: Any) -> None:
        """Queue ``out`` behind the steps in flight (``requests``: the ones it reads; ``extra``: passed on to
        the runner's ``execute``)."""
        self._queue.append((out, self._pool.submit(self._execute, out, requests, **extra)))

    @property
    def in_flight(self) -> int:
        return len(self._queue)

    def pending_ids(self) -> set[str]:
        """The request ids of the steps in flight."""
        return {s.request_id for out, _ in self._queue for s in out.seqs}

    def result(self) -> tuple[SchedulerOutput, Any]:
        """Wait for the oldest step in flight: ``(its SchedulerOutput, its StepResult)``."""
        out, fut = self._queue.popleft()
        return out, fut.result()

    def idle(self) -> None:
        """The pipeline ran dry (no request left): the next gap is the caller's, not the host's."""
        self._last_end = None
