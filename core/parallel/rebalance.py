"""EPLB between engine steps, for the EP and DP/EP rank hooks: stop-the-world or live.

Both modes start the same way: the controller's trigger fires at the end of a step (every rank at the same
step) and the window's load is all-reduced. Then (``eplb.layers_per_step``):

- ``0``, **stop the world**: the policy runs inline, the plan is validated and every MoE layer's expert
  weights move before the next step starts. That step waits for the whole model's transfer.
- ``n >= 1``, **live**: the policy runs on a background thread while decode steps go on. At each later step
  end the ranks all-reduce one flag (has my plan finished?) so all of them pick the plan up at the same step;
  it is validated (an invalid plan is logged, rejected and the placement in use kept), and then ``n`` MoE
  layers move per step end, in layer order, skipping layers whose row did not change. Between those steps
  the placement in use is a mix (moved layers on the new rows, the rest on the old ones): every row is a
  placement of its own layer, so each token still reaches a replica of each of its experts and the outputs
  do not change. No step waits for more than ``n`` layers' transfers. The rebalance is recorded when its
  last layer has moved; the recorder and the trigger restart there, and no new rebalance is planned while
  one is in flight.

:attr:`Rebalancer.moves` logs, per step end that moved weights, the layers and the seconds spent: what a
step waited for (``inferhal bench ep`` compares it with a normal step).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from inferhal.core.eplb.controller import EplbController
from inferhal.core.eplb.placement import Placement
from inferhal.core.eplb.validate import PlacementError
from inferhal.core.parallel.sync import collective

log = logging.getLogger("inferhal.eplb")


@dataclass
class Rebalance:
    """One applied rebalance on this rank: the engine step it completed at, the old and new placements, how
    many expert slots this rank received from other ranks, and (live) the step its plan was started at."""

    step: int
    old: Placement
    new: Placement
    received: int
    started: int = 0


@dataclass
class LayerMove:
    """Weights moved at one step end: the MoE layers and the wall seconds the step waited for them."""

    step: int
    layers: tuple[int, ...]
    seconds: float


class _Plan(threading.Thread):
    """The policy on a background thread (daemon: a plan in flight never holds the process at exit)."""

    def __init__(self, controller: EplbController, load: torch.Tensor) -> None:
        super().__init__(name="inferhal-eplb-plan", daemon=True)
        self.controller, self.load = controller, load
        self.result: Optional[Placement] = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.result = self.controller.plan_from(self.load)
        except BaseException as exc:  # reported at pick-up, on the engine's thread
            self.error = exc


@dataclass
class Rebalancer:
    """The EPLB part of a rank's step hook (see the module docstring). ``runner``: the rank's
    :class:`~.ep_moe.EPExperts` (or DPExperts); ``comm``: its communicator."""

    controller: EplbController
    runner: Any
    comm: Any
    layers_per_step: int = 1
    rebalances: list[Rebalance] = field(default_factory=list)
    moves: list[LayerMove] = field(default_factory=list)
    rejected: int = 0  # plans that failed validation (the placement in use was kept)
    _plan: Optional[_Plan] = None
    _started: int = 0
    _old: Optional[Placement] = None
    _target: Optional[Placement] = None
    _todo: list[int] = field(default_factory=list)
    _received: int = 0

    def __post_init__(self) -> None:
        if self.layers_per_step < 0:
            raise ValueError(f"layers_per_step must be >= 0, got {self.layers_per_step}")

    @property
    def in_flight(self) -> bool:
        """A plan is being computed or its layers are moving."""
        return self._plan is not None or self._target is not None

    def __call__(self, step: int) -> Optional[Rebalance]:
        """End engine step ``step`` (collective when a rebalance is due, pending or moving). Returns the
        rebalance completed at this step, if any."""
        ctl = self.controller
        if self.layers_per_step == 0:
            res = ctl.step(self.comm)
            if res is None:
                return None
            t0 = time.perf_counter()
            received = self.runner.rebalance(res[1])
            self.moves.append(LayerMove(step, tuple(range(res[1].num_layers)), time.perf_counter() - t0))
            return self._done(Rebalance(step, res[0], res[1], received, step))
        if self._target is not None:
            ctl.recorder.step()
            return self._move(step)
        if self._plan is not None:
            ctl.recorder.step()
            mine = torch.tensor([int(not self._plan.is_alive())], dtype=torch.long)
            ready = int(collective(self.comm, f"the EPLB plan check of step {step}", self.comm.all_reduce, mine))
            if ready < int(self.comm.layout.world_size):
                return None
            return self._pick_up(step)
        if ctl.due():
            self._started = step
            self._plan = _Plan(ctl, ctl.window_logical_load(self.comm))
            self._plan.start()
        return None

    def _pick_up(self, step: int) -> Optional[Rebalance]:
        plan, self._plan = self._plan, None
        plan.join()
        ctl = self.controller
        try:
            if plan.error is not None:
                raise PlacementError(f"the policy failed: {plan.error!r}")
            ctl.holder.check(plan.result)
        except PlacementError as exc:
            self.rejected += 1
            ctl.holder.last_error = str(exc)
            log.error("EPLB plan rejected, keeping the current placement: %s", exc)
            return None
        old, new = ctl.placement, plan.result
        self._old, self._target, self._received = old, new, 0
        self._todo = [l for l in range(new.num_layers) if not torch.equal(old.phy2log[l], new.phy2log[l])]
        return self._move(step)

    def _move(self, step: int) -> Optional[Rebalance]:
        layers, self._todo = self._todo[: self.layers_per_step], self._todo[self.layers_per_step:]
        if layers:
            t0 = time.perf_counter()
            self._received += self.runner.move_layers(self._target, layers)
            self.moves.append(LayerMove(step, tuple(layers), time.perf_counter() - t0))
            if not self.controller.holder.propose(self.runner.placement):  # every row is its layer's own plan
                raise RuntimeError(f"EPLB: the placement after moving layers {layers} failed validation: "
                                   f"{self.controller.holder.last_error}")
        if self._todo:
            return None
        old, new = self._old, self._target
        self._old = self._target = None
        self.runner.placement = new  # the same rows (log2phy possibly narrower than the mix's)
        self.controller.holder.current = new
        return self._done(Rebalance(step, old, new, self._received, self._started))

    def _done(self, rb: Rebalance) -> Rebalance:
        if self.layers_per_step:
            self.controller.restart()
        self.rebalances.append(rb)
        return rb
