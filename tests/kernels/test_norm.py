"""norm.rms kernel vs the reference, in the interpreter."""

import pytest
import torch

from inferhal.backends.reference.ops import norm_rms
from inferhal.core.ops.params import RmsNormParams
from inferhal.kernels.norm import rms_norm

SHAPES = [(1, 1), (3, 7), (5, 64), (17, 100), (2, 256), (0, 32)]  # ragged D, edge T=0, D=1


@pytest.mark.parametrize("t,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_reference(t, d, dtype, residual, close):
    g = torch.Generator().manual_seed(t * 1000 + d)
    x = (torch.randn(t, d, generator=g) * 3).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)
    r = torch.randn(t, d, generator=g).to(dtype) if residual else None
    p = RmsNormParams(eps=1e-6)
    out, ref = rms_norm(x, w, p, r), norm_rms(x, w, p, r)
    if residual:
        close(out[1], ref[1], name="norm.rms h")  # h = x + r: one rounding, must match
        close(out[0], ref[0], name="norm.rms y")
    else:
        close(out, ref, name="norm.rms y")


@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_no_weight_and_unit_offset(unit_offset, close):
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    w = torch.randn(48, dtype=torch.bfloat16) * 0.1
    p = RmsNormParams(eps=1e-5, unit_offset=unit_offset)
    close(rms_norm(x, w, p), norm_rms(x, w, p), name="norm.rms unit_offset")
    close(rms_norm(x, None, p), norm_rms(x, None, p), name="norm.rms no weight")


def test_rms_norm_3d_and_bad_residual():
    x = torch.randn(2, 3, 16)
    p = RmsNormParams()
    torch.testing.assert_close(rms_norm(x, None, p), norm_rms(x, None, p), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(x, None, p, torch.randn(2, 16))
