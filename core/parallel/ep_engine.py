"""One engine as one EP rank: routed experts through :class:`~.ep_moe.EPExperts`, rank step-sync and EPLB
as an engine step hook.

Every rank runs the same engine on the same requests (attention and everything outside the routed
experts is replicated; :mod:`.dp_engine` is the layout where each rank attends over its own requests),
so every rank schedules the same batch
at the same step and samples the same tokens. After each step the hook (:class:`EPRank`)

1. checks that all ranks are at the same step (:class:`~.sync.StepSync`; a mismatch or a silent peer
   raises :class:`~.sync.RankDivergenceError` on the ranks still running, it does not hang);
2. ends the EPLB step (:meth:`EplbController.step`, collective: the window load is all-reduced) and,
   when a validated plan comes back, moves the expert weights (:meth:`EPExperts.rebalance`).

A model supports EP when it has ``routed_expert_weights()`` (per MoE layer ``(gate_up[E, 2I, D],
down[E, D, I])``), ``use_expert_runner(runner)`` and ``experts_p``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

from inferhal.core.eplb.controller import EplbController, EplbLayout
from inferhal.core.eplb.placement import Placement
from inferhal.core.eplb.baseline import POLICIES
from inferhal.core.eplb.drift import DRIFT
from inferhal.core.eplb.validate import EplbInputError, check_drift
from inferhal.core.errors import UserError
from inferhal.core.parallel.ep_moe import EPExperts
from inferhal.core.parallel.sync import StepSync


@dataclass
class Rebalance:
    """One applied rebalance on this rank: the engine step, the old and new placements, and how many
    expert slots this rank received from other ranks."""

    step: int
    old: Placement
    new: Placement
    received: int


@dataclass
class EPRank:
    """The per-step hook of one EP rank (installed by :func:`attach_ep`)."""

    comm: Any
    runner: EPExperts
    controller: Optional[EplbController]
    sync: StepSync
    step: int = 0
    rebalances: list[Rebalance] = field(default_factory=list)

    def __call__(self, engine: Any = None) -> None:
        self.step += 1
        self.sync.check(self.step)
        if self.controller is None:
            return
        res = self.controller.step(self.comm)
        if res is not None:
            received = self.runner.rebalance(res[1])
            self.rebalances.append(Rebalance(self.step, res[0], res[1], received))

    def request_rebalance(self) -> None:
        """Rebalance at the end of the next step (every rank must request it at the same step)."""
        if self.controller is None:
            raise UserError("a rebalance needs EPLB: set eplb=default (eplb.enabled=true)")
        self.controller.trigger.request()


def eplb_controller(eplb: Any, num_layers: int, num_experts: int, ep: int) -> Optional[EplbController]:
    """The EPLB controller for ``eplb`` (an :class:`EplbConfig`-like node), or None when disabled."""
    if not bool(eplb.enabled):
        return None
    policy = str(eplb.policy)
    if policy not in POLICIES:
        raise UserError(f"eplb.policy={policy!r} is unknown; choose one of {', '.join(sorted(POLICIES))}")
    fn = POLICIES[policy]
    if policy == "inferhal":
        drift = getattr(eplb, "drift", DRIFT)
        try:
            fn = partial(fn, drift=check_drift(drift))
        except EplbInputError as exc:
            raise UserError(f"eplb.drift={drift!r}: {exc}") from None
    physical = num_experts + int(eplb.num_redundant_experts)
    groups = int(eplb.num_groups) or 1
    lay = EplbLayout(num_layers, num_experts, physical, groups, int(eplb.num_nodes), ep)
    return EplbController(lay, int(eplb.window_size), int(eplb.step_interval), fn)


def check_expert_slots(num_experts: int, eplb: Any, ep: int) -> int:
    """Physical expert slots per MoE layer (routed experts + ``eplb.num_redundant_experts`` when EPLB is
    on); raise :class:`UserError` when they do not divide among ``ep`` ranks."""
    physical = num_experts + (int(eplb.num_redundant_experts) if bool(eplb.enabled) else 0)
    if physical % ep:
        what = "routed experts + eplb.num_redundant_experts" if bool(eplb.enabled) else "routed experts"
        raise UserError(f"{physical} physical expert slots ({what}) do not divide among parallel.ep={ep} ranks")
    return physical


def attach_ep(engine: Any, comm: Any, eplb: Any) -> EPRank:
    """Make ``engine`` one rank of ``comm`` (EP size = ``comm.layout.world_size``): build this rank's
    :class:`EPExperts`, hand it to the model (which drops its full routed-expert tensors) and append the
    :class:`EPRank` hook to ``engine.step_hooks``. Returns the hook (its ``rebalances`` record what moved)."""
    model = engine.model
    if not all(hasattr(model, a) for a in ("routed_expert_weights", "use_expert_runner", "experts_p")):
        raise UserError(f"model {type(model).__name__} does not support expert parallelism (parallel.ep > 1)")
    ep = int(comm.layout.world_size)
    full = model.routed_expert_weights()
    num_layers, num_experts = len(full), int(full[0][0].shape[0])
    check_expert_slots(num_experts, eplb, ep)
    ctl = eplb_controller(eplb, num_layers, num_experts, ep)
    placement = ctl.placement if ctl is not None else Placement.identity(num_layers, num_experts)
    runner = EPExperts(engine.backend.ops, comm, placement, full, model.experts_p,
                       recorder=ctl.recorder if ctl is not None else None)
    del full
    model.use_expert_runner(runner)
    hook = EPRank(comm, runner, ctl, StepSync(comm))
    engine.step_hooks.append(hook)
    return hook
