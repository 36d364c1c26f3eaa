"""eplb.survive_rank_loss's placements (core/eplb/survive.py): coverage of a lost rank, the survivors' placement,
and the spread every plan gets so any one rank's loss is covered."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferhal.core.eplb import Placement, PlacementError, rebalance_experts, validate_placement
from inferhal.core.eplb.survive import (check_survivable, covered, spread, spread_row, survivable, uncovered,
                                        without_ranks)


def brute_covered(p2l, ep, lost):
    """Every (layer, expert) has a slot on a rank outside ``lost``, by looking at each slot."""
    L, R = p2l.shape
    per = R // ep
    E = int(p2l.max()) + 1
    return all(any(int(p2l[l, p]) == e and p // per not in lost for p in range(R)) for l in range(L) for e in range(E))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_coverage_is_every_expert_on_a_surviving_rank(data):
    ep = data.draw(st.integers(2, 5))
    E = data.draw(st.integers(1, 8))
    per = data.draw(st.integers(-(-E // ep), E + 2))
    R = per * ep
    L = data.draw(st.integers(1, 3))
    rows = [data.draw(st.permutations(list(range(E)) + data.draw(st.lists(st.integers(0, E - 1), min_size=R - E,
                                                                            max_size=R - E)))) for _ in range(L)]
    p = Placement.from_phy2log(torch.tensor(rows, dtype=torch.long), E)
    lost = data.draw(st.sets(st.integers(0, ep - 1), min_size=1, max_size=ep))
    want = len(lost) < ep and brute_covered(p.phy2log, ep, lost)
    assert covered(p, ep, lost) == want
    if want:
        q = without_ranks(p, ep, lost)
        keep = [r for r in range(ep) if r not in lost]
        # the survivors' slots in order: survivor i's slots are what rank keep[i] held, renumbered
        assert torch.equal(q.phy2log, torch.cat([p.phy2log[:, r * per:(r + 1) * per] for r in keep], dim=1))
        validate_placement(q.phy2log, q.log2phy, q.logcnt, num_logical=E, num_gpus=len(keep))
    else:
        with pytest.raises(PlacementError, match="without a replica") if len(lost) < ep else pytest.raises(Exception):
            without_ranks(p, ep, lost)


def test_an_uncovered_loss_names_the_expert():
    # 2 ranks, 4 experts, 6 slots: rank 0 holds 0 1 2, rank 1 holds 3 0 1 -> losing rank 0 loses expert 2
    p = Placement.from_phy2log(torch.tensor([[0, 1, 2, 3, 0, 1]]), 4)
    assert uncovered(p, 2, [0]) == [(0, 2)] and uncovered(p, 2, [1]) == [(0, 3)]
    with pytest.raises(PlacementError, match=r"losing EP rank\(s\) \[0\] of 2 leaves layer 0's expert 2"):
        without_ranks(p, 2, [0])


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_spread_puts_every_expert_on_two_ranks_and_keeps_spread_rows(data):
    ep = data.draw(st.integers(2, 6))
    E = data.draw(st.integers(1, 10))
    per = data.draw(st.integers(-(-2 * E // ep), -(-2 * E // ep) + 3))
    R = per * ep
    L = data.draw(st.integers(1, 4))
    weight = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1000), min_size=E, max_size=E), min_size=L,
                                             max_size=L)), dtype=torch.float)
    p2l, _, _ = rebalance_experts(weight, R, 1, 1, ep, drift=0.0)
    out = spread(p2l, E, ep, weight)
    plan = Placement.from_phy2log(out, E, R - E + 1)
    validate_placement(plan.phy2log, plan.log2phy, plan.logcnt, num_logical=E, num_gpus=ep)
    for lost in range(ep):
        assert covered(plan, ep, [lost])
    for l in range(L):  # a row that was spread already is left alone
        if all(covered(Placement.from_phy2log(p2l[l:l + 1], E), ep, [r]) for r in range(ep)):
            assert torch.equal(out[l], p2l[l])


def test_spread_moves_a_slot_from_the_lightest_donor():
    # 2 ranks x 4 slots, 3 experts: expert 2 only on rank 0; expert 0 has 3 replicas (2 on rank 1), expert 1 has 2
    row = [2, 0, 1, 2, 0, 0, 1, 1]
    got = spread_row(row, 3, 2, load=[30.0, 1000.0, 5.0])
    assert got == [2, 0, 1, 2, 2, 0, 1, 1]  # expert 0 (30 / 2 per replica after) gives rank 1's first slot


def test_survivable_policy_plans_are_covered_and_valid():
    w = torch.tensor([[100.0, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7, 8]])
    p2l, l2p, cnt = survivable(rebalance_experts)(w, 18, 1, 1, 3)
    validate_placement(p2l, l2p, cnt, num_logical=8, num_gpus=3)
    plan = Placement(p2l, l2p, cnt)
    assert all(covered(plan, 3, [r]) for r in range(3))
    raw, _, _ = rebalance_experts(w, 18, 1, 1, 3)
    assert not all(covered(Placement.from_phy2log(raw, 8), 3, [r]) for r in range(3))  # EPLB alone: by chance


def test_the_identity_placement_with_enough_slots_is_spread():
    for E, ep, R in ((8, 2, 16), (8, 3, 18), (8, 4, 16), (5, 2, 12), (3, 3, 6)):
        p = Placement.identity(2, E, R)
        assert all(covered(p, ep, [r]) for r in range(ep)), (E, ep, R)


def test_check_survivable_names_what_is_missing():
    check_survivable(8, 8, 2, 1, True)
    with pytest.raises(ValueError, match=r"num_redundant_experts >= 8 .* got 4"):
        check_survivable(8, 4, 2, 1, True)
    with pytest.raises(ValueError, match="EPLB on"):
        check_survivable(8, 8, 2, 1, False)
    with pytest.raises(ValueError, match="num_nodes=1"):
        check_survivable(8, 8, 2, 2, True)
    with pytest.raises(ValueError, match="at least 2 EP ranks"):
        check_survivable(8, 8, 1, 1, True)


def test_the_eplb_controller_refuses_too_few_slots_and_spreads_its_plans():
    from types import SimpleNamespace

    from inferhal.core.errors import UserError
    from inferhal.core.parallel.ep_engine import eplb_controller

    eplb = SimpleNamespace(enabled=True, policy="inferhal", drift=0.35, num_redundant_experts=4, num_groups=0,
                           num_nodes=1, window_size=10, step_interval=0, survive_rank_loss=True)
    with pytest.raises(UserError, match=r"eplb.survive_rank_loss=true needs eplb.num_redundant_experts >= 8"):
        eplb_controller(eplb, 2, 8, 2)
    eplb.num_redundant_experts = 8
    ctl = eplb_controller(eplb, 2, 8, 2)
    assert all(covered(ctl.placement, 2, [r]) for r in range(2))  # the first placement (identity, 16 slots)
    load = torch.tensor([[100.0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 90]])
    plan = ctl.plan_from(load)
    ctl.holder.check(plan)
    assert all(covered(plan, 2, [r]) for r in range(2))
    eplb.survive_rank_loss = False
    raw = eplb_controller(eplb, 2, 8, 2).plan_from(load)
    assert not all(covered(raw, 2, [r]) for r in range(2))  # the same load without the constraint


def test_survivable_plans_stay_balanced():
    """The heaviest rank's load (per-replica loads summed) of a survivable plan, against the unconstrained plan's,
    on log-normal loads: the halves keep the policy's balance (repairing the unconstrained plan alone does not)."""
    gen = torch.Generator().manual_seed(5)

    def heaviest(p2l, w, ep):
        cnt = torch.zeros_like(w).scatter_add_(1, p2l, torch.ones_like(p2l, dtype=w.dtype))
        per_slot = (w / cnt).gather(1, p2l)  # [L, R]
        return per_slot.view(w.shape[0], ep, -1).sum(-1).amax(1) / (w.sum(1) / ep)  # [L] max / mean

    for ep, E in ((2, 16), (4, 32), (8, 64)):
        w = torch.exp(torch.randn(8, E, generator=gen))
        raw, _, _ = rebalance_experts(w, 2 * E, 1, 1, ep, drift=0.0)
        ours, _, _ = survivable(lambda *a: rebalance_experts(*a, drift=0.0))(w, 2 * E, 1, 1, ep)
        repaired = spread(raw, E, ep, w)
        assert float(heaviest(ours, w, ep).max()) <= 1.02 * float(heaviest(raw, w, ep).max()), (ep, E)
        if ep > 2:  # (two ranks of E slots each hold every expert once: any spread plan is even)
            assert float(heaviest(repaired, w, ep).median()) > 1.1 * float(heaviest(ours, w, ep).median())
