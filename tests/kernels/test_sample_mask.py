"""sample.mask kernel vs the reference, in the interpreter: identical logits (a masked store of -inf, no arithmetic)."""

import pytest
import torch

from inferhal.backends.reference.ops import sample_mask as ref_mask
from inferhal.kernels.sample_mask import sample_mask


@pytest.mark.parametrize("b,v,rows", [(3, 100, [2, 0]), (4, 3000, [1, 2, 3]), (2, 64, [])])
def test_sample_mask_matches_reference(b, v, rows):
    g = torch.Generator().manual_seed(v)
    logits = torch.randn(b, v, generator=g)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), (v + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    r = torch.tensor(rows, dtype=torch.int64)
    want, got = logits.clone(), logits.clone()
    ref_mask(want, mask, r)
    sample_mask(got, mask, r)
    assert torch.equal(got, want)


def test_a_bitmask_too_short_is_refused():
    with pytest.raises(ValueError, match="bitmask covers 32 tokens, logits have 40"):
        sample_mask(torch.zeros(1, 40), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))
