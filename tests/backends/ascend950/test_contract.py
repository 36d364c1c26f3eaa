"""Recorded contract: every torch_npu call the ascend950 wrappers make, checked against the documented
signatures and preconditions (backends/ascend950/contract.py), with the fake's results compared to the
reference ops. Proves the wiring is well-formed; does not prove what the real operators compute."""

from __future__ import annotations

import math

import pytest
import torch

from inferhal.backends.ascend950.contract import PARSED, SCHEMAS, ContractError, RecordingNpu, bind
from inferhal.backends.ascend950.device import AscendKVStorage
from inferhal.backends.ascend950.ops import NPU_OPS
from inferhal.backends.reference import attention as ref_attn
from inferhal.backends.reference import moe as ref_moe
from inferhal.backends.reference import ops as ref
from inferhal.core.ops.quantize import quantize_fp4_group
from inferhal.core.backend import KVGroupLayout, KVStorageRequest
from inferhal.core.ops.params import (AttnBatch, AttnParams, ExpertsParams, KVWriteParams, RmsNormParams,
                                      RopeParams, RouteParams)

BF16 = torch.bfloat16


def close(a, b, tol):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol, f"max abs error {err} > {tol}"


# ------------------------------------------------------------------------------------------ the table


def test_every_schema_parses_and_every_wired_operator_is_documented():
    from inferhal.backends.ascend950.contract import NAMESPACES, citation
    from inferhal.backends.ascend950.operators import aten_overload

    for op, params in PARSED.items():
        assert params, op
        if NAMESPACES.get(op) == "aten":  # key aten_<name>[_<overload>], the schema keeps PyTorch's own name
            base, overload = aten_overload(op)
            assert op == "aten_" + base + ("" if overload == "default" else "_" + overload)
        else:
            assert SCHEMAS[op].startswith(op + "(")
        assert citation(op), op
    for ops in NPU_OPS.values():
        for op in ops:
            assert op in SCHEMAS, f"{op} is called but not in the contract table"
            assert any(src in citation(op) for src in ("vllm-ascend", "torch-npu", "PyTorch", "hiascend.com")), op


def test_bind_rejects_bad_calls():
    x, g = torch.zeros(2, 8), torch.zeros(8)
    bind("npu_rms_norm", (x, g), {"epsilon": 1e-6})
    with pytest.raises(ContractError, match="unknown keyword 'eps'"):
        bind("npu_rms_norm", (x, g), {"eps": 1e-6})
    with pytest.raises(ContractError, match="required argument 'gamma'"):
        bind("npu_rms_norm", (x,), {})
    with pytest.raises(ContractError, match="positional"):  # keyword-only after '*'
        bind("npu_moe_gating_top_k", (x, 2, None), {})
    with pytest.raises(ContractError, match="must be int"):
        bind("npu_moe_gating_top_k", (x, 2.0), {})
    with pytest.raises(ContractError, match="not in the documented contract"):
        bind("npu_made_up", (), {})


def test_precondition_violation_is_caught(recorder):
    x = torch.zeros(2, 8, dtype=BF16)
    with pytest.raises(ContractError, match="gamma must have the input's dtype"):
        recorder.npu_rms_norm(x, torch.zeros(8), epsilon=1e-6)


def test_grouped_matmul_output_dtype_is_a_scalar_type_value(recorder):
    # torch_npu 2.13's gmm_get_dtype takes ScalarType values (bf16 15); aclDataType's ACL_BF16 (27) is refused
    x, w, gl = torch.zeros(4, 8, dtype=BF16), torch.zeros(2, 8, 16, dtype=BF16), torch.tensor([3, 1])
    gmm = dict(group_list=gl, split_item=2, group_type=0, group_list_type=1)
    with pytest.raises(ContractError, match="not an aclDataType code"):
        recorder.npu_grouped_matmul([x], [w], output_dtype=27, **gmm)
    assert recorder.npu_grouped_matmul([x], [w], output_dtype=15, **gmm)[0].dtype == BF16


# ------------------------------------------------------------------------------------------ norm / rope


@pytest.mark.parametrize("unit_offset", [False, True])
def test_norm_rms(npu_ops, recorder, unit_offset):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(BF16)
    w = torch.randn(64, generator=g)
    p = RmsNormParams(eps=1e-5, unit_offset=unit_offset)
    close(npu_ops.norm_rms(x, w, p), ref.norm_rms(x, w, p), 0.07)
    res = torch.randn(5, 64, generator=g).to(BF16)
    y, h = npu_ops.norm_rms(x, w, p, res)
    y_ref, h_ref = ref.norm_rms(x, w, p, res)
    close(y, y_ref, 0.07)
    close(h, h_ref, 0)
    c0, c1 = recorder.calls
    assert (c0.op, c1.op) == ("npu_rms_norm", "npu_add_rms_norm")
    assert c0.tensor("gamma").dtype == "bfloat16" and c0.tensor("gamma").shape == (64,)
    assert c0.args["epsilon"] == 1e-5


@pytest.mark.parametrize("style,placement,inverse", [("neox", "head", False), ("interleaved", "tail", False),
                                                      ("neox", "tail", True)])
def test_rope(npu_ops, recorder, style, placement, inverse):
    g = torch.Generator().manual_seed(1)
    t, h, d, r = 6, 3, 32, 16
    x = torch.randn(t, h, d, generator=g)
    pos = torch.tensor([0, 5, 2, 9, 3, 1])
    ang = torch.arange(12)[:, None] * (1.0 / 10000 ** (torch.arange(r // 2) / (r // 2)))[None]
    cos_sin = torch.cat((ang.cos(), ang.sin()), -1)
    p = RopeParams(rotary_dim=r, style=style, placement=placement, inverse=inverse)
    close(npu_ops.rope_apply(x, pos, cos_sin, p), ref.rope_apply(x, pos, cos_sin, p), 1e-5)
    (c,) = recorder.calls
    assert c.op == "npu_rotary_mul" and c.tensor("self").shape == (1, t, h, r) and c.tensor("r1").shape == (1, t, 1, r)
    assert c.args["rotary_mode"] == ("half" if style == "neox" else "interleave")


# ------------------------------------------------------------------------------------------ attention / KV


def _paged(bs, lens, new, hk, d, shared, g, nb=12):
    """A KV cache filled with random entries, block tables, and the AttnBatch of one step."""
    slot = (hk, d) if shared else (2, hk, d)
    store = AscendKVStorage(KVStorageRequest(nb, bs, (KVGroupLayout("g", (0,), bs, slot, BF16),)), "cpu")
    cache = store.layer_cache("g", 0)
    cache.copy_(torch.randn(cache.shape, generator=g).to(BF16))
    perm = torch.randperm(nb, generator=g).tolist()
    m = max(math.ceil(n / bs) for n in lens)
    table = torch.full((len(lens), m), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(math.ceil(n / bs)):
            table[b, j] = perm.pop()
    qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(new), 0)), dtype=torch.int32)
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, new)])
    batch = AttnBatch(qsl, torch.tensor(lens), positions, table, torch.zeros(int(qsl[-1]), dtype=torch.long))
    return cache, batch


@pytest.mark.parametrize("shared,window,sinks", [(False, 0, False), (True, 0, True), (False, 24, False)])
def test_attn_decode(npu_ops, recorder, shared, window, sinks):
    g = torch.Generator().manual_seed(2)
    h, hk, d, bs = 8, 2, 32, 16
    cache, batch = _paged(bs, [37, 5, 60], [1, 1, 1], hk, d, shared, g)
    q = torch.randn(3, h, d, generator=g).to(BF16)
    p = AttnParams(scale=d ** -0.5, num_kv_heads=hk, window=window, shared_kv=shared)
    s = torch.randn(h, generator=g).to(BF16) if sinks else None
    close(npu_ops.attn_paged(q, cache, batch, p, s), ref_attn.attn_paged(q, cache, batch, p, s), 0.02)
    assert not npu_ops.events, npu_ops.events
    (c,) = recorder.calls
    assert c.op == "npu_fused_infer_attention_score" + ("_v2" if sinks else "")
    assert c.tensor("query").shape == (3, 1, h, d) and c.args["input_layout"] == "BSND"
    assert c.tensor("key").shape == (12, bs, hk * d) and c.tensor("key").contiguous  # no copy of the cache
    assert c.tensor("block_table").dtype == "int32"
    assert list(c.args["actual_seq_kvlen" if sinks else "actual_seq_lengths_kv"]) == [37, 5, 60]
    assert (c.args.get("atten_mask") is not None) == (window > 0)


@pytest.mark.parametrize("window", [0, 40])
def test_attn_prefill_per_sequence(npu_ops, recorder, window):
    g = torch.Generator().manual_seed(3)
    h, hk, d, bs = 4, 4, 16, 128
    cache, batch = _paged(bs, [150, 70], [20, 70], hk, d, False, g, nb=4)
    q = torch.randn(90, h, d, generator=g).to(BF16)
    p = AttnParams(scale=0.25, num_kv_heads=hk, window=window)
    close(npu_ops.attn_paged(q, cache, batch, p), ref_attn.attn_paged(q, cache, batch, p), 0.02)
    assert [c.op for c in recorder.calls] == ["npu_fused_infer_attention_score"] * 2
    c = recorder.calls[0]
    assert c.args["sparse_mode"] == (4 if window else 3) and c.tensor("atten_mask").shape == (2048, 2048)
    assert list(c.args["actual_seq_lengths"]) == [20] and list(c.args["actual_seq_lengths_kv"]) == [150]
    if window:
        assert (c.args["pre_tokens"], c.args["next_tokens"]) == (window - 1, 0)


def test_attn_falls_back_visibly(npu_ops, recorder):
    g = torch.Generator().manual_seed(4)
    cache, batch = _paged(16, [20, 9], [4, 9], 2, 32, True, g)  # prefill with 16-token blocks
    q = torch.randn(13, 4, 32, generator=g).to(BF16)
    p = AttnParams(scale=0.2, num_kv_heads=2, shared_kv=True)
    close(npu_ops.attn_paged(q, cache, batch, p), ref_attn.attn_paged(q, cache, batch, p), 0)
    assert npu_ops.events and "block_size % 128" in npu_ops.events[0][1] and not recorder.calls
    soft = AttnParams(scale=0.2, num_kv_heads=2, shared_kv=True, softcap=30.0)
    npu_ops.attn_paged(q, cache, batch, soft)
    assert "softcap" in npu_ops.events[-1][1]


def test_kv_write_planes_and_latent(npu_ops, recorder):
    g = torch.Generator().manual_seed(5)
    cache, _ = _paged(16, [16], [1], 2, 32, False, g, nb=4)
    vals = torch.randn(5, 2, 2, 32, generator=g).to(BF16)
    slots = torch.tensor([3, -1, 17, 40, 63])
    expect = cache.clone()
    ref.kv_write(vals, expect, slots)
    npu_ops.kv_write(vals, cache, slots)
    assert torch.equal(cache, expect)
    c = recorder.calls[-1]
    assert c.op == "npu_scatter_pa_kv_cache" and c.args["cache_mode"] == "Norm"
    assert c.tensor("key").shape == (4, 2, 32) and c.tensor("key_cache").shape == (4, 16, 2, 32)
    assert c.tensor("slot_mapping").dtype == "int32"
    latent, _ = _paged(16, [16], [1], 1, 64, True, g, nb=4)
    lv = torch.randn(3, 1, 64, generator=g).to(BF16)
    expect = latent.clone()
    ref.kv_write(lv, expect, torch.tensor([0, 9, 33]))
    npu_ops.kv_write(lv, latent, torch.tensor([0, 9, 33]))
    assert torch.equal(latent, expect) and recorder.calls[-1].op == "npu_scatter_nd_update_"
    npu_ops.kv_write(lv, latent, torch.tensor([0, 9, 33]), KVWriteParams(quant="fp8"), torch.zeros(4, 16))
    assert npu_ops.events[-1][0] == "kv.write"
    # FP4 KV records: no Ascend operator writes them; the reference does, visibly (FP8: test_kv_quant.py)
    from inferhal.core.paging import formats

    fmt = formats.record("fp4", 64, 16, role="main")
    rec, expect = (torch.zeros(4, 16, fmt.nbytes, dtype=torch.uint8) for _ in range(2))
    n = len(recorder.calls)
    npu_ops.kv_write(lv[:, 0], rec, torch.tensor([0, 9, 33]), KVWriteParams(record=fmt))
    ref.kv_write(lv[:, 0], expect, torch.tensor([0, 9, 33]), KVWriteParams(record=fmt))
    assert torch.equal(rec, expect) and len(recorder.calls) == n
    assert npu_ops.events[-1] == ("kv.write", "nvfp4 records of 64 dims (0 RoPE): kv_compress_epilog writes 448 "
                                              "e4m3 + 64 bf16 RoPE channels with e8m0 scales per 64")


# ------------------------------------------------------------------------------------------ MoE


@pytest.mark.parametrize("scoring,with_bias", [("softmax", False), ("sigmoid", True)])
def test_moe_route(npu_ops, recorder, scoring, with_bias):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(9, 32, generator=g)
    bias = torch.randn(32, generator=g) * 0.1 if with_bias else None
    p = RouteParams(top_k=4, scoring=scoring, routed_scaling=1.5)
    w, ids = npu_ops.moe_route(logits, p, bias)
    w_ref, ids_ref = ref_moe.moe_route(logits, p, bias)
    order, order_ref = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices), 1e-6)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    c = recorder.calls[-1]
    assert c.op == "npu_moe_gating_top_k" and c.args["norm_type"] == {"softmax": 0, "sigmoid": 1}[scoring]
    npu_ops.moe_route(logits, RouteParams(top_k=4, scoring="sqrtsoftplus"))
    assert recorder.calls[-1].op == "moe_gating_top_k_hash" and not npu_ops.events  # V4 scoring: tests/.../test_v4_ops.py


@pytest.mark.parametrize("limit", [0.0, 1.0])
def test_moe_experts(npu_ops, recorder, limit):
    g = torch.Generator().manual_seed(7)
    t, d, inter, e, k = 7, 32, 16, 6, 3
    x = torch.randn(t, d, generator=g).to(BF16)
    wgu = (torch.randn(e, 2 * inter, d, generator=g) * 0.2).to(BF16)
    wd = (torch.randn(e, d, inter, generator=g) * 0.2).to(BF16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[0, 1] = e + 2  # an EP-remote expert: skipped
    w = torch.rand(t, k, generator=g)
    p = ExpertsParams(swiglu_limit=limit)
    close(npu_ops.moe_experts(x, w, ids, wgu, wd, p), ref_moe.moe_experts(x, w, ids, wgu, wd, p), 0.03)
    assert recorder.ops_called() == ["npu_moe_init_routing_v2", "npu_grouped_matmul",
                                     "npu_clipped_swiglu" if limit else "npu_swiglu", "npu_grouped_matmul",
                                     "npu_moe_finalize_routing"]
    init, gmm1 = recorder.calls[0], recorder.calls[1]
    assert init.tensor("expert_idx").dtype == "int32" and init.args["active_expert_range"] == (0, e)
    assert gmm1.args["weight"][0].shape == (e, d, 2 * inter) and gmm1.args["group_list_type"] == 1
    qw = quantize_fp4_group(wgu.float())
    npu_ops.moe_experts(x, w, ids, qw, wd, p)
    assert "gate/up: K = 32: MX scales come in pairs" in npu_ops.events[-1][1]  # MX experts: test_moe_mx.py


def test_recorder_wraps_any_module_without_importing_torch_npu():
    import sys

    assert "torch_npu" not in sys.modules
    rec = RecordingNpu(type("M", (), {"npu_swiglu": staticmethod(lambda x, dim=-1: x)})())
    rec.npu_swiglu(torch.zeros(2, 4), dim=-1)
    assert rec.calls[0].args["dim"] == -1
