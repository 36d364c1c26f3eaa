"""DeepSeek-V4 wrappers of ascend950 (indexer, sparse attention over shared KV, mHC, sqrtsoftplus / hash
routing) on the documented fake NPU: every call checked against its recorded signature and preconditions,
every result compared with the reference op. Level: wired-unrun (no Ascend device, no CANN here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inferhal.backends.ascend950.ops import NpuOps
from inferhal.backends.reference import deepseek as ref_ds
from inferhal.backends.reference import kv_records
from inferhal.backends.reference import mhc as ref_mhc
from inferhal.backends.reference import moe as ref_moe
from inferhal.core.ops.params import AttnBatch, AttnParams, IndexerParams, MhcParams, RouteParams
from inferhal.core.paging.formats import record

BF16 = torch.bfloat16


def paged(total: list[int], new: list[int], bs: int, per: int, g: torch.Generator, width: int | None = None):
    """An AttnBatch of sequences with ``total`` entries each (``new`` of them this step, the last ones), every
    entry ``per`` tokens (a compressed group when per > 1), in shuffled blocks of ``bs``."""
    blocks = [-(-n // bs) for n in total]
    perm = torch.randperm(sum(blocks), generator=g)
    m = width or max(blocks)
    table = torch.full((len(total), m), -1, dtype=torch.long)
    at = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[at:at + n]
        at += n
    qsl = torch.tensor([0] + list(torch.tensor(new).cumsum(0).tolist()))
    pos = torch.cat([torch.arange(t - n, t) for t, n in zip(total, new)])
    return AttnBatch(qsl, torch.tensor(total), pos, table, torch.zeros(len(pos), dtype=torch.long), per), sum(blocks)


def close(a, b, tol):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol, f"max abs error {err} > {tol}"


# ------------------------------------------------------------------------------------------ indexer.scores


def indexer_case(g, hi=16, di=16, dtype=BF16):
    tokens = [40, 25]
    tbatch, _ = paged(tokens, [3, 1], 16, 1, g)
    m = 4
    batch, nblocks = paged([t // m for t in tokens], [3, 1], 16, m, g)
    batch = AttnBatch(batch.query_start_loc, batch.seq_lens, tbatch.positions, batch.block_table,
                      batch.slot_mapping, m)
    keys = torch.randn(nblocks, 16, di, generator=g).to(dtype)
    q = torch.randn(4, hi, di, generator=g).to(dtype)
    w = torch.randn(4, hi, generator=g)
    return q, keys, batch, w, IndexerParams(scale=di ** -0.5, weight_scale=hi ** -0.5)


def test_indexer_scores_equal_reference(npu_ops, recorder):
    g = torch.Generator().manual_seed(0)
    q, keys, batch, w, p = indexer_case(g)
    got, want = npu_ops.indexer_scores(q, keys, batch, w, p), ref_ds.indexer_scores(q, keys, batch, w, p)
    # S = the block table's reach (1 block x 16 entries) > max(seq_lens) = 10: the extra columns are -inf
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and got.shape == want.shape == (4, 16)
    assert torch.isneginf(got[:, 10:]).all()
    fin = ~torch.isinf(want)
    close(got[fin], want[fin], 0.02 * want[fin].abs().max().item())  # weights are rounded to bf16
    assert not npu_ops.events
    c = recorder.calls[-1]
    assert c.op == "npu_lightning_indexer" and c.args["layout_query"] == "TND" and c.args["return_value"] is True
    assert c.tensor("query").shape == (4, 16, 128) and c.tensor("key").shape == (16, 1, 128)  # 10 + 6 entries
    assert c.args["sparse_count"] == 10 and c.args["sparse_mode"] == 0


def test_indexer_pads_heads_to_an_allowed_count(npu_ops, recorder):
    g = torch.Generator().manual_seed(1)
    q, keys, batch, w, p = indexer_case(g, hi=12, di=32)
    got, want = npu_ops.indexer_scores(q, keys, batch, w, p), ref_ds.indexer_scores(q, keys, batch, w, p)
    fin = ~torch.isinf(want)
    close(got[fin], want[fin], 0.02 * want[fin].abs().max().item())
    assert recorder.calls[-1].tensor("query").shape == (4, 16, 128)


@pytest.mark.parametrize("case,why", [("fp32", "one fp16/bf16 dtype"), ("heads", "<= 64 heads")])
def test_indexer_falls_back_visibly(npu_ops, recorder, case, why):
    g = torch.Generator().manual_seed(2)
    q, keys, batch, w, p = indexer_case(g, hi=80 if case == "heads" else 16,
                                        dtype=torch.float32 if case == "fp32" else BF16)
    assert torch.equal(npu_ops.indexer_scores(q, keys, batch, w, p), ref_ds.indexer_scores(q, keys, batch, w, p))
    assert npu_ops.events[-1][0] == "indexer.scores" and why in npu_ops.events[-1][1] and not recorder.calls


@pytest.mark.parametrize("di", [128, 32])
def test_indexer_fp8_keys_reach_the_operator_and_equal_reference(npu_ops, recorder, di):
    g = torch.Generator().manual_seed(3)
    q, keys, batch, w, p = indexer_case(g, di=di)
    fmt = record("fp8", di, role="index")
    recs = kv_records.encode(keys.float().mul(3.0).reshape(-1, di), fmt).view(*keys.shape[:2], fmt.nbytes)
    p = dataclasses.replace(p, key_format=fmt)
    got, want = npu_ops.indexer_scores(q, recs, batch, w, p), ref_ds.indexer_scores(q, recs, batch, w, p)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not npu_ops.events
    fin = ~torch.isinf(want)
    close(got[fin], want[fin], 0.02 * want[fin].abs().max().item())  # the weights are rounded to bf16
    # weights the wrapper need not round to bf16: only the order of the fp32 products differs
    wb = w.to(BF16).float()
    exact = dataclasses.replace(p, weight_scale=1.0, scale=1.0)
    got, want = npu_ops.indexer_scores(q, recs, batch, wb, exact), ref_ds.indexer_scores(q, recs, batch, wb, exact)
    close(got[fin], want[fin], 1e-5 * want[fin].abs().max().item())
    c = recorder.calls[-1]
    assert c.op == "npu_lightning_indexer" and c.tensor("key").shape == (16, 1, 128) and c.tensor("key").dtype == "bfloat16"


def test_indexer_fp4_keys_fall_back_saying_why(npu_ops, recorder):
    g = torch.Generator().manual_seed(4)
    q, keys, batch, w, p = indexer_case(g, di=32)
    fmt = record("fp4", 32, role="index")
    recs = kv_records.encode(keys.reshape(-1, 32), fmt).view(*keys.shape[:2], fmt.nbytes)
    p = dataclasses.replace(p, key_format=fmt)
    assert torch.equal(npu_ops.indexer_scores(q, recs, batch, w, p), ref_ds.indexer_scores(q, recs, batch, w, p))
    assert "mxfp4 key records" in npu_ops.events[-1][1] and "return no scores" in npu_ops.events[-1][1]
    assert not recorder.calls


# ------------------------------------------------------------------------------------------ attn.sparse_topk


def sparse_case(g, h=4, d=64, ratio=4, window=128, k=8):
    tokens, new = [200, 50], [2, 1]
    batch, nb = paged(tokens, new, 16, 1, g)
    kv = torch.randn(nb, 16, d, generator=g).to(BF16)
    cbatch, cnb = paged([t // ratio for t in tokens], new, 16, ratio, g)
    cbatch = AttnBatch(cbatch.query_start_loc, cbatch.seq_lens, batch.positions, cbatch.block_table,
                       cbatch.slot_mapping, ratio)
    comp = torch.randn(cnb, 16, d, generator=g).to(BF16)
    vis = ((batch.positions + 1) // ratio).tolist()
    idx = torch.stack([torch.randperm(v, generator=g)[:k] if v >= k else
                       torch.cat((torch.randperm(v, generator=g), torch.full((k - v,), -1))) for v in vis])
    idx[0, 1] = idx[0, 0]  # a repeated entry counts once
    idx[1, 2] = -1
    q = torch.randn(3, h, d, generator=g).to(BF16)
    sinks = torch.randn(h, generator=g)
    return q, kv, batch, comp, cbatch, idx, AttnParams(scale=d ** -0.5, window=window, shared_kv=True), sinks


def test_sparse_attention_equals_reference(npu_ops, recorder):
    g = torch.Generator().manual_seed(3)
    q, kv, batch, comp, cbatch, idx, p, sinks = sparse_case(g)
    got = npu_ops.attn_sparse_topk(q, kv, batch, comp, cbatch, idx, p, sinks)
    want = ref_ds.attn_sparse_topk(q, kv, batch, comp, cbatch, idx, p, sinks)
    close(got, want, 0.02)
    assert not npu_ops.events
    meta, call = recorder.calls[-2:]
    assert (meta.op, call.op) == ("npu_sparse_attn_sharedkv_metadata", "npu_sparse_attn_sharedkv")
    assert call.tensor("q").shape == (3, 64, 64) and call.tensor("cmp_sparse_indices").shape == (3, 1, 512)
    assert call.args["ori_win_left"] == 127 and call.args["cmp_ratio"] == 4 and call.tensor("sinks").dtype == "float32"
    # window only (a sliding layer)
    got = npu_ops.attn_sparse_topk(q, kv, batch, None, None, None, p, sinks)
    close(got, ref_ds.attn_sparse_topk(q, kv, batch, None, None, None, p, sinks), 0.02)
    assert recorder.calls[-1].args.get("cmp_kv") is None


@pytest.mark.parametrize("ratio,tokens", [(128, 300), (4, 2400)])
def test_every_closed_entry_goes_without_indices(npu_ops, recorder, ratio, tokens):
    """HCA lists every causally closed entry: the operator's compressed-attention scenario (no indices) takes
    that for any count, past the 512 an index list allows (2400 tokens / 4 = 600 entries)."""
    from inferhal.core.models.deepseek_v4.attention import all_visible

    g = torch.Generator().manual_seed(10)
    d, h = 64, 4
    batch, nb = paged([tokens, 50], [2, 1], 16, 1, g)
    cbatch, cnb = paged([tokens // ratio, max(1, 50 // ratio)], [2, 1], 16, ratio, g)
    cbatch = AttnBatch(cbatch.query_start_loc, cbatch.seq_lens, batch.positions, cbatch.block_table,
                       cbatch.slot_mapping, ratio)
    kv, comp = torch.randn(nb, 16, d, generator=g).to(BF16), torch.randn(cnb, 16, d, generator=g).to(BF16)
    q, sinks = torch.randn(3, h, d, generator=g).to(BF16), torch.randn(h, generator=g)
    idx = all_visible(batch.positions, ratio)
    p = AttnParams(scale=d ** -0.5, window=128, shared_kv=True)
    got = npu_ops.attn_sparse_topk(q, kv, batch, comp, cbatch, idx, p, sinks)
    close(got, ref_ds.attn_sparse_topk(q, kv, batch, comp, cbatch, idx, p, sinks), 0.02)
    call = recorder.calls[-1]
    assert call.args.get("cmp_sparse_indices") is None and call.args["cmp_ratio"] == ratio and not npu_ops.events


@pytest.mark.parametrize("change,why", [
    (dict(window=16), "window 16"), (dict(ratio=16), "compression 16"), (dict(h=80), "80 heads"),
    ("950", "this generation has no bf16"),
])
def test_sparse_attention_falls_back_visibly(recorder, change, why):
    ops = NpuOps(recorder, features=frozenset() if change == "950" else None)
    g = torch.Generator().manual_seed(4)
    q, kv, batch, comp, cbatch, idx, p, sinks = sparse_case(g, **({} if change == "950" else change))
    got = ops.attn_sparse_topk(q, kv, batch, comp, cbatch, idx, p, sinks)
    assert torch.equal(got, ref_ds.attn_sparse_topk(q, kv, batch, comp, cbatch, idx, p, sinks))
    assert ops.events[-1][0] == "attn.sparse_topk" and why in ops.events[-1][1] and not recorder.calls


def test_profiles_say_which_generation_has_bf16_sparse_attention():
    from inferhal.backends.ascend950.device import profile_for

    assert profile_for("Ascend910_9392").supports("sparse_attn_sharedkv")
    assert not profile_for("Ascend950PR_9589").supports("sparse_attn_sharedkv")


# ------------------------------------------------------------------------------------------ mHC


def mhc_case(g, t=3, n=4, d=4096):
    streams = torch.randn(t, n, d, generator=g).to(BF16)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.02
    base, scale = torch.randn((2 + n) * n, generator=g) * 0.1, torch.rand(3, generator=g) + 0.5
    return streams, fn, base, scale, MhcParams(hc_mult=n)


def test_mhc_pre_and_head_equal_reference(npu_ops, recorder):
    g = torch.Generator().manual_seed(5)
    streams, fn, base, scale, p = mhc_case(g)
    x, post, comb = npu_ops.mhc_pre(streams, fn, base, scale, p)
    xr, postr, combr = ref_mhc.mhc_pre(streams, fn, base, scale, p)
    close(x, xr, 0.05)
    close(post, postr, 1e-5)
    close(comb, combr, 1e-5)
    c = recorder.calls[-1]
    assert c.op == "npu_hc_pre_v2" and c.tensor("hc_fn").shape == (24, 4 * 4096) and c.args["hc_mult"] == 4
    hx = npu_ops.mhc_head(streams, fn[:4], base[:4], scale[:1], p)
    close(hx, ref_mhc.mhc_head(streams, fn[:4], base[:4], scale[:1], p), 0.05)
    assert recorder.calls[-1].tensor("hc_fn").shape == (24, 4 * 4096) and not npu_ops.events


def test_mhc_pre_falls_back_off_the_operators_shapes(npu_ops, recorder):
    g = torch.Generator().manual_seed(6)
    streams, fn, base, scale, p = mhc_case(g, n=2, d=64)  # the tiny model's hc_mult 2, hidden 64
    got = npu_ops.mhc_pre(streams, fn, base, scale, p)
    want = ref_mhc.mhc_pre(streams, fn, base, scale, p)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert "hc_mult 2" in npu_ops.events[-1][1] and not recorder.calls


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_mhc_post_equals_reference(npu_ops, recorder, dtype):
    g = torch.Generator().manual_seed(7)
    t, n, d = 5, 2, 64
    y, streams = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, n, d, generator=g).to(dtype)
    post, comb = torch.rand(t, n, generator=g) * 2, torch.softmax(torch.randn(t, n, n, generator=g), -1)
    close(npu_ops.mhc_post(y, streams, post, comb), ref_mhc.mhc_post(y, streams, post, comb),
          1e-6 if dtype == torch.float32 else 0.05)
    c = recorder.calls[-1]
    assert c.op == "npu_hc_post" and c.tensor("residual").shape == (1, t, n, d) and c.tensor("comb").shape == (1, t, n, n)


# ------------------------------------------------------------------------------------------ moe.route (V4)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("hashed", [False, True])
def test_sqrtsoftplus_and_hash_routing_equal_reference(npu_ops, recorder, dtype, hashed):
    g = torch.Generator().manual_seed(8)
    t, e, k = 9, 32, 4
    logits = torch.randn(t, e, generator=g).to(dtype)
    bias = torch.randn(e, generator=g) * 0.1
    hash_ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if hashed else None
    p = RouteParams(top_k=k, scoring="sqrtsoftplus", routed_scaling=1.5)
    w, ids = npu_ops.moe_route(logits, p, bias.to(dtype), hash_ids)
    wr, idr = ref_moe.moe_route(logits, p, bias.to(dtype), hash_ids)
    o, orr = ids.sort(-1), idr.sort(-1)
    assert torch.equal(o.values, orr.values)
    close(w.gather(1, o.indices), wr.gather(1, orr.indices), 1e-6 if dtype == torch.float32 else 0.02)
    c = recorder.calls[-1]
    assert c.op == "moe_gating_top_k_hash" and c.args["norm_type"] == 2 and c.args["renorm"] == 0
    if hashed:
        assert c.tensor("tid2eid").shape == (t, k) and c.tensor("input_ids").dtype == "int64"
    assert not npu_ops.events


def test_hash_routing_with_sigmoid_and_no_renormalisation(npu_ops, recorder):
    g = torch.Generator().manual_seed(9)
    logits, ids = torch.randn(4, 16, generator=g), torch.randint(0, 16, (4, 2), generator=g)
    w, got = npu_ops.moe_route(logits, RouteParams(top_k=2, scoring="sigmoid"), None, ids)
    assert torch.equal(got, ids) and recorder.calls[-1].args["norm_type"] == 1
    npu_ops.moe_route(logits, RouteParams(top_k=2, scoring="sqrtsoftplus", renormalize=False))
    assert "renormalize=False" in npu_ops.events[-1][1]
