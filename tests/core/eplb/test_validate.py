import pytest
import torch

from inferhal.core.eplb import EplbLayout, Placement, PlacementError, PlacementHolder, rebalance_experts
from inferhal.core.eplb import validate_placement


def plan(L=2, E=8, R=12, groups=2, nodes=2, gpus=4):
    w = torch.arange(1, L * E + 1, dtype=torch.float).view(L, E)
    return rebalance_experts(w, R, groups, nodes, gpus)


def check(p2l, l2p, cnt, **kw):
    args = dict(num_logical=8, num_gpus=4, num_groups=2, num_nodes=2)
    args.update(kw)
    validate_placement(p2l, l2p, cnt, **args)


def test_valid_plan_passes():
    check(*plan())


def test_missing_expert_is_rejected():
    p2l, l2p, cnt = plan()
    p2l = p2l.clone()
    e = int(p2l[0, 0])
    p2l[0][p2l[0] == e] = int(p2l[0, 1])
    with pytest.raises(PlacementError, match=f"layer 0: expert {e} has no replica"):
        check(p2l, l2p, cnt, num_nodes=1, num_groups=1)


def test_empty_slot_is_rejected_naming_the_gpu():
    p2l, l2p, cnt = plan()
    p2l = p2l.clone()
    p2l[1, 7] = -1
    with pytest.raises(PlacementError, match="layer 1: slot 7 on GPU 2"):
        check(p2l, l2p, cnt)


def test_slots_not_divisible_by_gpus_is_rejected():
    p2l, l2p, cnt = plan()
    with pytest.raises(PlacementError, match="do not split evenly over 5 GPUs"):
        check(p2l, l2p, cnt, num_gpus=5)


def test_wrong_logcnt_and_log2phy_are_rejected():
    p2l, l2p, cnt = plan()
    bad = cnt.clone()
    bad[0, 0] += 1
    with pytest.raises(PlacementError, match="logcnt says expert 0"):
        check(p2l, l2p, bad)
    bad = l2p.clone()
    bad[1, 3, 0] = (int(bad[1, 3, 0]) + 1) % 12
    with pytest.raises(PlacementError, match=r"layer 1: log2phy\[3\]"):
        check(p2l, bad, cnt)


def test_group_split_across_nodes_is_rejected():
    p2l, l2p, cnt = plan()
    # swap one slot between the two nodes (slots 0..5 node 0, 6..11 node 1), keeping counts
    p2l = p2l.clone()
    a, b = 0, 11
    if int(p2l[0, a]) // 4 == int(p2l[0, b]) // 4:
        pytest.skip("both slots hold the same group")
    p2l[0, a], p2l[0, b] = int(p2l[0, b]), int(p2l[0, a])
    fixed = Placement.from_phy2log(p2l, 8, l2p.shape[2])
    with pytest.raises(PlacementError, match="expert group .* spans nodes 0..1"):
        check(fixed.phy2log, fixed.log2phy, fixed.logcnt)
    check(fixed.phy2log, fixed.log2phy, fixed.logcnt, hierarchical=False)  # fine for the global policy


def test_holder_rejects_an_invalid_plan_and_keeps_the_old_one():
    layout = EplbLayout(num_layers=2, num_logical=8, num_physical=12, num_groups=2, num_nodes=2, num_gpus=4)
    good = Placement(*plan())
    holder = PlacementHolder(layout, good)
    p2l = good.phy2log.clone()
    p2l[0, :] = 0
    bad = Placement(p2l, good.log2phy, good.logcnt)
    assert holder.propose(bad) is False
    assert holder.current is good
    assert "no replica" in holder.last_error
    wrong_shape = Placement.identity(3, 8, 12)
    assert holder.propose(wrong_shape) is False and holder.current is good
    other = Placement(*plan(R=12))
    assert holder.propose(other) is True and holder.current is other and holder.last_error == ""
