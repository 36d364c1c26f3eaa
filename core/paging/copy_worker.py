"""The thread that copies KV blocks down to the lower tiers, off the step's critical path (:mod:`.offload`).

One worker thread runs the jobs handed to :meth:`CopyWorker.submit` in order (first in, first out), as vLLM's
offloading connector hands stores to its transfer handler and SGLang's HiCache its write-backs to a thread of their
own: torch's copies release the GIL, so the step thread goes on with the forward while a job gathers blocks into
host memory and writes the disk tier's files. The thread starts with a job and ends after ``idle_s`` seconds
without one (an engine that is dropped leaves no thread behind; the next job starts another).

A job that raises is reported (one warning per kind of error) and counted; the worker goes on with the next job,
and the job's ``on_error`` still runs, so whoever waits for it is released. :meth:`CopyWorker.close` drains (every
job submitted runs) or cancels (jobs not started are dropped, their ``on_error`` runs) and joins the thread; a
process that exits without closing drains at exit (``atexit``), so the disk tier keeps the blocks it was handed.

``inline=True`` runs each job on the caller's thread at :meth:`~CopyWorker.submit`: the copies of a synchronous
tier (``KVOffload(asynchronous=False)``), which the measurement in ``core/bench/kv_tiers_copies.py`` compares with.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)


class Job:
    __slots__ = ("fn", "args", "on_error", "done")

    def __init__(self, fn: Callable[..., Any], args: tuple, on_error: Optional[Callable[[BaseException], Any]]):
        self.fn, self.args, self.on_error = fn, args, on_error
        self.done = threading.Event()


def _drain_at_exit(ref: "weakref.ref[CopyWorker]") -> None:
    worker = ref()
    if worker is not None:
        worker.close()


class CopyWorker:
    def __init__(self, name: str = "inferhal-kv-copy", inline: bool = False, idle_s: float = 5.0) -> None:
        self.name, self.inline, self.idle_s = name, inline, idle_s
        self._at_exit = False
        self._jobs: collections.deque[Optional[Job]] = collections.deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.busy_s = 0.0  # seconds the worker spent in jobs
        self.jobs_run = self.errors = 0
        self._warned: set[str] = set()

    def submit(self, fn: Callable[..., Any], *args: Any,
               on_error: Optional[Callable[[BaseException], Any]] = None) -> Job:
        """Run ``fn(*args)`` on the worker after every job submitted before; ``on_error(exc)`` if it raises."""
        job = Job(fn, args, on_error)
        if self.inline or self._closed:
            self._run(job)
            return job
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
                if not self._at_exit:
                    self._at_exit = True
                    atexit.register(_drain_at_exit, weakref.ref(self))
            self._jobs.append(job)
            self._cv.notify()
        return job

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return len(self._jobs)

    def _run(self, job: Job) -> None:
        t0 = time.perf_counter()
        try:
            job.fn(*job.args)
        except Exception as e:  # the worker outlives a bad job: its blocks are simply not in the tier
            self.errors += 1
            kind = type(e).__name__
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("KV tier copy failed (%s: %s); its blocks are not kept in the tiers (a later hit on them "
                            "recomputes)", kind, e)
            if job.on_error is not None:
                job.on_error(e)
        finally:
            self.busy_s += time.perf_counter() - t0
            self.jobs_run += 1
            job.done.set()

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._jobs:
                    self._cv.wait(self.idle_s)
                    if not self._jobs:  # idle: the thread ends, the next submit starts another
                        self._thread = None
                        return
                job = self._jobs[0]
            if job is None:
                with self._cv:
                    self._jobs.popleft()
                    self._thread = None
                    self._cv.notify_all()
                return
            self._run(job)
            with self._cv:
                self._jobs.popleft()
                self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every job submitted so far has finished."""
        with self._cv:
            while self._jobs and self._thread is not None:
                self._cv.wait()

    def close(self, drain: bool = True) -> None:
        """Stop the worker: with ``drain`` after every submitted job, else after the running one (the others are
        dropped, their ``on_error`` runs with a CancelledError). Later jobs run inline."""
        dropped: list[Job] = []
        with self._cv:
            if self._closed:
                return
            self._closed = True
            if not drain:
                while len(self._jobs) > 1:
                    job = self._jobs.pop()
                    if job is not None:
                        dropped.append(job)
            thread = self._thread
            if thread is not None:
                self._jobs.append(None)
                self._cv.notify()
        for job in reversed(dropped):
            if job.on_error is not None:
                job.on_error(CancelledError("the copy worker was closed"))
            job.done.set()
        if thread is not None:
            thread.join(timeout=60)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class CancelledError(RuntimeError):
    """A copy dropped by :meth:`CopyWorker.close` (``drain=False``) before it started."""
