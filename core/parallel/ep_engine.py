"""One engine as one EP rank: routed experts through :class:`~.ep_moe.EPExperts`, rank step-sync and EPLB
as an engine step hook.

Every rank runs the same engine on the same requests (attention and everything outside the routed
experts is replicated; :mod:`.dp_engine` is the layout where each rank attends over its own requests),
so every rank schedules the same batch
at the same step and samples the same tokens (with ``backend.graphs=true`` each replays the same bucket: no
agreement is needed, and :class:`~.ep_moe.EPExperts` pads its shard so that every rank dispatches as many
rows). After each step the hook (:class:`EPRank`)

1. checks that all ranks are at the same step (:class:`~.sync.StepSync`; a mismatch or a silent peer
   raises :class:`~.sync.RankDivergenceError` on the ranks still running, it does not hang);
2. ends the EPLB step (:class:`~.rebalance.Rebalancer`, collective when a rebalance is due: the window load
   is all-reduced): with ``eplb.layers_per_step=0`` a validated plan moves every layer's expert weights at
   once (:meth:`EPExperts.rebalance`); otherwise the plan is computed in the background and applied a few
   layers per step (:meth:`EPExperts.move_layers`).

A model supports EP when it has ``routed_expert_weights()`` (per MoE layer ``(gate_up[E, 2I, D],
down[E, D, I])``), ``use_expert_runner(runner)`` and ``experts_p``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

from inferhal.core.eplb.controller import EplbController, EplbLayout
from inferhal.core.eplb.placement import Placement
from inferhal.core.eplb.baseline import drift_of, policy_of
from inferhal.core.eplb.drift import DRIFT
from inferhal.core.eplb.survive import check_survivable, survivable
from inferhal.core.errors import UserError
from inferhal.core.parallel.dp_graphs import check_graphs
from inferhal.core.parallel.ep_moe import EPExperts
from inferhal.core.parallel.rebalance import Rebalance, Rebalancer
from inferhal.core.parallel.sync import StepSync


@dataclass
class EPRank:
    """The per-step hook of one EP rank (installed by :func:`attach_ep`)."""

    comm: Any
    runner: EPExperts
    controller: Optional[EplbController]
    sync: StepSync
    rebalancer: Optional[Rebalancer] = None
    step: int = 0

    @property
    def rebalances(self) -> list[Rebalance]:
        return self.rebalancer.rebalances if self.rebalancer is not None else []

    def __call__(self, engine: Any = None) -> None:
        self.step += 1
        self.sync.check(self.step)
        if self.rebalancer is not None:
            self.rebalancer(self.step)

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
    fn = policy_of(policy)
    if policy == "inferhal":  # the greedy baseline has no drift knob
        fn = partial(fn, drift=drift_of(getattr(eplb, "drift", DRIFT)))
    physical = num_experts + int(eplb.num_redundant_experts)
    groups = int(eplb.num_groups) or 1
    lay = EplbLayout(num_layers, num_experts, physical, groups, int(eplb.num_nodes), ep)
    if bool(getattr(eplb, "survive_rank_loss", False)):  # every plan spreads each expert over two ranks
        try:
            check_survivable(num_experts, int(eplb.num_redundant_experts), ep, int(eplb.num_nodes), True)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        fn = survivable(fn)
    return EplbController(lay, int(eplb.window_size), int(eplb.step_interval), fn)


def rebalancer(ctl: Optional[EplbController], runner: Any, comm: Any, eplb: Any) -> Optional[Rebalancer]:
    """The EPLB applier of a rank hook (None when EPLB is off); ``eplb.layers_per_step`` picks the mode."""
    if ctl is None:
        return None
    n = int(getattr(eplb, "layers_per_step", 1))
    if n < 0:
        raise UserError(f"eplb.layers_per_step={n} must be >= 0 (0: stop the world and move every layer at once; "
                        f"n: plan in the background and move n MoE layers per step)")
    return Rebalancer(ctl, runner, comm, n)


def check_expert_slots(num_experts: int, eplb: Any, ep: int) -> int:
    """Physical expert slots per MoE layer (routed experts + ``eplb.num_redundant_experts`` when EPLB is
    on); raise :class:`UserError` when they do not divide among ``ep`` ranks, or when ``eplb.survive_rank_loss``
    cannot put each of the ``num_experts`` on two ranks (:func:`~inferhal.core.eplb.survive.check_survivable`).
    Run before any rank starts where the model's config declares its routed experts (``check_ranks``), and
    again by :func:`attach_ep` from the loaded weights."""
    physical = num_experts + (int(eplb.num_redundant_experts) if bool(eplb.enabled) else 0)
    if physical % ep:
        what = "routed experts + eplb.num_redundant_experts" if bool(eplb.enabled) else "routed experts"
        raise UserError(f"{physical} physical expert slots ({what}) do not divide among parallel.ep={ep} ranks")
    if bool(getattr(eplb, "survive_rank_loss", False)):
        try:
            check_survivable(num_experts, int(eplb.num_redundant_experts), ep, int(eplb.num_nodes),
                             bool(eplb.enabled))
        except ValueError as exc:
            raise UserError(str(exc)) from None
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
    check_graphs(getattr(engine.runner, "graphs", None) is not None, bool(eplb.enabled))
    ctl = eplb_controller(eplb, num_layers, num_experts, ep)
    placement = ctl.placement if ctl is not None else Placement.identity(num_layers, num_experts)
    runner = EPExperts(engine.backend.ops, comm, placement, full, model.experts_p,
                       recorder=ctl.recorder if ctl is not None else None)
    del full
    model.use_expert_runner(runner)
    hook = EPRank(comm, runner, ctl, StepSync(comm), rebalancer(ctl, runner, comm, eplb))
    engine.step_hooks.append(hook)
    return hook
