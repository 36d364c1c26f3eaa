"""kv.write kernel vs the reference, in the interpreter.

Plain caches must be bit-identical (a copy, with round-to-nearest-even when the dtype narrows).
FP8: the per-entry scale is one fp32 division (1e-6 relative). The interpreter's own fp32 -> e4m3
cast misrounds a few percent of values (up to a factor 2 where the carry reaches the exponent), so the
kernel rounds to the e4m3 grid itself under the interpreter (``kernels/common.round_to``), as the
device's cvt.rn does. Codes then differ only where v / scale differs by an fp32 ulp across a rounding
boundary: within one e4m3 step (2**-3 relative, 2**-9 below 2**-6), and on almost every entry exactly.
"""

import pytest
import torch

from inferhal.backends.reference.device import TorchKVStorage
from inferhal.backends.reference.ops import kv_write as ref_write
from inferhal.core.backend import KVGroupLayout, KVStorageRequest
from inferhal.core.ops.params import KVWriteParams
from inferhal.kernels.kv_write import kv_write


def slots(t, nb, bs, g):
    s = torch.randperm(nb * bs, generator=g)[:t]
    if t > 2:
        s[1] = -1  # skipped token
    return s


@pytest.mark.parametrize("t,nb,bs,slot", [(1, 2, 4, (8,)), (9, 4, 4, (2, 1, 24)), (16, 3, 8, (1, 96)), (0, 1, 4, (4,))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_plain(t, nb, bs, slot, dtype):
    g = torch.Generator().manual_seed(t + nb)
    values = torch.randn(t, *slot, generator=g)
    sm = slots(t, nb, bs, g)
    out = torch.zeros(nb, bs, *slot, dtype=dtype)
    ref = out.clone()
    kv_write(values, out, sm)
    ref_write(values, ref, sm)
    assert torch.equal(out, ref)


def test_kv_write_into_shared_pool_view():
    req = KVStorageRequest(4, 8, (KVGroupLayout("swa", (0,), 8, (1, 40), torch.bfloat16),
                                  KVGroupLayout("csa", (0,), 2, (1, 64), torch.bfloat16)))
    a, b = TorchKVStorage(req), TorchKVStorage(req)
    values = torch.randn(5, 1, 40)
    sm = torch.tensor([0, 9, 17, -1, 31])
    kv_write(values, a.layer_cache("swa", 0), sm)  # a strided view of the byte pool
    ref_write(values, b.layer_cache("swa", 0), sm)
    assert torch.equal(a.layer_cache("swa", 0), b.layer_cache("swa", 0))


@pytest.mark.parametrize("t,nb,bs,slot", [(7, 2, 4, (64,)), (12, 3, 4, (1, 72))])
def test_kv_write_fp8(t, nb, bs, slot):
    g = torch.Generator().manual_seed(t)
    values = torch.randn(t, *slot, generator=g) * 3
    sm = slots(t, nb, bs, g)
    out = torch.zeros(nb, bs, *slot, dtype=torch.float8_e4m3fn)
    ref = out.clone()
    so, sr = torch.zeros(nb, bs), torch.zeros(nb, bs)
    kv_write(values, out, sm, KVWriteParams(quant="fp8"), so)
    ref_write(values, ref, sm, KVWriteParams(quant="fp8"), sr)
    torch.testing.assert_close(so, sr, rtol=1e-6, atol=0)
    o, r = out.float(), ref.float()
    step = torch.where(r.abs() >= 2**-6, r.abs() * 2**-3, torch.full_like(r, 2**-9))
    assert bool(((o - r).abs() <= step * 1.0001).all())
    assert float((o != r).float().mean()) < 0.01
