import itertools

import pytest
import torch

from inferhal.core.eplb.packing import kk_pack, lpt_pack, pack_loads, ranks_in_pack, refine_swaps, round_pack
from inferhal.core.eplb.policy import ours_pack


def heavy(x, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(x, n, generator=g) * 1.2)


@pytest.mark.parametrize("fn", [lpt_pack, kk_pack, round_pack, ours_pack])
@pytest.mark.parametrize("n,m", [(12, 3), (16, 16), (48, 8)])
def test_every_pack_gets_exactly_its_count(fn, n, m):
    w = heavy(7, n, n + m)
    pack, rank = fn(w, m)
    for x in range(7):
        assert torch.bincount(pack[x], minlength=m).tolist() == [n // m] * m
        # (pack, rank) pairs are distinct and ranks cover 0..cap-1
        assert len(set(zip(pack[x].tolist(), rank[x].tolist()))) == n
        assert int(rank[x].max()) == n // m - 1


def test_refine_never_worsens_and_fixes_a_bad_start():
    w = heavy(20, 24, 5)
    start = (torch.arange(24) // 6).expand(20, 24).clone()  # items in index order: a poor packing
    pack, _ = refine_swaps(w, start, 4)
    before, after = pack_loads(w, start, 4).amax(1), pack_loads(w, pack, 4).amax(1)
    assert (after <= before + 1e-6).all() and (after < before - 1e-6).any()


def test_ours_reaches_the_optimum_on_small_cases_at_least_as_often_as_lpt():
    w = heavy(30, 8, 11)
    best = []
    for x in range(30):
        opt = min(max(float(w[x, list(c)].sum()), float(w[x].sum() - w[x, list(c)].sum()))
                  for c in itertools.combinations(range(8), 4))
        best.append(opt)
    best = torch.tensor(best)
    ours = pack_loads(w, ours_pack(w, 2)[0], 2).amax(1)
    lpt = pack_loads(w, lpt_pack(w, 2)[0], 2).amax(1)
    assert (ours >= best - 1e-5).all()
    hit_ours = int((ours <= best + 1e-5).sum())
    hit_lpt = int((lpt <= best + 1e-5).sum())
    assert hit_ours >= hit_lpt and hit_ours >= 25


def test_ranks_in_pack_orders_by_item_index():
    pack = torch.tensor([[1, 0, 1, 0, 1, 0]])
    assert ranks_in_pack(pack, 2).tolist() == [[0, 0, 1, 1, 2, 2]]


def test_indivisible_count_is_rejected():
    with pytest.raises(ValueError, match="do not split"):
        kk_pack(torch.ones(1, 7), 2)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_refine_with_several_heavy_packs_per_step_keeps_counts_and_never_worsens(k):
    w = heavy(9, 32 * 6, 3)
    start = round_pack(w, 32)[0]
    pack, rank = refine_swaps(w, start, 32, heavy=k)
    for x in range(9):
        assert torch.bincount(pack[x], minlength=32).tolist() == [6] * 32
        assert len(set(zip(pack[x].tolist(), rank[x].tolist()))) == 32 * 6
    before, after = pack_loads(w, start, 32).amax(1), pack_loads(w, pack, 32).amax(1)
    assert (after <= before + 1e-6).all() and (after < before - 1e-6).all()


def test_refine_stops_a_row_at_its_floor():
    w = heavy(4, 24, 8)
    start = (torch.arange(24) // 6).expand(4, 24).clone()
    free = pack_loads(w, refine_swaps(w, start, 4)[0], 4).amax(1)
    before = pack_loads(w, start, 4).amax(1)
    floor = torch.tensor([float("inf"), -1.0, float("inf"), -1.0])  # rows 0 and 2: already good enough
    pack, _ = refine_swaps(w, start, 4, floor=floor)
    got = pack_loads(w, pack, 4).amax(1)
    assert torch.equal(pack[0], start[0]) and torch.equal(pack[2], start[2])
    torch.testing.assert_close(got[[1, 3]], free[[1, 3]])
    assert (free[[1, 3]] < before[[1, 3]]).all()


def test_best_swaps_finds_the_pair_closest_to_half_the_gap():
    from inferhal.core.eplb.packing import best_swaps

    src = torch.tensor([[[1.0, 5.0, 9.0]]])  # load 15
    dst = torch.tensor([[[[0.5, 2.0, 4.0]]]])  # load 6.5: half the gap 4.25; 9 - 4 = 5 moves 5, 5 - 0.5 = 4.5
    gain, i, j = best_swaps(src, src.sum(-1), dst, dst.sum(-1))
    assert (int(i), int(j)) == (1, 0)  # new loads 10.5 / 11: max 11, gain 4
    torch.testing.assert_close(gain, torch.tensor([[[4.0]]]))
