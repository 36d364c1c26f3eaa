"""moe.experts with MX-quantised expert weights on the 950 (W8A8MXFP: npu_dynamic_mx_quant activations, MXFP8
npu_grouped_matmul with e8m0 scales) over the documented fake NPU, compared with the reference, which dequantises
the weights and keeps activations in bf16 (so the two differ by the activations' e4m3 rounding). Level:
wired-unrun."""

from __future__ import annotations

import pytest
import torch

from inferhal.backends.ascend950 import mx
from inferhal.backends.ascend950.ops import NpuOps
from inferhal.backends.reference import moe as ref_moe
from inferhal.backends.reference.kv_records import e2m1_codes
from inferhal.core.ops.quantize import dequantize, quantize_fp4_group, quantize_fp8_block
from inferhal.core.ops.params import ExpertsParams
from inferhal.core.ops.quant import QuantWeight

BF16 = torch.bfloat16


def mxfp4(w: torch.Tensor) -> QuantWeight:
    """``[E, N, K]`` → fp4_group with e8m0 scales per 32 (2**ceil(log2(amax / 6)): MXFP4, V4's expert format)."""
    e, n, k = w.shape
    blocks = w.float().reshape(e, n, k // 32, 32)
    _, ex = torch.frexp(blocks.abs().amax(-1).clamp(min=1e-30) / 6)
    codes = e2m1_codes(blocks / torch.exp2(ex.float())[..., None]).reshape(e, n, k // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return QuantWeight(packed, (ex + 127).to(torch.uint8).view(torch.float8_e8m0fnu), "fp4_group", (e, n, k), (1, 32))


def case(g, d=128, inter=64, e=6, t=9, k=2):
    x = torch.randn(t, d, generator=g).to(BF16)
    wgu = torch.randn(e, 2 * inter, d, generator=g) * 0.1
    wd = torch.randn(e, d, inter, generator=g) * 0.1
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[0, 1] = e + 1  # an EP-remote expert: skipped
    return x, torch.rand(t, k, generator=g), ids, wgu, wd


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_pow2"])
def test_mx_experts_equal_reference(npu_ops, recorder, fmt):
    g = torch.Generator().manual_seed(0)
    x, w, ids, wgu, wd = case(g)
    if fmt == "mxfp4":
        qgu, qd = mxfp4(wgu), mxfp4(wd)
    else:  # 128x128 fp8 blocks with power-of-two fp32 scales: the MX form repeats each per 32 columns
        qgu, qd = (quantize_fp8_block(m) for m in (wgu, wd))
        qgu, qd = (QuantWeight(q.data, torch.exp2(torch.ceil(torch.log2(q.scale))), q.format, q.shape, q.block)
                   for q in (qgu, qd))
        qgu, qd = (QuantWeight((dequantize(q) / q.scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[
            ..., :q.shape[1], :q.shape[2]]).to(torch.float8_e4m3fn), q.scale, q.format, q.shape, q.block)
            for q in (qgu, qd))
    p = ExpertsParams(swiglu_limit=10.0)
    got = npu_ops.moe_experts(x, w, ids, qgu, qd, p)
    want = ref_moe.moe_experts(x, w, ids, qgu, qd, p)
    # e4m3 activations (3 mantissa bits, ~3 % RMS per quantisation, two of them) against bf16: ~7 % here; a
    # wrong scale layout or weight orientation gives errors of order 100 %
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 0.1, f"relative error {err:.3f} (activations in e4m3 against the reference's bf16)"
    assert not npu_ops.events
    assert recorder.ops_called() == ["npu_moe_init_routing_v2", "npu_dynamic_mx_quant", "npu_grouped_matmul",
                                     "npu_clipped_swiglu", "npu_dynamic_mx_quant", "npu_grouped_matmul",
                                     "npu_moe_finalize_routing"]
    gmm1 = recorder.calls[2]
    assert gmm1.tensor("x")[0].dtype == "float8_e4m3fn" and gmm1.args["weight"][0].shape == (6, 128, 128)
    assert gmm1.args["scale"][0].shape == (6, 2, 128, 2) and gmm1.args["scale"][0].dtype == "float8_e8m0fnu"
    assert gmm1.args["per_token_scale"][0].shape == (18, 2, 2) and gmm1.args["output_dtype"] == 15  # ScalarType bf16
    assert gmm1.args["scale_dtype"] == gmm1.args["per_token_scale_dtype"] == 293  # torch_npu.float8_e8m0fnu
    npu_ops.moe_experts(x, w, ids, qgu, qd, p)  # converted once per weight
    assert len(npu_ops._mx_cache) == 2


def test_mxfp4_conversion_is_exact():
    g = torch.Generator().manual_seed(1)
    q = mxfp4(torch.randn(3, 8, 64, generator=g))
    data, scale = mx.mx_weight(q)
    back = data.float().transpose(1, 2) * torch.exp2(scale.view(torch.uint8).float() - 127).transpose(1, 2).reshape(
        3, 8, 2).repeat_interleave(32, -1)
    assert torch.equal(back, dequantize(q))


@pytest.mark.parametrize("why,make", [
    ("fp4_group scales that are not powers of two", lambda wgu, wd: (quantize_fp4_group(wgu), mxfp4(wd))),
    ("K = 96", lambda wgu, wd: (mxfp4(wgu), mxfp4(wd))),
    ("a bf16 weight beside a quantised one", lambda wgu, wd: (mxfp4(wgu), wd.to(BF16))),
])
def test_non_mx_experts_fall_back_per_call_and_say_why(npu_ops, recorder, why, make):
    g = torch.Generator().manual_seed(2)
    x, w, ids, wgu, wd = case(g, d=96 if why == "K = 96" else 128)
    qgu, qd = make(wgu, wd)
    p = ExpertsParams()
    assert torch.equal(npu_ops.moe_experts(x, w, ids, qgu, qd, p), ref_moe.moe_experts(x, w, ids, qgu, qd, p))
    assert len(npu_ops.events) == 1 and npu_ops.events[0][0] == "moe.experts" and why in npu_ops.events[0][1]
    assert not recorder.calls


def test_mx_experts_need_the_950(recorder):
    g = torch.Generator().manual_seed(3)
    x, w, ids, wgu, wd = case(g)
    a3 = NpuOps(recorder, features={"sparse_attn_sharedkv"})
    a3.moe_experts(x, w, ids, mxfp4(wgu), mxfp4(wd), ExpertsParams())
    assert "950 only" in a3.events[0][1] and not recorder.calls
