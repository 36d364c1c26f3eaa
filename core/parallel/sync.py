"""Keeping EP ranks in lock step: a rank that diverges in step count is reported, never left hanging.

Every rank calls :meth:`StepSync.check` once per engine step with its own counter. One small all-gather
compares the counters; a mismatch raises :class:`RankDivergenceError` on every rank, naming each rank's
step. A rank that stopped calling (crashed, finished early, stuck) makes the others' all-gather fail at
the communicator's timeout (or at once, when its connection closes), which is raised the same way.
"""

from __future__ import annotations

import torch


class RankDivergenceError(RuntimeError):
    """EP ranks are not at the same step (or one stopped answering)."""


class StepSync:
    def __init__(self, comm) -> None:
        self.comm = comm

    def check(self, step: int, done: bool = False) -> bool:
        """Compare ``step`` across ranks; return True when every rank says ``done``."""
        n = self.comm.layout.world_size
        if n == 1:
            return done
        mine = torch.tensor([step, int(done)], dtype=torch.long)
        try:
            got = self.comm.all_gather(mine)
        except RuntimeError as exc:
            raise RankDivergenceError(
                f"rank {self.comm.layout.rank} at step {step}: another EP rank did not reach this step "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc})") from exc
        steps = [int(g[0]) for g in got]
        if len(set(steps)) > 1:
            detail = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
            raise RankDivergenceError(f"EP ranks diverged in step count ({detail})")
        return all(int(g[1]) for g in got)


def collective(comm, where: str, fn, *args):
    """``fn(*args)``, a collective on ``comm``: a ``RuntimeError`` from it (a peer that exited, or stayed
    silent past the communicator's timeout) becomes a :class:`RankDivergenceError` naming this rank and
    ``where``."""
    try:
        return fn(*args)
    except RankDivergenceError:
        raise
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise RankDivergenceError(f"rank {comm.layout.rank} at {where}: another rank did not answer "
                                  f"({type(exc).__name__}: {first})") from exc


def gather_objects(comm, obj, where: str = "an exchange of results") -> list:
    """Every rank's picklable ``obj``, in rank order, on every rank (two all-gathers: sizes, then the
    padded bytes); ``[obj]`` with one rank."""
    import pickle

    n = comm.layout.world_size
    if n == 1:
        return [obj]
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [int(s) for s in collective(comm, where, comm.all_gather, torch.tensor([data.numel()], dtype=torch.long))]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: data.numel()] = data
    return [pickle.loads(b[:s].numpy().tobytes()) for b, s in zip(collective(comm, where, comm.all_gather, buf), sizes)]
