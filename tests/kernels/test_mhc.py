"""mhc.pre / mhc.post kernels vs the reference, in the interpreter.

post and comb are fp32 outputs of short fp32 chains (sigmoid, softmax, 20 Sinkhorn steps): 1e-5.
x and streams' are one rounding into the stream dtype of an fp32 sum: the per-dtype single rounding.
"""

import pytest
import torch

from inferhal.backends.reference.mhc import mhc_post as ref_post
from inferhal.backends.reference.mhc import mhc_pre as ref_pre
from inferhal.core.ops.params import MhcParams
from inferhal.kernels.mhc import mhc_post, mhc_pre


@pytest.mark.parametrize("t,n,d", [(1, 4, 16), (5, 4, 40), (3, 3, 33), (2, 4, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mhc_pre_post_match_reference(t, n, d, dtype, close):
    g = torch.Generator().manual_seed(t + n + d)
    streams = torch.randn(t, n, d, generator=g).to(dtype)
    nj = (2 + n) * n
    fn = torch.randn(nj, n * d, generator=g) * 0.1
    base = torch.randn(nj, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    p = MhcParams(hc_mult=n, sinkhorn_iters=20)
    x, post, comb = mhc_pre(streams, fn, base, scale, p)
    rx, rpost, rcomb = ref_pre(streams, fn, base, scale, p)
    close(post, rpost, name="mhc.pre post")
    close(comb, rcomb, name="mhc.pre comb")
    close(x, rx, name="mhc.pre x", scale=2.0)
    y = torch.randn(t, d, generator=g).to(dtype)
    close(mhc_post(y, streams, rpost, rcomb), ref_post(y, streams, rpost, rcomb), name="mhc.post", scale=2.0)


def test_mhc_empty_batch():
    # (the reference's reshape(t, -1) fails for T=0, so the kernel's empty batch is checked on its own)
    x, post, comb = mhc_pre(torch.randn(0, 4, 8), torch.randn(24, 32), torch.randn(24), torch.ones(3), MhcParams(hc_mult=4))
    assert x.shape == (0, 8) and post.shape == (0, 4) and comb.shape == (0, 4, 4)


def test_mhc_pre_rejects_wrong_fn():
    with pytest.raises(ValueError, match="fn must be"):
        mhc_pre(torch.randn(1, 4, 8), torch.randn(3, 3), torch.randn(24), torch.ones(3), MhcParams(hc_mult=4))
