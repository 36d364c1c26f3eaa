"""rope.apply kernel vs the reference, in the interpreter."""

import pytest
import torch

from inferhal.backends.reference.ops import rope_apply as ref_rope
from inferhal.core.ops.params import RopeParams
from inferhal.kernels.rope import rope_apply


def cos_sin_table(n: int, r: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    ang = torch.arange(n).float()[:, None] * inv[None]
    return torch.cat((ang.cos(), ang.sin()), dim=-1)  # [P, R]


@pytest.mark.parametrize("t,h,d,r", [(1, 1, 8, 8), (5, 3, 64, 16), (7, 2, 72, 64), (3, 4, 30, 6), (0, 2, 16, 8)])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("placement", ["head", "tail"])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_reference(t, h, d, r, style, placement, inverse, dtype, close):
    g = torch.Generator().manual_seed(t * 31 + d)
    x = torch.randn(t, h, d, generator=g).to(dtype)
    pos = torch.randint(0, 100, (t,), generator=g)
    cs = cos_sin_table(128, r)
    p = RopeParams(rotary_dim=r, style=style, placement=placement, inverse=inverse)
    close(rope_apply(x, pos, cs, p), ref_rope(x, pos, cs, p), name="rope.apply")


def test_rope_rejects_bad_shapes():
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_apply(torch.randn(2, 1, 8), torch.zeros(2, dtype=torch.long), cos_sin_table(4, 16), RopeParams(rotary_dim=16))
