"""The objects backends construct through the hooks of :mod:`inferhal.core.hookspecs`.

Protocols say what core needs from a backend; the dataclasses are the plain data that travels into
the hooks. Nothing here names a device.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch


# --------------------------------------------------------------------------------------------------
# Device: streams, events, synchronisation
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class Device(Protocol):
    """The runtime device. The only way core touches streams and events."""

    torch_device: torch.device

    def synchronize(self) -> None: ...

    def stream(self) -> AbstractContextManager[Any]:
        """A context manager that runs enclosed work on a side stream (a no-op where there is none)."""

    def event(self) -> Any:
        """An event object with ``record()`` and ``synchronize()``."""

    def memory_stats(self) -> dict[str, int]:
        """At least ``{"total": bytes, "free": bytes}``; the KV planner sizes the pool from it."""

    # Optional (the device run, :mod:`inferhal.core.qualify.device_run`, reports "not checked" without them):
    #
    # def forbid_host_sync(self) -> AbstractContextManager[Any]:
    #     """Within it, a call that makes the host wait for the device raises (what a graph capture cannot hold)."""
    #
    # def describe(self) -> str:
    #     """One line about the device for a report: driver, clocks, power limit."""
    #
    # ``event()`` objects that also have ``elapsed_time(other) -> ms`` time the device run's benchmarks on the
    # device; without it they are timed with the host clock around ``synchronize()``.


# --------------------------------------------------------------------------------------------------
# KV storage
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVGroupLayout:
    """One layer group of the paged KV pool.

    ``slots_per_block`` is ``block_size // tokens_per_slot`` (a CSA group with ratio 4 and 256-token
    blocks has 64 slots per block); ``slot_shape`` is the shape of one slot's entry in one layer
    (e.g. ``(2, num_kv_heads, head_dim)`` for K and V, ``(512,)`` for a latent KV entry).
    """

    name: str
    layers: tuple[int, ...]
    slots_per_block: int
    slot_shape: tuple[int, ...]
    dtype: torch.dtype
    num_blocks: int = 0  # blocks of this group's own pool (0: the request's num_blocks)

    @property
    def slot_bytes(self) -> int:
        n = 1
        for d in self.slot_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class KVStorageRequest:
    """Storage for every group's pool. Each group has its own block ids ``0 .. blocks_of(g) - 1`` and its
    own pages (``slots_per_block * slot_bytes`` per layer): nothing is padded to another group's page.
    ``num_blocks`` is the largest group's count (a storage that sized every group by it stays correct)."""

    num_blocks: int
    block_size: int
    groups: tuple[KVGroupLayout, ...]

    def blocks_of(self, group: KVGroupLayout) -> int:
        return group.num_blocks or self.num_blocks


@runtime_checkable
class KVStorage(Protocol):
    """Backing memory of the block pool, per layer group and layer."""

    request: KVStorageRequest

    def layer_cache(self, group: str, layer: int) -> torch.Tensor:
        """``[blocks_of(group), slots_per_block, *slot_shape]`` tensor of that layer in that group."""

    def nbytes(self) -> int: ...


# --------------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in the parallel layout (``parallel`` config group, resolved)."""

    world_size: int = 1
    rank: int = 0
    tp: int = 1
    ep: int = 1
    dp: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 120.0  # joining the group and each collective: a rank that never comes is an error then
    # this rank's place on its host, which picks its device (:meth:`on_host`): torchrun's LOCAL_RANK and
    # LOCAL_WORLD_SIZE, or the local launcher's own (every rank on this host); None = not told: every rank here
    local_rank: int | None = None
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.local_rank is not None and not 0 <= self.local_rank < (self.local_world_size or self.local_rank + 1):
            raise ValueError(f"local_rank {self.local_rank} is outside local_world_size {self.local_world_size}")

    def on_host(self) -> tuple[int, int]:
        """(this rank's index among the ranks on its host, how many ranks that host runs). A rank keeps its
        place when survivors are renumbered (its device does not change)."""
        if self.local_rank is None:
            return self.rank, self.world_size
        return self.local_rank, self.local_world_size or self.world_size


@runtime_checkable
class Communicator(Protocol):
    """Collectives over a torch.distributed process group (identities when ``world_size == 1``)."""

    layout: ParallelLayout

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]: ...

    def all_to_all(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``chunks[r]`` to rank ``r``; return what each rank sent here, in rank order."""

    def barrier(self) -> None: ...

    def close(self) -> None: ...

    # Optional (two-batch overlap, :mod:`inferhal.core.parallel.tbo`; without it ``tbo.submit`` runs the
    # collectives at once, on the caller's thread):
    #
    # def run_async(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    #     """Run ``fn(*args)``, collectives on this communicator, on the communicator's own thread (or
    #     stream), strictly after every job submitted before it, and return a future of its result. Every
    #     rank submits the same collectives in the same order; the caller waits for them before it issues
    #     a collective itself. The caller's thread computes meanwhile: that is the overlap."""
    #
    # Optional (elastic EP, :mod:`inferhal.core.parallel.elastic`; without it a rank's death restarts the group):
    #
    # def reform(self, layout: ParallelLayout) -> None:
    #     """Leave this group (one of its ranks died: its collectives fail) and join the group of ``layout``:
    #     the survivors, renumbered ``0 .. n-2`` in their old order, at a new master address/port. Every
    #     survivor calls it with its own new rank; ``self.layout`` is ``layout`` afterwards."""


# --------------------------------------------------------------------------------------------------
# Graphs
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class GraphRunner(Protocol):
    """Captures a callable for a fixed input signature and replays it."""

    def capture(self, fn: Callable[..., Any], *example_args: Any) -> Callable[..., Any]: ...
