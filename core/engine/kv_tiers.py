"""What the engine builds for its prefix cache besides the pool: window retention, the lower tiers and KV events,
from ``cache.*`` (the pieces are core/paging's: :mod:`~inferhal.core.paging.offload`,
:mod:`~inferhal.core.paging.tiers`, :mod:`~inferhal.core.paging.events`).

- ``cache.retain_windows``: each sliding group's pool keeps the last windows of that many finished requests
  behind its other free blocks (:func:`keep_blocks`; the planner reserves room for them).
- ``cache.host_tier_bytes``, ``cache.disk_tier_dir``, ``cache.disk_tier_bytes``: the tiers; each step's copies are
  handed over on the step thread before it (:class:`StepCopies`): saves to the copy worker, off the step's critical
  path (:mod:`~inferhal.core.paging.copy_worker`, :mod:`~inferhal.core.paging.pending`), loads run there; with the
  backend's copier where it provides one (``inferhal_kv_block_copier``), else plain torch.
- ``cache.kv_events_*``: a ZMQ publisher of the pool's (and the tiers') block events.

Each needs ``cache.enable_prefix_caching``: it is refused without it, naming the field.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

from inferhal.core.config.schema import CacheConfig
from inferhal.core.errors import UserError
from inferhal.core.paging import offload as offloading
from inferhal.core.paging.events import KVEventLog, ZmqEventPublisher
from inferhal.core.paging.planning import live_blocks

log = logging.getLogger(__name__)


def _needs_caching(cache: CacheConfig) -> None:
    asked = [f"cache.{k}={getattr(cache, k)!r}" for k in ("host_tier_bytes", "disk_tier_dir", "retain_windows",
                                                           "kv_events_endpoint") if getattr(cache, k)]
    if asked and not cache.enable_prefix_caching:
        raise UserError(f"{', '.join(asked)} need{'s' if len(asked) == 1 else ''} cache.enable_prefix_caching=true "
                        f"(they keep or report prefix-cache blocks)")


def keep_blocks(specs: Sequence[Any], block_size: int, cache: CacheConfig) -> dict[str, int]:
    """Sliding group → the most kept blocks its pool holds: ``cache.retain_windows`` windows."""
    n = int(cache.retain_windows)
    if n < 0:
        raise UserError(f"cache.retain_windows must be >= 0, got {n}")
    _needs_caching(cache)
    return {s.name: n * live_blocks(s, block_size) for s in specs if s.kind == "sliding" and n}


def attach(kv: Any, loaded: Any, backend: Any, storage: Any, cache: CacheConfig,
           eager: bool) -> tuple[Optional[offloading.KVOffload], Optional[ZmqEventPublisher]]:
    """Build the tiers and the KV event publisher ``cache`` asks for and attach them to ``kv``; ``eager``: no step
    is ever in flight between two steps (synchronous scheduling)."""
    _needs_caching(cache)
    if cache.kv_events_buffer_steps < 1:
        raise UserError(f"cache.kv_events_buffer_steps must be >= 1, got {cache.kv_events_buffer_steps}")
    if not cache.kv_events_endpoint and (cache.kv_events_replay_endpoint or cache.kv_events_topic):
        raise UserError("cache.kv_events_replay_endpoint and cache.kv_events_topic need cache.kv_events_endpoint "
                        "(KV events are off without it)")
    events = KVEventLog(kv.specs, kv.block_size) if cache.kv_events_endpoint else None
    copier = None
    if (cache.host_tier_bytes or cache.disk_tier_dir) and hasattr(backend, "call"):
        copier = backend.call("inferhal_kv_block_copier", storage=storage, profile=getattr(backend, "profile", None))
    if copier is None:
        copier = offloading.TorchBlockCopier(storage)
    tiers = offloading.build(kv.specs, kv.block_size, copier, int(cache.host_tier_bytes), str(cache.disk_tier_dir),
                             int(cache.disk_tier_bytes), offloading.describe(loaded, kv.specs), eager, events)
    if tiers is not None:
        log.info("KV tiers: %s (copies by %s)", ", ".join(
            f"{t.name} {t.capacity or 'unbounded'} B" for t in tiers.tiers), type(copier).__name__)
    kv.attach(tiers, events)
    publisher = None
    if events is not None:
        publisher = ZmqEventPublisher(events, cache.kv_events_endpoint, cache.kv_events_replay_endpoint,
                                      cache.kv_events_topic, cache.kv_events_buffer_steps)
    return tiers, publisher


def check_transfer(transfer: Any, tiers: Any, asynchronous: bool) -> None:
    """A decode side writes adopted blocks outside the steps' order, which asynchronous tier copies rely on."""
    if tiers is not None and asynchronous and getattr(transfer, "role", None) == "decode":
        raise UserError("cache.host_tier_bytes / cache.disk_tier_dir on a decode instance need "
                        "scheduler.async_scheduling=false (adopted blocks are written outside the steps' order)")


class StepCopies:
    """The model runner, with the tier copies queued before each step run first, on the thread that runs steps.
    Asynchronous scheduling hands each step its copies (``kv_copies``, taken when it was scheduled); a synchronous
    step takes what is queued when it runs."""

    def __init__(self, runner: Any, tiers: offloading.KVOffload) -> None:
        self.runner, self.tiers = runner, tiers

    def execute(self, out: Any, requests: Mapping[str, Any], kv_copies: Optional[list] = None, **extra: Any) -> Any:
        self.tiers.run(self.tiers.take() if kv_copies is None else kv_copies)
        return self.runner.execute(out, requests, **extra)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)
