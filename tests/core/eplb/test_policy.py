import pytest
import torch

from inferhal.core.eplb import EplbInputError, rebalance_experts, validate_placement
from inferhal.core.eplb.baseline import rebalance_greedy, rebalance_per_layer
from inferhal.core.eplb.metrics import balancedness, gpu_loads, lower_bound_per_layer, balancedness_per_layer


def skewed(L, E, seed=0, sigma=1.5):
    # every draw from the seeded generator: a draw from torch's global RNG made the workload (and whether
    # a policy wins on it) depend on which tests ran before
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, E, generator=g) * sigma).exp() * 100 + torch.rand(L, E, generator=g)


def test_deepseek_readme_shape_example_is_valid_hierarchical():
    w = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                      [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]], dtype=torch.float)
    phy2log, log2phy, logcnt = rebalance_experts(w, 16, 4, 2, 8)
    assert phy2log.shape == (2, 16) and log2phy.shape == (2, 12, 5) and logcnt.shape == (2, 12)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    validate_placement(phy2log, log2phy, logcnt, num_logical=12, num_gpus=8, num_groups=4, num_nodes=2)
    assert int(logcnt.sum(1).min()) == 16
    # log2phy rows list exactly the slots holding the expert, padded with -1
    for l in range(2):
        for e in range(12):
            slots = sorted(int(p) for p in (phy2log[l] == e).nonzero().flatten())
            row = log2phy[l, e].tolist()
            assert row[: len(slots)] == slots and all(v == -1 for v in row[len(slots):])


@pytest.mark.parametrize("R,groups,nodes,gpus", [(48, 4, 2, 8), (40, 4, 4, 8), (48, 4, 3, 6), (32, 1, 1, 4),
                                                 (36, 8, 1, 4)])
def test_plans_are_valid_and_hierarchy_respected(R, groups, nodes, gpus):
    w = skewed(5, 32, seed=R)
    phy2log, log2phy, logcnt = rebalance_experts(w, R, groups, nodes, gpus)
    hier = groups % nodes == 0
    validate_placement(phy2log, log2phy, logcnt, num_logical=32, num_gpus=gpus, num_groups=groups,
                       num_nodes=nodes, hierarchical=hier and nodes > 1)
    # total load is conserved on the GPUs
    torch.testing.assert_close(gpu_loads(w, phy2log, logcnt, gpus).sum(1), w.sum(1))


def test_global_policy_when_groups_do_not_divide_nodes_can_split_groups():
    # 3 nodes, 4 groups: not hierarchical; a single very hot group must be spread over nodes
    w = torch.ones(1, 16)
    w[0, :4] = 1000.0
    phy2log, log2phy, logcnt = rebalance_experts(w, 24, 4, 3, 6)
    node = torch.arange(24) // 8
    hot_nodes = node[(phy2log[0] < 4)].unique()
    assert hot_nodes.numel() > 1


def test_hot_experts_get_the_redundant_slots():
    w = torch.ones(2, 16)
    w[:, 3] = 100.0
    w[:, 9] = 50.0
    _, _, logcnt = rebalance_experts(w, 24, 1, 1, 4)
    assert int(logcnt[0, 3]) > int(logcnt[0, 9]) > 1
    assert int(logcnt[0].sum()) == 24


def test_ours_balances_better_than_greedy_and_never_beats_the_lower_bound():
    w = skewed(16, 64, seed=1, sigma=1.8)
    ours, greedy, bound = [], [], lower_bound_per_layer(w, 80, 8, 1, 16)
    for f, acc in ((rebalance_experts, ours), (rebalance_greedy, greedy)):
        p2l, _, cnt = f(w, 80, 8, 1, 16)
        acc.append(balancedness_per_layer(w, p2l, cnt, 16))
    o, g = ours[0], greedy[0]
    assert (bound <= o + 1e-5).all() and (bound <= g + 1e-5).all()
    assert o.mean() < g.mean()


def test_lower_bound_hierarchical_counts_node_packing():
    w = torch.ones(1, 16)
    w[0, :4] = 100.0  # group 0 is hot; with 4 nodes its node carries >= its load
    b = lower_bound_per_layer(w, 16, 4, 4, 8)
    p2l, _, cnt = rebalance_experts(w, 16, 4, 4, 8)
    assert float(b[0]) > 2.0
    assert float(b[0]) <= float(balancedness_per_layer(w, p2l, cnt, 8)[0]) + 1e-6


def test_vectorised_equals_per_layer_loop():
    w = skewed(6, 64, seed=3)
    a = rebalance_experts(w, 96, 8, 2, 8)
    b = rebalance_per_layer(w, 96, 8, 2, 8)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_v4_sized_plan_is_valid():
    w = skewed(61, 256, seed=4)
    p2l, l2p, cnt = rebalance_experts(w, 288, 8, 1, 8)
    validate_placement(p2l, l2p, cnt, num_logical=256, num_gpus=8)
    assert l2p.shape == (61, 256, 33)
    assert balancedness(w, p2l, cnt, 8) < 1.01


def test_zero_load_layer_is_fine():
    p2l, l2p, cnt = rebalance_experts(torch.zeros(2, 8), 12, 2, 2, 4)
    validate_placement(p2l, l2p, cnt, num_logical=8, num_gpus=4, num_groups=2, num_nodes=2)


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([[1.0, float("nan"), 2.0, 3.0]]), "NaN"),
    (torch.tensor([[1.0, float("inf"), 2.0, 3.0]]), "non-finite"),
    (torch.tensor([[1.0, -2.0, 2.0, 3.0]]), "negative.*layer 0, expert 1"),
    (torch.ones(4), r"shape \[layers, experts\]"),
    (torch.ones(2, 2, 2), r"shape \[layers, experts\]"),
    (torch.ones(0, 4), r"shape \[layers, experts\]"),
    ([[1.0, 2.0]], "torch.Tensor"),
])
def test_bad_loads_get_a_clear_error(bad, match):
    with pytest.raises(EplbInputError, match=match):
        rebalance_experts(bad, 4, 1, 1, 2)


@pytest.mark.parametrize("args,match", [
    ((3, 1, 1, 1), "fewer than the 4 logical experts"),
    ((6, 1, 1, 4), "not a multiple of num_gpus"),
    ((8, 3, 1, 2), "do not split into num_groups=3"),
    ((8, 2, 2, 3), "not a multiple of num_gpus"),
    ((8, 0, 1, 2), "num_groups must be a positive int"),
])
def test_bad_sizes_get_a_clear_error(args, match):
    with pytest.raises(EplbInputError, match=match):
        rebalance_experts(torch.ones(1, 4), *args)


@pytest.mark.parametrize("R,groups,nodes,gpus", [(80, 8, 4, 16), (96, 8, 8, 16), (72, 8, 1, 8)])
def test_nodes_below_the_layer_floor_skip_work_without_changing_any_layer_maximum(R, groups, nodes, gpus):
    from inferhal.core.eplb.policy import ours_pack, rebalance_with

    w = skewed(7, 64, seed=R + nodes, sigma=1.6)
    a = rebalance_experts(w, R, groups, nodes, gpus, drift=0.0)  # the current-window packing
    b = rebalance_with(w, R, groups, nodes, gpus, lambda x, m, floor: ours_pack(x, m, None))  # no floor
    validate_placement(*a, num_logical=64, num_gpus=gpus, num_groups=groups, num_nodes=nodes)
    torch.testing.assert_close(balancedness_per_layer(w, a[0], a[2], gpus), balancedness_per_layer(w, b[0], b[2], gpus))
