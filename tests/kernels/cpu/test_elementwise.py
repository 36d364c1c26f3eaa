"""bf16 RMSNorm and gated activations (kernels/cpu/elementwise.c) against the reference ops, on this CPU.

They run for real where the CPU kernels build (AVX512-BF16 CPUs, AMX or not), else skip with the reason.
Tolerances: the kernels follow the reference's rounding steps, so what is left is fp32 re-association
of the mean of squares (norm): at most one bf16 ulp, on the few values that sit at a rounding boundary.
The residual sum is one bf16 rounding of the same fp32 sum: exact. gelu_tanh is computed as
x / (1 + e^(-2u)), the same function as torch's 0.5 x (1 + tanh(u)) without its cancellation for x < -3
(measured: 98.8 % of our values equal the float64 result rounded to bf16, torch's 93 %), so there it
is held to the float64 result, and to the reference within one ulp or 1e-6 absolute.
"""

from __future__ import annotations

import math

import pytest
import torch

from inferhal.backends.reference import ops as ref
from inferhal.core.ops.params import ActParams, RmsNormParams
from inferhal.kernels.cpu import elementwise, lib

ST = lib.avx512_status()
pytestmark = pytest.mark.skipif(not ST.available, reason=f"CPU kernels unavailable here: {ST.reason}")

ONE_ULP = dict(rtol=2 ** -7, atol=1e-6)


def _within_one_ulp(got: torch.Tensor, want: torch.Tensor, min_exact: float) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **ONE_ULP)
    exact = (got == want).float().mean().item()
    assert exact >= min_exact, f"only {exact:.4f} of the values equal the reference's"


@pytest.mark.parametrize("rows,d", [(1, 16), (5, 17), (32, 256), (33, 640), (300, 1000)])
@pytest.mark.parametrize("weight,unit_offset", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_the_reference(rows, d, weight, unit_offset, residual):
    g = torch.Generator().manual_seed(rows * d)
    x = (torch.randn(rows, d, generator=g) * 3).bfloat16()
    w = (torch.randn(d, generator=g) * 0.5).bfloat16() if weight else None
    r = torch.randn(rows, d, generator=g).bfloat16() if residual else None
    p = RmsNormParams(eps=1e-6, unit_offset=unit_offset)
    scale = None if w is None else ref.norm_scale(w, unit_offset)
    got = elementwise.rms_norm(x, scale, p.eps, r)
    want = ref.norm_rms(x, w, p, r)
    if residual:
        assert torch.equal(got[1], want[1])  # h = x + residual, one rounding of the same sum
        got, want = got[0], want[0]
    _within_one_ulp(got, want, 0.99)


def test_rms_norm_strided_rows_and_leading_dims():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 3 * 256, generator=g).bfloat16()
    q = qkv[:, :512].view(6, 2, 256)  # rows with a stride, as q sliced from a fused q|k|v product
    scale = torch.rand(256, generator=g) + 0.5
    got = elementwise.rms_norm(q, scale, 1e-6)
    want = ref.norm_rms(q.contiguous(), None, RmsNormParams(eps=1e-6)) .float() * scale
    assert got.shape == (6, 2, 256)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("kind", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("rows,n", [(1, 7), (5, 2048), (33, 1408), (64, 100)])
def test_act_gated_matches_the_reference(kind, rows, n):
    g = torch.Generator().manual_seed(rows + n)
    gate = (torch.randn(rows, n, generator=g) * 3).bfloat16()
    up = torch.randn(rows, n, generator=g).bfloat16()
    got, want = elementwise.act_gated(gate, up, kind), ref.act_gated(gate, up, ActParams(kind))
    if kind == "silu":
        _within_one_ulp(got, want, 0.99)
        return
    torch.testing.assert_close(got.float(), want.float(), **ONE_ULP)
    x = gate.double()
    exact = ((0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))).bfloat16().double()
             * up.double()).bfloat16()
    _within_one_ulp(got, exact, 0.98)


@pytest.mark.parametrize("kind", ["gelu_tanh", "silu"])
def test_act_gated_at_extreme_inputs(kind):
    gate = torch.tensor([[-1e4, -200.0, -60.0, -9.0, -1e-3, 0.0, 1e-3, 9.0, 60.0, 200.0, 1e4, 3e38]]).bfloat16()
    up = torch.ones_like(gate)
    got, want = elementwise.act_gated(gate, up, kind), ref.act_gated(gate, up, ActParams(kind))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-20)  # torch: 0 at gelu(-9)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="needs bf16 CPU x"):
        elementwise.rms_norm(torch.zeros(2, 8), None, 1e-6)
    with pytest.raises(ValueError, match="kind in"):
        elementwise.act_gated(torch.zeros(2, 8).bfloat16(), torch.zeros(2, 8).bfloat16(), "relu")


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("t,h,d", [(1, 1, 32), (32, 5, 256), (7, 3, 40)])
def test_rope_neox_matches_the_reference_bit_for_bit(t, h, d, inverse):
    from inferhal.core.ops.params import RopeParams

    g = torch.Generator().manual_seed(t * h + d)
    x = torch.randn(t, h + 1, d, generator=g).bfloat16()[:, :h]  # strided heads, as q sliced from q|k
    pos = torch.randint(0, 500, (t,), generator=g)
    ang = torch.arange(500, dtype=torch.float)[:, None] * torch.rand(d // 2, generator=g)[None]
    cs = torch.cat((ang.cos(), ang.sin()), dim=-1)
    got = elementwise.rope_neox(x, pos, cs, inverse)
    # the same fp32 products and sums, each rounded as torch's (the kernel is built without FMA contraction)
    assert torch.equal(got, ref.rope_apply(x, pos, cs, RopeParams(rotary_dim=d, style="neox", inverse=inverse)))


def test_rope_position_outside_the_table_is_an_index_error():
    x = torch.zeros(2, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(IndexError, match=r"position 10 \(row 1\) is outside the table's 10 rows"):
        elementwise.rope_neox(x, torch.tensor([3, 10]), torch.zeros(10, 32))
    with pytest.raises(IndexError, match=r"position -1 \(row 0\)"):
        elementwise.rope_neox(x, torch.tensor([-1, 2]), torch.zeros(10, 32))
