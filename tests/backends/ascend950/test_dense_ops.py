"""Dense and sampling wrappers of ascend950 (aten operators on the npu device, npu_swiglu) and MC2
moe.dispatch / moe.combine through the op table, on the documented fake NPU: each call checked against its
recorded signature, each result compared with the reference. Level: wired-unrun."""

from __future__ import annotations

import pytest
import torch

from inferhal.backends.ascend950.ep import Mc2Handle
from inferhal.backends.ascend950.ops import NpuOps
from inferhal.backends.reference import ep as ref_ep
from inferhal.backends.reference import ops as ref
from inferhal.backends.reference import spec as ref_spec
from inferhal.backends.reference.comm import SingleProcessCommunicator
from inferhal.backends.reference.kv_records import e2m1_codes
from inferhal.core.ops.quantize import dequantize, quantize_fp4_group, quantize_fp8_block
from inferhal.core.backend import ParallelLayout
from inferhal.core.ops.params import ActParams, EPParams, SampleBatch
from inferhal.core.ops.quant import QuantWeight

BF16 = torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_linear_and_heads(npu_ops, recorder, dtype):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 32, generator=g).to(dtype), torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    tol = 1e-4 if dtype == torch.float32 else 0.1  # the reference's product may sum in another order
    assert (npu_ops.linear(x, w, b).float() - ref.linear(x, w, b).float()).abs().max() <= tol
    out = torch.empty(5, 48)
    got = npu_ops.lm_head(x, w, out)
    assert got is out and (got - ref.lm_head(x, w)).abs().max() <= tol
    assert torch.equal(npu_ops.lm_head_argmax(x, w), ref.lm_head_argmax(x, w))
    assert recorder.ops_called() == ["aten_linear", "aten_linear", "aten_linear", "aten_argmax"]
    assert recorder.calls[0].tensor("weight").dtype == str(dtype).removeprefix("torch.")
    qw = quantize_fp4_group(w)
    assert torch.equal(npu_ops.linear(x, qw), ref.linear(x, qw)) and "fp4_group" in npu_ops.events[-1][1]


def pow2_fp8_block(w: torch.Tensor) -> QuantWeight:
    """128x128 fp8 blocks with power-of-two fp32 scales (DeepSeek's ue8m0 FP8 weights)."""
    q = quantize_fp8_block(w)
    sc = torch.exp2(torch.ceil(torch.log2(q.scale)))
    full = sc.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
    return QuantWeight((w.float() / full).to(torch.float8_e4m3fn), sc, "fp8_block", q.shape, q.block)


def mxfp4_linear(w: torch.Tensor) -> QuantWeight:
    """``[N, K]`` → fp4_group with e8m0 scales 2**ceil(log2(amax / 6)) per 32 (MXFP4)."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    _, ex = torch.frexp(blocks.abs().amax(-1).clamp(min=1e-30) / 6)
    codes = e2m1_codes(blocks / torch.exp2(ex.float())[..., None]).reshape(n, k // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return QuantWeight(packed, (ex + 127).to(torch.uint8).view(torch.float8_e8m0fnu), "fp4_group", (n, k), (1, 32))


@pytest.mark.parametrize("fmt", ["fp8_pow2", "mxfp4"])
def test_mx_linear_is_w8a8_mxfp8_through_npu_quant_matmul(npu_ops, recorder, fmt):
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(7, 192, generator=g).to(BF16), torch.randn(160, 192, generator=g) * 0.1, torch.randn(160)
    qw = pow2_fp8_block(w) if fmt == "fp8_pow2" else mxfp4_linear(w)
    got, want = npu_ops.linear(x, qw, b), ref.linear(x, qw, b)
    assert not npu_ops.events and got.dtype == BF16
    # e4m3 activations against the reference's bf16: a few % of the output's norm (a wrong layout: ~100 %)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 0.05, f"relative error {err:.3f}"
    # exactly what the fake's operators compute: x's MX codes and scales times the dequantised weight
    xq, xs = recorder.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn)
    xd = xq.float() * torch.exp2(xs.view(torch.uint8).float() - 127).reshape(7, 6).repeat_interleave(32, -1)
    exact = (xd @ dequantize(qw).float().T + b).to(BF16)
    assert (got.float() - exact.float()).abs().max() <= 0.01 * exact.float().abs().max()
    assert recorder.ops_called()[:2] == ["npu_dynamic_mx_quant", "npu_quant_matmul"]
    c = recorder.calls[1]
    assert c.tensor("x2").shape == (192, 160) and not c.tensor("x2").contiguous
    assert c.tensor("scale").shape == (3, 160, 2) and c.tensor("pertoken_scale").shape == (7, 3, 2)
    assert c.args["group_sizes"] == (1, 1, 32) and c.args["scale_dtype"] == 293 and c.args["output_dtype"] == 15
    npu_ops.linear(x, qw, b)
    assert len(npu_ops._mx_cache) == 1  # converted once per weight


@pytest.mark.parametrize("why,make,features", [
    ("fp8_block scales that are not powers of two", lambda w: quantize_fp8_block(w), None),
    ("K = 96", lambda w: pow2_fp8_block(w[:, :96]), None),
    ("950 only", pow2_fp8_block, {"sparse_attn_sharedkv"}),
])
def test_non_mx_linears_fall_back_saying_why(recorder, why, make, features):
    ops = NpuOps(recorder, features=features)
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 192, generator=g)
    qw = make(w)
    x = torch.randn(3, qw.shape[1], generator=g).to(BF16)
    assert torch.equal(ops.linear(x, qw), ref.linear(x, qw))
    assert ops.events[-1][0] == "linear" and why in ops.events[-1][1] and not recorder.calls


def test_embed_and_act(npu_ops, recorder):
    g = torch.Generator().manual_seed(1)
    table, ids = torch.randn(20, 8, generator=g).to(BF16), torch.tensor([3, 0, 19, 3])
    assert torch.equal(npu_ops.embed(ids, table, 8 ** 0.5), ref.embed(ids, table, 8 ** 0.5))
    gate, up = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
    assert torch.allclose(npu_ops.act_gated(gate, up, ActParams()), ref.act_gated(gate, up, ActParams()), atol=1e-6)
    assert recorder.ops_called() == ["aten_embedding", "npu_swiglu"]
    p = ActParams(kind="gelu_tanh")
    for dtype in (torch.float32, BF16):
        got, want = npu_ops.act_gated(gate.to(dtype), up.to(dtype), p), ref.act_gated(gate.to(dtype), up.to(dtype), p)
        assert (got.float() - want.float()).abs().max() <= (1e-6 if dtype == torch.float32 else 0.05)
    assert recorder.calls[-1].op == "npu_gelu" and recorder.calls[-1].args["approximate"] == "tanh"
    assert not npu_ops.events


def test_topk_select_ties_and_padding(npu_ops, recorder):
    scores = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 0.5], [2.0, 2.0, 2.0, 2.0, 2.0]])
    for valid in (None, torch.tensor([5, 2])):
        for k in (3, 7):
            assert torch.equal(npu_ops.topk_select(scores, k, valid), ref.topk_select(scores, k, valid))
    assert recorder.calls[0].op == "aten_sort_stable" and recorder.calls[0].args["stable"] is True


def test_sample_greedy_and_seeded(npu_ops, recorder):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=g)
    greedy = SampleBatch((0.0,) * 4, (0,) * 4, (1.0,) * 4)
    assert torch.equal(npu_ops.sample(logits, greedy), ref.sample(logits, greedy))

    def batch(seed):
        gens = tuple(torch.Generator().manual_seed(seed + i) for i in range(4))
        return SampleBatch((0.0, 0.7, 1.0, 1.3), (0, 5, 0, 10), (1.0, 0.9, 0.8, 1.0), gens)

    assert torch.equal(npu_ops.sample(logits, batch(7)), ref.sample(logits, batch(7)))
    assert set(recorder.ops_called()) == {"aten_argmax", "aten_multinomial"}


def test_spec_verify_greedy_and_fallback(npu_ops, recorder):
    g = torch.Generator().manual_seed(3)
    target = torch.randn(3, 4, 30, generator=g)
    best = target.argmax(-1)
    drafts = best[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % 30  # row 1 rejects at its second draft
    drafts[2, 0] = (drafts[2, 0] + 1) % 30
    greedy = SampleBatch((0.0,) * 3, (0,) * 3, (1.0,) * 3)
    got, want = npu_ops.spec_verify(drafts, None, target, greedy), ref_spec.spec_verify(drafts, None, target, greedy)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1].tolist() == [4, 2, 1]
    assert recorder.ops_called() == ["aten_argmax"] and not npu_ops.events
    npu_ops.spec_verify(drafts, None, target, SampleBatch((1.0,) * 3, (0,) * 3, (1.0,) * 3))
    assert npu_ops.events[-1][0] == "spec.verify"


# ------------------------------------------------------------------------------------------ MC2 through the table


def ep_case(g, t=5, d=32, e=8, k=2):
    x = torch.randn(t, d, generator=g).to(BF16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[2, 1] = -1  # a filler choice
    ids[4] = -1  # a filler row (an empty shard's)
    return x, ids, torch.rand(t, k, generator=g), EPParams(ep_size=1, num_physical=e)


def run_ep(dispatch, combine, x, ids, w, comm, p):
    sent = dispatch(x, ids, comm, p)
    y_local = sent.x.float() * (sent.local_ids.float()[:, None] + 1)  # a per-expert function of each row
    return sent, combine(y_local.to(x.dtype), w, sent.handle, comm, p)


def test_moe_dispatch_and_combine_reach_mc2(recorder):
    ops = NpuOps(recorder, group_name=lambda comm: "hccl_ep")
    g = torch.Generator().manual_seed(4)
    x, ids, w, p = ep_case(g)
    comm = SingleProcessCommunicator(ParallelLayout())
    sent, y = run_ep(ops.moe_dispatch, ops.moe_combine, x, ids, w, comm, p)
    sent_r, y_r = run_ep(ref_ep.moe_dispatch, ref_ep.moe_combine, x, ids, w, comm, p)
    # the filler choice (id -1) travels to one of the rank's own slots with weight 0; the filler-only row 4
    # is left out by x_active_mask
    assert isinstance(sent.handle, Mc2Handle) and sent.x.shape == (8, 32) and sent_r.x.shape == (7, 32)
    assert sent.handle.active.tolist() == [True, True, True, True, False]
    assert (y.float() - y_r.float()).abs().max() <= 0.01 * y_r.float().abs().max()  # bf16 weights in the combine
    assert recorder.ops_called() == ["npu_moe_distribute_dispatch", "npu_moe_distribute_combine"]
    d = recorder.calls[0]
    assert d.args["group_ep"] == "hccl_ep" and d.args["moe_expert_num"] == 8 and d.tensor("expert_ids").dtype == "int32"
    assert not ops.events


def test_moe_dispatch_falls_back_on_every_rank_alike(recorder):
    g = torch.Generator().manual_seed(5)
    x, ids, w, p = ep_case(g)
    comm = SingleProcessCommunicator(ParallelLayout())
    ops = NpuOps(recorder)  # one process: no HCCL group
    _, y = run_ep(ops.moe_dispatch, ops.moe_combine, x, ids, w, comm, p)
    _, y_r = run_ep(ref_ep.moe_dispatch, ref_ep.moe_combine, x, ids, w, comm, p)
    assert torch.equal(y, y_r) and [e[0] for e in ops.events] == ["moe.dispatch", "moe.combine"]
    ops = NpuOps(recorder, group_name=lambda comm: "hccl_ep")
    _, y = run_ep(ops.moe_dispatch, ops.moe_combine, x.float(), ids, w, comm, p)
    assert "dtype" in ops.events[0][1] and not recorder.calls
