"""The EPLB loop of one rank: record -> (trigger) -> policy -> validate -> hand the new plan to the applier.

Every EP rank runs the same controller at the same steps: the window load is all-reduced, the policy is
deterministic, so all ranks compute the same plan without another exchange. A plan that fails
validation is rejected, logged and kept out; the placement in use stays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from inferhal.core.eplb.placement import Placement
from inferhal.core.eplb.recorder import LoadRecorder, logical_load
from inferhal.core.eplb.trigger import RebalanceTrigger
from inferhal.core.eplb.validate import PlacementError, validate_placement

log = logging.getLogger("inferhal.eplb")

Policy = Callable[[torch.Tensor, int, int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EplbLayout:
    """Sizes the policy needs, resolved from the model and the ``eplb`` / ``parallel`` configs."""

    num_layers: int
    num_logical: int
    num_physical: int
    num_groups: int
    num_nodes: int
    num_gpus: int  # EP ranks

    @property
    def hierarchical(self) -> bool:
        return self.num_groups % self.num_nodes == 0 and self.num_nodes > 1


class PlacementHolder:
    """The placement in use; :meth:`propose` installs a new one only if it validates."""

    def __init__(self, layout: EplbLayout, initial: Optional[Placement] = None) -> None:
        self.layout = layout
        self.current = initial or Placement.identity(layout.num_layers, layout.num_logical, layout.num_physical)
        self.check(self.current)
        self.last_error: str = ""

    def check(self, plan: Placement) -> None:
        lay = self.layout
        if plan.phy2log.shape != (lay.num_layers, lay.num_physical):
            raise PlacementError(f"plan has phy2log {tuple(plan.phy2log.shape)}, expected "
                                 f"[{lay.num_layers}, {lay.num_physical}]")
        validate_placement(plan.phy2log, plan.log2phy, plan.logcnt, num_logical=lay.num_logical,
                           num_gpus=lay.num_gpus, num_groups=lay.num_groups, num_nodes=lay.num_nodes,
                           hierarchical=lay.hierarchical)

    def propose(self, plan: Placement) -> bool:
        """Install ``plan`` if valid and return True; otherwise keep the current one, log and return False."""
        try:
            self.check(plan)
        except PlacementError as exc:
            self.last_error = str(exc)
            log.error("EPLB plan rejected, keeping the current placement: %s", exc)
            return False
        self.current, self.last_error = plan, ""
        return True


class EplbController:
    """Owns the recorder, the trigger and the placement of one rank (all ranks in lock step)."""

    def __init__(self, layout: EplbLayout, window: int, step_interval: int, policy: Policy,
                 initial: Optional[Placement] = None) -> None:
        self.layout = layout
        self.recorder = LoadRecorder(layout.num_layers, layout.num_physical, window)
        self.trigger = RebalanceTrigger(step_interval)
        self.holder = PlacementHolder(layout, initial)
        self.policy = policy

    @property
    def placement(self) -> Placement:
        return self.holder.current

    def plan(self, comm=None) -> Placement:
        """Run the policy on the (all-reduced) window load; the plan is not yet validated."""
        return self.plan_from(self.window_logical_load(comm))

    def window_logical_load(self, comm=None) -> torch.Tensor:
        """The window's load per logical expert ``[L, E]``, all-reduced over the ranks (collective)."""
        phys = self.recorder.window_load(comm)
        return logical_load(phys, self.placement.phy2log, self.layout.num_logical).float()

    def plan_from(self, load: torch.Tensor) -> Placement:
        """The policy's plan for a logical load (no collective, no state: safe on a background thread)."""
        lay = self.layout
        phy2log, log2phy, logcnt = self.policy(load, lay.num_physical, lay.num_groups, lay.num_nodes, lay.num_gpus)
        return Placement(phy2log, log2phy, logcnt)

    def due(self) -> bool:
        """End one engine step in the recorder; True (and the trigger re-armed) when a rebalance is due."""
        self.recorder.step()
        steps = self.recorder.steps
        if not self.trigger.due(steps):
            return False
        self.trigger.fired(steps)
        return True

    def restart(self) -> None:
        """A new placement is in use: the recorder restarts (physical ids change meaning), and so does the
        trigger's interval."""
        self.recorder.reset()
        self.trigger.fired(self.recorder.steps)

    def step(self, comm=None) -> Optional[tuple[Placement, Placement]]:
        """End one engine step. When a rebalance is due and its plan validates, return ``(old, new)`` for
        the applier to move weights (the recorder restarts: physical ids change meaning); else None."""
        if not self.due():
            return None
        old = self.placement
        if not self.holder.propose(self.plan(comm)):
            return None
        self.restart()
        return old, self.placement
