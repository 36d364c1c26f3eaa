"""The EPLB applier of the rank hooks (core/parallel/rebalance.py), in one process: a live rebalance is planned on
a background thread while steps go on, then moves ``layers_per_step`` layers per step end in layer order;
stop-the-world moves everything at once; an invalid or failing plan is rejected and the placement in use kept.
The weights really moving between ranks, with outputs unchanged, is checked by the spawned EP and DP tests."""

import threading
from types import SimpleNamespace

import pytest
import torch

from inferhal.core.eplb.controller import EplbController, EplbLayout
from inferhal.core.eplb.placement import Placement
from inferhal.core.parallel.ep_moe import EPExperts
from inferhal.core.parallel.rebalance import Rebalancer

L, E, R = 4, 4, 6  # layers, experts, slots (2 redundant) over 2 ranks... as a world of one here


class Comm:
    layout = SimpleNamespace(world_size=1, rank=0)

    def all_reduce(self, x):
        return x

    def all_to_all(self, chunks):
        return list(chunks)


def new_plan(layer_rows=range(L)):
    """Expert 3 twice and 2 twice in the changed layers (the identity elsewhere)."""
    p2l = Placement.identity(L, E, R).phy2log.clone()
    for l in layer_rows:
        p2l[l] = torch.tensor([3, 2, 1, 0, 3, 2])
    return Placement.from_phy2log(p2l, E)


class Runner:
    """EPExperts' placement bookkeeping and its weight moves (each slot holds its expert's id as weights)."""

    def __init__(self):
        self.comm = Comm()
        self.placement = Placement.identity(L, E, R)
        self.local = [(self.placement.phy2log[l].float()[:, None, None].expand(R, 2, 1).clone(),
                       self.placement.phy2log[l].float()[:, None, None].expand(R, 1, 1).clone()) for l in range(L)]

    move_layers = EPExperts.move_layers
    rebalance = EPExperts.rebalance


def rebalancer(policy, layers_per_step=1):
    ctl = EplbController(EplbLayout(L, E, R, 1, 1, 1), window=10, step_interval=0, policy=policy)
    runner = Runner()
    return Rebalancer(ctl, runner, runner.comm, layers_per_step), ctl, runner


def policy_of(plan, gate=None):
    def policy(load, num_physical, groups, nodes, gpus):
        if gate is not None:
            assert gate.wait(10)
        return plan.phy2log, plan.log2phy, plan.logcnt
    return policy


def weights_follow_placement(runner):
    for l in range(L):
        assert torch.equal(runner.local[l][0][:, 0, 0].long(), runner.placement.phy2log[l])


def test_a_live_rebalance_is_planned_in_the_background_then_moves_one_layer_per_step():
    gate, plan = threading.Event(), new_plan((0, 2, 3))
    rb, ctl, runner = rebalancer(policy_of(plan, gate))
    ctl.trigger.request()
    assert rb(1) is None and rb.in_flight  # the plan started on its thread
    for step in (2, 3):  # steps go on while it plans: nothing moves
        assert rb(step) is None
    assert not rb.moves and torch.equal(runner.placement.phy2log, Placement.identity(L, E, R).phy2log)
    gate.set()
    rb._plan.join()
    assert rb(4) is None  # picked up: layer 0 moves (layer 1's row did not change)
    assert rb(5) is None
    done = rb(6)
    assert [(m.step, m.layers) for m in rb.moves] == [(4, (0,)), (5, (2,)), (6, (3,))]
    assert done is not None and (done.started, done.step) == (1, 6) and not rb.in_flight
    assert torch.equal(runner.placement.phy2log, plan.phy2log) and ctl.placement is runner.placement
    weights_follow_placement(runner)
    assert ctl.recorder.steps == 0  # restarted once the last layer moved


def test_each_step_in_between_runs_on_a_valid_mix_of_old_and_new_rows():
    plan = new_plan()
    rb, ctl, runner = rebalancer(policy_of(plan), layers_per_step=2)
    ctl.trigger.request()
    rb(1)
    rb._plan.join()
    rb(2)
    assert [m.layers for m in rb.moves] == [(0, 1)]
    assert torch.equal(runner.placement.phy2log[:2], plan.phy2log[:2])
    assert torch.equal(runner.placement.phy2log[2:], Placement.identity(L, E, R).phy2log[2:])
    ctl.holder.check(runner.placement)  # validates as a placement
    weights_follow_placement(runner)
    assert rb(3) is not None and [m.layers for m in rb.moves] == [(0, 1), (2, 3)]


def test_no_new_rebalance_starts_while_one_is_in_flight():
    gate = threading.Event()
    rb, ctl, _ = rebalancer(policy_of(new_plan(), gate))
    ctl.trigger.request()
    rb(1)
    first = rb._plan
    ctl.trigger.request()
    rb(2)
    assert rb._plan is first
    gate.set()


@pytest.mark.parametrize("bad", ["invalid", "raises"])
def test_an_invalid_or_failing_plan_is_rejected_and_the_placement_kept(bad, caplog):
    plan = new_plan()
    broken = Placement(plan.phy2log.clone(), plan.log2phy, plan.logcnt)
    broken.phy2log[1, 0] = 7  # no such expert

    def policy(*args):
        if bad == "raises":
            raise RuntimeError("policy exploded")
        return broken.phy2log, broken.log2phy, broken.logcnt

    rb, ctl, runner = rebalancer(policy)
    old, old_ctl = runner.placement, ctl.placement
    ctl.trigger.request()
    rb(1)
    rb._plan.join()
    assert rb(2) is None and rb.rejected == 1 and not rb.in_flight and not rb.moves
    assert runner.placement is old and ctl.placement is old_ctl
    assert ("policy exploded" if bad == "raises" else "plan rejected") in caplog.text + ctl.holder.last_error


def test_stop_the_world_moves_every_layer_at_the_step_it_is_due():
    plan = new_plan()
    rb, ctl, runner = rebalancer(policy_of(plan), layers_per_step=0)
    ctl.trigger.request()
    done = rb(1)
    assert done is not None and done.step == done.started == 1
    assert [m.layers for m in rb.moves] == [tuple(range(L))]
    weights_follow_placement(runner)


def test_a_negative_layers_per_step_is_named():
    from inferhal.core.errors import UserError
    from inferhal.core.parallel.ep_engine import rebalancer as make

    ctl = EplbController(EplbLayout(L, E, R, 1, 1, 1), window=10, step_interval=0, policy=policy_of(new_plan()))
    with pytest.raises(UserError, match="eplb.layers_per_step=-1 must be >= 0"):
        make(ctl, Runner(), Comm(), SimpleNamespace(layers_per_step=-1))
