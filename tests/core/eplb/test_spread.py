import torch

from inferhal.core.eplb.metrics import gpu_loads
from inferhal.core.eplb.packing import pack_loads
from inferhal.core.eplb.policy import ours_pack, rebalance_with, replicate
from inferhal.core.eplb.spread import pack_variance, spread_pack


def coloc(pack, expert, m):
    key = pack * (int(expert.max()) + 1) + expert
    return sum(int(k.numel() - k.unique().numel()) for k in key)


def test_zero_budget_never_raises_a_layer_maximum_and_separates_replicas():
    # two packs, each holding both replicas of one expert: swapping one replica keeps both loads
    w = torch.ones(1, 4)
    expert = torch.tensor([[0, 0, 1, 1]])
    pack = torch.tensor([[0, 0, 1, 1]])
    new, _ = spread_pack(w, expert, pack, 2, budget=0.0)
    assert coloc(new, expert, 2) == 0 and coloc(pack, expert, 2) == 2
    torch.testing.assert_close(pack_loads(w, new, 2), pack_loads(w, pack, 2))


def test_zero_budget_keeps_every_layer_maximum_on_random_packings():
    g = torch.Generator().manual_seed(0)
    load = torch.exp(1.5 * torch.randn(6, 32, generator=g)) * 100
    phy2log, cnt = replicate(load, 64)
    per = (load / cnt).gather(1, phy2log)
    pack, _ = ours_pack(per, 8)
    new, _ = spread_pack(per, phy2log, pack, 8, budget=0.0, max_iters=50)
    before, after = pack_loads(per, pack, 8).amax(1), pack_loads(per, new, 8).amax(1)
    assert bool((after <= before * (1 + 1e-5)).all())
    assert torch.equal(torch.bincount(new.flatten(), minlength=8), torch.bincount(pack.flatten(), minlength=8))

    def risk(p):  # the searched objective: the riskiest pack of each row
        by_pack = p.argsort(dim=1, stable=True)
        w, e = per.gather(1, by_pack).view(6, 8, 8), phy2log.gather(1, by_pack).view(6, 8, 8)
        return (w.sum(-1) + pack_variance(w, e).sqrt()).amax(1)

    assert bool((risk(new) <= risk(pack) * (1 + 1e-6)).all()) and bool((risk(new) < risk(pack)).any())


def test_policy_with_spread_gives_valid_plans():
    from inferhal.core.eplb import validate_placement

    load = torch.exp(torch.randn(3, 32, generator=torch.Generator().manual_seed(1))) * 50
    phy2log, log2phy, logcnt = rebalance_with(load, 48, 4, 2, 8, ours_pack, spread=True)
    validate_placement(phy2log, log2phy, logcnt, num_logical=32, num_gpus=8, num_groups=4, num_nodes=2)
    torch.testing.assert_close(gpu_loads(load, phy2log, logcnt, 8).sum(1), load.sum(1))


def _replicas(seed, layers, experts, slots):
    load = torch.exp(1.5 * torch.randn(layers, experts, generator=torch.Generator().manual_seed(seed))) * 100
    phy2log, cnt = replicate(load, slots)
    return (load / cnt).gather(1, phy2log), phy2log


def test_lpt_max_is_the_greedy_packings_maximum():
    from inferhal.core.eplb.packing import lpt_max_sorted, lpt_pack, sort_items

    for m, slots in ((8, 64), (4, 36), (16, 16)):
        per, _ = _replicas(m, 5, 16, slots)
        want = pack_loads(per, lpt_pack(per, m)[0], m).amax(1)
        torch.testing.assert_close(lpt_max_sorted(sort_items(per)[0], m), want)


def test_budget_never_passes_the_greedy_maximum_of_a_layer():
    from inferhal.core.eplb.packing import lpt_pack, sort_items
    from inferhal.core.eplb.spread import layer_caps

    nodes, m = 2, 4
    per, phy2log = _replicas(3, 6 * nodes, 16, 32)  # rows: 6 layers x 2 nodes
    pack, _ = ours_pack(per, m)
    now = pack_loads(per, pack, m).amax(1).view(6, nodes).amax(1)
    greedy = pack_loads(per, lpt_pack(per, m)[0], m).amax(1).view(6, nodes).amax(1)
    limit = torch.maximum(now, greedy) * (1 + 1e-5)
    sorted_w, order = sort_items(per)
    for budget in (0.0, 0.25, 1.0):
        cap = layer_caps(sorted_w, pack.gather(1, order), m, nodes, budget).view(6, nodes)
        assert bool((cap[:, 0] <= limit).all()) and torch.equal(cap[:, 0], cap[:, 1])
        new, _ = spread_pack(per, phy2log, pack, m, nodes, budget=budget, max_iters=40)
        after = pack_loads(per, new, m).amax(1).view(6, nodes).amax(1)
        assert bool((after <= limit).all())
        assert torch.equal(torch.bincount(new.flatten(), minlength=m), torch.bincount(pack.flatten(), minlength=m))


def test_search_over_few_items_of_the_riskiest_pack_still_lowers_risk():
    per, phy2log = _replicas(4, 4, 32, 96)  # 12 items per pack; top=2 tries 2 of them per step
    pack, _ = ours_pack(per, 8)

    def risk(p):
        by_pack = p.argsort(dim=1, stable=True)
        w, e = per.gather(1, by_pack).view(4, 8, 12), phy2log.gather(1, by_pack).view(4, 8, 12)
        return (w.sum(-1) + pack_variance(w, e).sqrt()).amax(1)

    new, _ = spread_pack(per, phy2log, pack, 8, budget=1.0, max_iters=30, top=2)
    assert bool((risk(new) <= risk(pack) * (1 + 1e-6)).all()) and bool((risk(new) < risk(pack)).any())
