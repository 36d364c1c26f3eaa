"""Communication on torch.distributed with gloo (CPU): TP all-reduce, EP all-to-all, all-gather."""

from __future__ import annotations

import datetime
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from inferhal.core.backend import ParallelLayout
from inferhal.core.errors import UserError


class SingleProcessCommunicator:
    """world_size == 1: every collective is the identity."""

    def __init__(self, layout: ParallelLayout) -> None:
        self.layout = layout

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x]

    def all_to_all(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [c for c in chunks]

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None


class TorchDistCommunicator:
    """A process group over ``backend`` (gloo here; NCCL/HCCL in the device backends).

    Collectives have a timeout, so a rank that diverges (e.g. runs a different number of steps) is
    reported as an error instead of hanging forever. :meth:`run_async` runs collectives on one
    communication thread, in submission order (two-batch overlap, core/parallel/tbo.py).
    """

    def __init__(self, layout: ParallelLayout, backend: str = "gloo", timeout_s: float | None = None) -> None:
        self.backend = backend
        self._thread: ThreadPoolExecutor | None = None
        self._join(layout, timeout_s)

    def _join(self, layout: ParallelLayout, timeout_s: float | None) -> None:
        self.layout = layout
        backend = self.backend
        timeout_s = float(layout.timeout_s if timeout_s is None else timeout_s)
        self.timeout_s = timeout_s
        if not dist.is_initialized():
            where = f"tcp://{layout.master_addr}:{layout.master_port}"
            try:
                dist.init_process_group(backend, init_method=where, world_size=layout.world_size, rank=layout.rank,
                                        timeout=datetime.timedelta(seconds=timeout_s))
            except (RuntimeError, ValueError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UserError(
                    f"rank {layout.rank} of {layout.world_size}: the {backend} process group at {where} did not "
                    f"form within parallel.timeout_s={timeout_s:g} s: a rank never joined (not started, died "
                    f"before joining, or pointed at another master address/port) ({type(exc).__name__}: "
                    f"{first})") from None
        self.group = dist.group.WORLD

    def reform(self, layout: ParallelLayout) -> None:
        """Leave this process group and join a new one of ``layout`` (fewer ranks, renumbered, at a new
        address): the survivors of a rank's death go on without it (core/parallel/elastic.py). gloo cannot
        shrink a group (its backend says ``supports_shrinking`` False in torch 2.13), so every survivor destroys
        its group, whose dead peer may make that raise, and forms the new one."""
        if getattr(self, "_thread", None) is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:  # a peer is gone: nothing of the old group is used again
                pass
        self._join(layout, None)

    def run_async(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on this communicator's communication thread (started on first use), after every
        job submitted before it; the caller waits on the returned future before its next collective on
        another thread. gloo's collectives release the GIL, so the caller computes meanwhile."""
        if getattr(self, "_thread", None) is None:  # (a subclass may not call this __init__)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="inferhal-comm")
        return self._thread.submit(fn, *args)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(self.layout.world_size)]
        dist.all_gather(out, x.contiguous(), group=self.group)
        return out

    def all_to_all(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Variable-size all-to-all along dim 0 (sizes exchanged first); gloo has no all_to_all, so this
        uses batched isend/irecv."""
        n = self.layout.world_size
        if len(chunks) != n:
            raise ValueError(f"all_to_all needs {n} chunks, got {len(chunks)}")
        sizes = torch.tensor([c.shape[0] for c in chunks], dtype=torch.long)
        recv_sizes = [torch.empty_like(sizes) for _ in range(n)]
        dist.all_gather(recv_sizes, sizes, group=self.group)
        me = self.layout.rank
        tail = chunks[0].shape[1:]
        dtype = chunks[0].dtype
        recv = [torch.empty((int(recv_sizes[r][me]), *tail), dtype=dtype) for r in range(n)]
        ops = []
        for r in range(n):
            if r == me:
                recv[r] = chunks[r].clone()
                continue
            ops.append(dist.P2POp(dist.isend, chunks[r].contiguous(), r, group=self.group))
            ops.append(dist.P2POp(dist.irecv, recv[r], r, group=self.group))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return recv

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if dist.is_initialized():
            dist.destroy_process_group()


def make_communicator(layout: ParallelLayout, backend: str = "gloo"):
    if layout.world_size == 1:
        return SingleProcessCommunicator(layout)
    return TorchDistCommunicator(layout, backend=backend)
