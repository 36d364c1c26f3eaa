"""embed, act.gated and mhc.head kernels vs the reference, in the interpreter (tiny V4 / Gemma 3 widths).

Tolerances: embed is one product with the scale rounded to the table dtype, as the reference: exact.
act.gated rounds act(gate) and then the product, as the reference; its exp/tanh differ from libm's by a
few fp32 ulps, which can flip a rounding: ``links=2``. mhc.head sums N*D fp32 products in another order and
applies the RMS factor after the sum instead of before: fp32 noise on the mixing weights, then one rounding.
"""

import math

import pytest
import torch

from inferhal.backends.reference import ops as ref
from inferhal.backends.reference.mhc import mhc_head as ref_mhc_head
from inferhal.core.ops.params import ActParams, MhcParams
from inferhal.kernels.act_gated import act_gated
from inferhal.kernels.embed import embed
from inferhal.kernels.mhc_head import mhc_head


@pytest.mark.parametrize("t,v,d,scale", [(12, 1000, 64, 8.0), (3, 50, 640, math.sqrt(640)), (5, 192, 96, 1.0), (0, 10, 8, 1.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embed(t, v, d, scale, dtype):
    g = torch.Generator().manual_seed(t + d)
    ids = torch.randint(0, v, (t,), generator=g)
    table = torch.randn(v, d, generator=g).to(dtype)
    assert torch.equal(embed(ids, table, scale), ref.embed(ids, table, scale))


def test_embed_keeps_the_ids_shape():
    table = torch.randn(20, 8)
    ids = torch.tensor([[1, 2, 3], [4, 5, 19]])
    assert torch.equal(embed(ids, table, 2.0), ref.embed(ids, table, 2.0))


@pytest.mark.parametrize("t,i,kind", [(16, 256, "silu"), (5, 2048, "gelu_tanh"), (7, 640, "gelu_tanh"), (5, 17, "silu")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_gated(t, i, kind, dtype, close):
    g = torch.Generator().manual_seed(t * i)
    gate = (torch.randn(t, i, generator=g) * 3).to(dtype)
    up = torch.randn(t, i, generator=g).to(dtype)
    p = ActParams(kind)
    close(act_gated(gate, up, p), ref.act_gated(gate, up, p), links=2, name=f"act.gated {kind}", scale=4.0)


@pytest.mark.parametrize("t,n,d", [(8, 4, 64), (3, 4, 256), (2, 2, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mhc_head(t, n, d, dtype, close):
    g = torch.Generator().manual_seed(n * d + t)
    streams = torch.randn(t, n, d, generator=g).to(dtype)
    fn = torch.randn(n, n * d, generator=g) / (n * d) ** 0.5
    base = torch.randn(n, generator=g) * 0.5
    scale = torch.rand(1, generator=g) + 0.5
    p = MhcParams(hc_mult=n)
    want = ref_mhc_head(streams, fn, base, scale, p)
    close(mhc_head(streams, fn, base, scale, p), want, links=1 if dtype != torch.float32 else 4, name="mhc.head",
          scale=max(float(want.float().abs().max()), 1.0))
