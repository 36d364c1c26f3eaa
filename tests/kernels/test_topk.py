"""topk.select kernel vs the reference, in the interpreter. Indices are compared exactly (no tolerance):
the selection is a comparison of fp32 values, and ties must break by the lower index in both."""

import pytest
import torch

from inferhal.backends.reference.ops import topk_select as ref_topk
from inferhal.kernels.topk import topk_select
from inferhal.kernels.tuning import register_target

#: forces the multi-tile path (bisection + compaction + sort) on small rows
register_target("test_topk_tiles", {"topk_select": {"BLOCK_S": 32, "BLOCK_SORT": 16, "num_warps": 4}})

CASES = [
    # T, S, k, ties, valid_len, -inf share, target
    (1, 1, 1, False, False, 0.0, None),
    (3, 10, 4, False, True, 0.0, None),
    (5, 37, 8, True, False, 0.0, None),  # many exact ties (and -0.0 == 0.0): lower index first
    (4, 130, 16, True, True, 0.3, None),  # -inf entries (not-yet-closed) -> -1
    (2, 5, 12, False, False, 0.4, None),  # k > S: -1 padding
    (3, 70, 70, False, True, 0.0, None),  # k == S
    (3, 75, 9, True, True, 0.2, "test_topk_tiles"),  # multi-tile path, ragged last tile, ties across tiles
    (2, 40, 40, False, False, 0.0, "test_topk_tiles"),  # multi-tile path, k == S
]


@pytest.mark.parametrize("case", CASES)
def test_topk_select_matches_reference(case):
    t, s, k, ties, with_vl, neg, target = case
    g = torch.Generator().manual_seed(t * 1000 + s + k)
    x = torch.randn(t, s, generator=g)
    if ties:
        x = torch.randint(-3, 4, (t, s), generator=g).float() * 0.5  # also -0.0 vs 0.0 below
        x[0, ::3] = -0.0
    if neg:
        x = x.masked_fill(torch.rand(t, s, generator=g) < neg, float("-inf"))
    vl = torch.randint(0, s + 1, (t,), generator=g) if with_vl else None
    got, want = topk_select(x, k, vl, target=target), ref_topk(x, k, vl)
    assert got.dtype == torch.long and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_multi_tile_rows_read_only_their_valid_length_and_equal_the_reference(ties):
    """The multi-tile path counts positions >= valid_len as -inf keys without reading them: rows whose valid length
    is 0, under k, at k, at a tile edge, the whole row or beyond it give the reference's indices (-1 where a row has
    fewer than k visible entries)."""
    vl = torch.tensor([0, 1, 5, 9, 10, 31, 32, 33, 64, 74, 75, 200])
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(vl), 75, generator=g)
    if ties:
        x = torch.randint(-2, 3, x.shape, generator=g).float()
    x = x.masked_fill(torch.rand(x.shape, generator=g) < 0.15, float("-inf"))
    for k in (9, 40):
        got, want = topk_select(x, k, vl, target="test_topk_tiles"), ref_topk(x, k, vl)
        assert torch.equal(got, want), (k, got, want)


def test_topk_select_empty_and_bad_input():
    assert topk_select(torch.zeros(0, 7), 3).shape == (0, 3)
    with pytest.raises(ValueError, match="k must be"):
        topk_select(torch.zeros(2, 7), 0)
