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
