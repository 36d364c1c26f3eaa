"""Two-batch overlap (``parallel.tbo=true``) under DP attention × EP MoE: the pieces that need no process.

A DP rank's step is split in two **micro-batches** so that one's MoE all-to-all (``moe.dispatch`` /
``moe.combine``) is in flight while the other computes (attention, norms, mHC, routing, experts):

- **The split is the scheduler's, as plain data**: :func:`split_two` maps the step's tokens per scheduled
  sequence to the number of sequences in each micro-batch (``SchedulerOutput.micro_batches``), cut at a
  sequence boundary so that the two hold as equal a share of the tokens as the boundaries allow; a step
  of fewer than two sequences runs as one batch. The runner passes it on in ``ForwardBatch.extras``.
- **The model runs the micro-batches as generators**: each yields at every MoE layer a request
  ``(layer, x, weights, logical_ids)`` and receives the routed experts' output
  (:func:`~inferhal.core.models.base.split_batch` slices the step's
  :class:`~inferhal.core.models.base.ForwardBatch` per micro-batch).
- **The expert runner interleaves them** (:func:`interleave`, round robin): it starts micro-batch A's
  dispatch on the communicator's own thread (:func:`submit`), lets B compute up to its dispatch, finishes
  A's experts while B's dispatch travels, and so on; every rank issues the collectives in the same order
  (:mod:`.dp_moe` has the protocol).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Generator, Sequence

import torch

#: a step with fewer scheduled sequences runs as one batch
MIN_SEQS = 2


def split_two(num_new: Sequence[int]) -> tuple[int, ...]:
    """Tokens per scheduled sequence (in step order) → sequences in each micro-batch ``(a, b)``, the cut
    that balances the two's tokens best (the earliest of equal ones); ``()`` below :data:`MIN_SEQS`."""
    n = len(num_new)
    if n < MIN_SEQS:
        return ()
    total, run, best, cut = sum(num_new), 0, None, 1
    for k in range(1, n):
        run += num_new[k - 1]
        gap = abs(total - 2 * run)
        if best is None or gap < best:
            best, cut = gap, k
    return (cut, n - cut)


def interleave(tasks: Sequence[Generator[Any, None, Any]]) -> list[Any]:
    """Advance each generator to its next ``yield`` in turn, round robin, until all have returned; →
    their return values. A task that raises closes the others and the error propagates."""
    out: list[Any] = [None] * len(tasks)
    live = list(range(len(tasks)))
    try:
        while live:
            for i in list(live):
                try:
                    next(tasks[i])
                except StopIteration as stop:
                    out[i] = stop.value
                    live.remove(i)
    except BaseException:
        for t in tasks:
            t.close()
        raise
    return out


def submit(comm: Any, fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` (collectives on ``comm``) on the communicator's communication thread when it has one
    (``comm.run_async``, :class:`~inferhal.core.backend.Communicator`), else at once here (a finished
    future: the sync fallback)."""
    run = getattr(comm, "run_async", None)
    if run is not None:
        return run(fn, *args)
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as exc:  # handed to whoever waits, as a thread would
        fut.set_exception(exc)
    return fut


def empty_rows(dim: int, top_k: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The ``(x[0, D], weights[0, K], ids[0, K])`` of a micro-batch with no token."""
    return (torch.zeros((0, dim), dtype=dtype, device=device), torch.zeros((0, top_k), dtype=torch.float32, device=device),
            torch.zeros((0, top_k), dtype=torch.long, device=device))
