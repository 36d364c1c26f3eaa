"""Elastic EP: the survivors of a DP/EP rank's death go on without it when its experts are covered.

When a rank of a DP attention × EP MoE group dies, the step in flight fails on every other rank (at its next
collective). If the placement in use has a replica of every expert of every MoE layer outside the dead rank
(:func:`~inferhal.core.eplb.survive.covered`; ``eplb.survive_rank_loss`` makes every plan so), the survivors
need none of its weights, and :func:`shrink` turns each of them into a rank of a group without it:

1. the placement without the dead rank's slots is computed first (:func:`~inferhal.core.eplb.survive.without_ranks`);
   a loss that is not covered raises :class:`~inferhal.core.eplb.validate.PlacementError` before anything
   changes, so the caller can fall back to restarting the whole group;
2. every request on the rank is dropped: the dead rank's KV is gone and the failed step is torn on every rank
   (some ranks may have finished parts of it), so the caller places every open request again from its prompt
   and the tokens already sent. The prefix cache is reset too: the torn step may have registered blocks whose
   KV it never wrote;
3. the communicator re-forms (``comm.reform``: gloo cannot shrink a group, so each survivor leaves the old one
   and joins a new one of ``n - 1`` ranks, renumbered in their old order, at a new port the caller chose);
4. the routed experts go on with the survivors' slots (:meth:`~.ep_moe.EPExperts.shrink`: each rank keeps its
   own slots' weights, renumbered; routing then reaches only surviving replicas), EPLB gets a controller of the
   new layout (``survive_rank_loss`` plans again while the slots left allow it: ``R' >= 2E`` on two ranks or
   more), and the step counters start again from 0 on every survivor.

A second death is handled the same way when the placement then in use covers it; the caller restarts the
whole group otherwise.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Sequence

from inferhal.core.backend import ParallelLayout
from inferhal.core.eplb.controller import EplbController, EplbLayout
from inferhal.core.eplb.survive import survivable, without_ranks
from inferhal.core.errors import UserError
from inferhal.core.parallel.rebalance import Rebalancer


def survivor_layout(old: ParallelLayout, lost: Sequence[int], master_addr: str, master_port: int) -> ParallelLayout:
    """This survivor's place in the group without ``lost``: ranks renumbered ``0 .. n - 1 - len(lost)`` in
    their old order, at ``master_addr:master_port``."""
    gone = sorted(set(int(r) for r in lost))
    if old.rank in gone:
        raise ValueError(f"rank {old.rank} is among the lost ranks {gone}")
    world = old.world_size - len(gone)
    return dataclasses.replace(old, world_size=world, rank=old.rank - sum(1 for r in gone if r < old.rank),
                               ep=world, dp=world, master_addr=str(master_addr), master_port=int(master_port))


def placement_digest(placement: Any) -> int:
    """A checksum of a placement's ``phy2log`` (the survivors compare theirs: they must hold the same plan)."""
    return zlib.crc32(placement.phy2log.numpy().tobytes())


def drop_requests(dpe: Any) -> int:
    """Abort every request of this rank's :class:`~.dp_engine.DPEngine` (queued, placed or never placed),
    free their KV and reset the prefix cache. Returns how many requests the engine held."""
    eng = dpe.engine
    held = list(eng.scheduler.requests)
    eng.abort(held)
    for req in dpe.pending:  # handed to the rank, not placed: made (and tracked) only
        eng.discard(req.request_id)
    dpe.pending, dpe.owner = [], {}
    eng.kv_manager.reset_prefix_cache()
    return len(held)


def _controller(old: EplbController, num_physical: int, ep: int) -> EplbController:
    """``old``'s EPLB settings over the survivors' layout, starting from the shrunk placement."""
    lay = dataclasses.replace(old.layout, num_physical=num_physical, num_gpus=ep)
    base = getattr(old.policy, "base", old.policy)
    policy = survivable(base) if getattr(old.policy, "base", None) is not None and ep >= 2 and \
        num_physical >= 2 * lay.num_logical else base
    return EplbController(lay, old.recorder.window, old.trigger.step_interval, policy)


def shrink(dpe: Any, lost: Sequence[int], layout: ParallelLayout) -> dict:
    """Make this DP/EP rank (``dpe``: its :class:`~.dp_engine.DPEngine`) a rank of the group without ``lost``
    (old rank numbers), ``layout`` being its place there (:func:`survivor_layout`); collective over the
    survivors. Raises :class:`~inferhal.core.eplb.validate.PlacementError` (nothing changed) when the loss is
    not covered, :class:`UserError` when the communicator cannot re-form. → ``{"dropped": requests dropped,
    "placement": digest of the new placement, "rank": new rank, "world_size": new size}``."""
    hook, comm = dpe.rank, dpe.comm
    runner = hook.runner
    n, me = int(comm.layout.world_size), int(comm.layout.rank)
    placement = without_ranks(runner.placement, n, lost)
    if not hasattr(comm, "reform"):
        raise UserError(f"the backend's communicator ({type(comm).__name__}) cannot re-form a group without a lost "
                        f"rank (no reform method)")
    mine = runner.placement.phy2log[:, list(runner.placement.local_slots(me, n))]
    dropped = drop_requests(dpe)
    comm.reform(layout)
    runner.shrink(placement)
    now = placement.phy2log[:, list(placement.local_slots(comm.layout.rank, comm.layout.world_size))]
    if not bool((mine == now).all()):  # by construction (without_ranks keeps the survivors' slots in order)
        raise RuntimeError(f"rank {me}: its slots changed experts in the survivors' placement")
    ctl = hook.controller
    if ctl is not None:
        ctl = _controller(ctl, placement.num_physical, int(comm.layout.world_size))
        ctl.holder.current = placement
        ctl.holder.check(placement)
        runner.recorder = ctl.recorder
        old = hook.rebalancer
        hook.controller = ctl
        hook.rebalancer = Rebalancer(ctl, runner, comm, old.layers_per_step if old is not None else 1)
    hook.step, hook.busy = 0, False
    if hasattr(dpe, "sessions"):  # session -> rank: the ranks are renumbered and every prefix cache is empty
        dpe.sessions = type(dpe.sessions)(dpe.sessions.size)
    return {"dropped": dropped, "placement": placement_digest(placement), "rank": int(comm.layout.rank),
            "world_size": int(comm.layout.world_size)}
