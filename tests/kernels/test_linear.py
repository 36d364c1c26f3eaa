"""linear / lm_head / lm_head.argmax GEMM kernels vs the reference, in the interpreter.

The bf16 ``tl.dot`` trap (the interpreter multiplies bf16 bit patterns): the kernels upcast bf16 dot
operands to fp32 under the interpreter only (``common.dot_operand``, switched by ``INTERP``), so these tests
feed real bf16 tensors and still compare against the reference; compiled kernels keep bf16 operands.

Tolerances: the kernel rounds where the reference rounds (dequantised weights to the activation dtype,
the output once), so the difference left is the fp32 accumulation order, which can flip the output's
rounding: one bf16 ulp (``links=1``) relative to the output's magnitude; a dequantised weight adds one
more rounding on the way in (``links=2``). fp32 activations use IEEE dots (fp32 re-association only).
Shapes stay small (the tiny V4's and Gemma 3's widths, a few rows) and cross the interpreter's 32-wide
tiles on every edge.
"""

import pytest
import torch

from inferhal.backends.reference import ops as ref
from inferhal.core.ops.quantize import dequantize, quantize_fp4_group, quantize_fp8_block, quantize_int_block
from inferhal.core.ops.quant import QuantWeight
from inferhal.kernels.linear import linear, lm_head, lm_head_argmax
from inferhal.kernels.linear_lowp import act_quant, act_quant_fp4, linear_w4a4, linear_w8a8
from inferhal.kernels.tuning import config
from tests.kernels.conftest import check_row_moved


def data(t, n, k, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, k, generator=g).to(dtype), torch.randn(n, k, generator=g) / k**0.5, g


def weight(w, fmt, dtype):
    if fmt == "plain":
        return w.to(dtype)
    if fmt == "fp8_block":
        return quantize_fp8_block(w)
    if fmt == "fp8_e8m0":  # DeepSeek-V4's checkpoints: power-of-two block scales stored as ue8m0
        s = torch.exp2(torch.ceil(torch.log2(quantize_fp8_block(w).scale)))
        full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        return QuantWeight((w / full).to(torch.float8_e4m3fn), s.to(torch.float8_e8m0fnu), "fp8_block", tuple(w.shape))
    if fmt == "fp4_group":
        return quantize_fp4_group(w)
    if fmt == "fp4_e8m0":
        q = quantize_fp4_group(w)
        s = torch.exp2(torch.round(torch.log2(q.scale.float())))
        return QuantWeight(q.data, s.to(torch.float8_e8m0fnu), q.format, q.shape, q.block)
    if fmt == "int_block":
        return quantize_int_block(w)
    return quantize_int_block(w, 16, offset=True)


def scale_of(ref_out):
    return max(float(ref_out.float().abs().max()), 1.0) if ref_out.numel() else 1.0


@pytest.mark.parametrize("t,n,k,bias", [(1, 96, 64, False), (5, 200, 160, True), (33, 64, 96, False), (0, 32, 32, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_plain(t, n, k, bias, dtype, close):
    x, w, g = data(t, n, k, t + n, dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = ref.linear(x, w.to(dtype), b)
    close(linear(x, w.to(dtype), b), want, links=1, name="linear", scale=scale_of(want))


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_e8m0", "fp4_group", "fp4_e8m0", "int_block", "int_block+offset"])
@pytest.mark.parametrize("t,n,k", [(3, 160, 256), (9, 96, 128)])
def test_linear_quantised(fmt, t, n, k, close):
    x, w, _ = data(t, n, k, 3 * t + k, torch.bfloat16)
    q = weight(w, fmt, torch.bfloat16)
    want = ref.linear(x, q)
    close(linear(x, q), want, links=2, name=f"linear {fmt}", scale=scale_of(want))


def test_linear_batched_leading_dims_and_strided_weight(close):
    x, w, _ = data(6, 64, 96, 4, torch.bfloat16)
    wt = torch.cat([w, w], dim=1)[:, :96].to(torch.bfloat16)  # row stride 192
    x3 = x.view(2, 3, 96)
    want = ref.linear(x3, wt)
    close(linear(x3, wt), want, name="linear", scale=scale_of(want))


def test_linear_is_batch_invariant():
    x, w, _ = data(40, 96, 64, 2, torch.bfloat16)
    w = w.to(torch.bfloat16)
    full = linear(x, w)
    assert torch.equal(linear(x[:5], w), full[:5])
    cfg = config("gemm_decode")  # 40 rows: the decode kernel's tiles (its test module has more)
    check_row_moved(lambda rows: linear(rows, w), x, 7, full, (cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["N_TILES"]),
                    "linear", scale_of(full))


@pytest.mark.parametrize("fmt,dtype", [("plain", torch.bfloat16), ("plain", torch.float32), ("fp8_block", torch.bfloat16)])
def test_lm_head_into_buffer(fmt, dtype, close):
    x, w, _ = data(4, 1000, 64, 9, dtype)
    q = weight(w, fmt, dtype)
    buf = torch.full((4, 1000), float("nan"))
    got = lm_head(x, q, buf)
    want = ref.lm_head(x, q)
    assert got.data_ptr() == buf.data_ptr() and got.dtype == torch.float32
    close(got, want, links=1 if fmt == "plain" else 2, name=f"lm_head {fmt}", scale=scale_of(want))


@pytest.mark.parametrize("fmt", ["plain", "fp8_block", "fp4_group"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lm_head_argmax_equals_argmax_of_own_logits(fmt, dtype):
    """The fused argmax is the argmax (first index on ties) of this backend's own lm_head logits."""
    x, w, _ = data(7, 1000, 64, 5, dtype)
    q = weight(w, fmt, dtype)
    logits = lm_head(x, q)
    assert torch.equal(lm_head_argmax(x, q), ref.argmax_rows(logits))


def test_lm_head_argmax_ties_nan_and_planted_winners():
    x, w, _ = data(5, 300, 64, 6, torch.bfloat16)
    for i in range(5):  # planted winners, each with an exact copy at a higher index (a tie: lower index wins)
        w[10 + 20 * i] = x[i].float() * (4.0 / x[i].float().norm())
        w[250 + i] = w[10 + 20 * i]
    w = w.to(torch.bfloat16)
    assert lm_head_argmax(x, w).tolist() == [10, 30, 50, 70, 90]
    assert torch.equal(lm_head_argmax(x, w), ref.lm_head_argmax(x, w))
    w[200] = float("nan")  # NaN logits count as the largest (first NaN on several)
    w[100] = float("nan")
    assert lm_head_argmax(x, w).tolist() == [100] * 5


def test_fp8_activations_w8a8(close):
    """FP8 x FP8 (kind::f8f6f4 on SM100): against the reference product of the dequantised activations."""
    x, w, _ = data(9, 160, 256, 8, torch.bfloat16)
    q = quantize_fp8_block(w)
    xq, xs = act_quant(x)
    assert xq.dtype == torch.float8_e4m3fn and xs.shape == (9, 2)
    xd = (xq.float().view(9, 2, 128) * xs[..., None]).view(9, 256)
    assert (xd - x.float()).abs().max() <= x.float().abs().max() / 16  # e4m3: 3 mantissa bits
    want = (xd @ dequantize(q).T).to(torch.bfloat16)
    close(linear_w8a8(x, q), want, links=2, name="linear w8a8", scale=scale_of(want))


def test_fp8_activations_w8a8_at_decode_rows(close):
    """FP8 x FP8 at decode rows (linear's default path): the decode grid's N tiles and K splits of
    whole 128-wide scale blocks (here 4 splits, the partials summed in split order), against the quantised
    activations' oracle; a row prefix gives the same bits; past MAX_ROWS rows the tiled kernel."""
    from inferhal.kernels.linear_decode import decode_grid, linear_w8a8_decode

    x, w, _ = data(40, 96, 512, 6, torch.bfloat16)
    q = quantize_fp8_block(w)
    dec = config("gemm_decode")
    assert decode_grid(96, 512, {**dec, "BLOCK_K": 128})[1] == 4
    xq, xs = act_quant(x)
    want = ((xq.float().view(40, 4, 128) * xs[..., None]).view(40, 512) @ dequantize(q).T).to(torch.bfloat16)
    got = linear_w8a8_decode(x, q)
    close(got, want, links=2, name="linear w8a8 decode", scale=scale_of(want))
    assert torch.equal(linear(x, q, fp8="w8a8"), got)  # linear's default path
    assert torch.equal(linear_w8a8_decode(x[:5], q), got[:5])
    tiled = linear(x, q, fp8="w8a8", path="tiled")
    assert torch.equal(tiled, linear_w8a8(x, q))
    close(got, tiled, links=2, name="linear w8a8 decode vs tiled", scale=scale_of(want))
    big = torch.cat([x] * 4)[: dec["MAX_ROWS"] + 1]
    assert torch.equal(linear(big, q, fp8="w8a8"), linear_w8a8(big, q))


@pytest.mark.parametrize("layout", ["mxfp4", "nvfp4"])
def test_fp4_activations_w4a4(layout, close):
    """FP4 x FP4 (SM100: kind::mxf4 for MXFP4, kind::mxf4nvf4 for NVFP4). Activation scales: MXFP4 2^(floor(log2
    amax) - 2) (OCP MX), NVFP4 amax / 6 in e4m3; codes the nearest e2m1 of x / scale, saturated at 6. The
    product against the reference one of the dequantised activations. (The interpreter's dot_scaled misreads
    e4m3 scales: NVFP4 tiles are decoded to fp32 there, behind INTERP.)"""
    from inferhal.core.ops.quantize import unpack_e2m1

    group = 32 if layout == "mxfp4" else 16
    x, w, _ = data(5, 96, 128, 12, torch.bfloat16)
    x[0, :32] = 0.0  # all-zero groups
    if layout == "mxfp4":
        q = weight(w, "fp4_e8m0", torch.bfloat16)
    else:
        q4 = quantize_fp4_group(w, 16)
        q = QuantWeight(q4.data, q4.scale.to(torch.float8_e4m3fn), q4.format, q4.shape, q4.block)
    xq, xs = act_quant_fp4(x, group)
    ng = 128 // group
    scale = torch.exp2(xs.float() - 127) if layout == "mxfp4" else xs.float()  # [5, ng]
    full = scale.repeat_interleave(group, dim=1)
    xd = unpack_e2m1(xq) * full
    amax = x.float().view(5, ng, group).abs().amax(-1)
    if layout == "mxfp4":
        want_scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(amax)) - 2), torch.exp2(torch.tensor(-127.0)))
    else:
        want_scale = (amax / 6).to(torch.float8_e4m3fn).float()
    assert torch.equal(scale, want_scale)
    safe = torch.where(full > 0, full, torch.ones_like(full))
    y = torch.where(full > 0, x.float() / safe, torch.zeros_like(full)).clamp(-6, 6)
    step = torch.where(y.abs() < 2, 0.5, torch.where(y.abs() < 4, 1.0, 2.0))
    assert bool(((xd / safe - y).abs() <= step / 2 + 1e-5).all())  # the nearest e2m1 value (up to ties)
    want = (xd @ dequantize(q).T).to(torch.bfloat16)
    close(linear_w4a4(x, q), want, links=2, name=f"linear w4a4 {layout}", scale=scale_of(want))
