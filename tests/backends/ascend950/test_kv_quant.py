"""FP8 KV records (``cache.kv_dtype=fp8``) on the 950's quantised operators, over the documented fake NPU:
kv_compress_epilog writes DeepSeek-V4's 640-byte rows, npu_kv_quant_sparse_attn_sharedkv reads them, every call
checked against the recorded contract, every result compared with the reference over the core's 584-byte
records. Level: wired-unrun (no Ascend device, no CANN here)."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import pytest
import torch

from inferhal.backends.ascend950 import kv_quant
from inferhal.backends.ascend950.device import AscendKVStorage, profile_for
from inferhal.backends.reference import deepseek as ref_ds
from inferhal.backends.reference import kv_records
from inferhal.backends.reference import ops as ref
from inferhal.core.ops.params import AttnBatch, KVWriteParams
from inferhal.core.paging import formats

_spec = importlib.util.spec_from_file_location("ascend950_v4_ops", pathlib.Path(__file__).with_name("test_v4_ops.py"))
_v4 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_v4)
paged, close, sparse_case = _v4.paged, _v4.close, _v4.sparse_case

BF16 = torch.bfloat16
FMT = formats.record("fp8", 512, 64)  # fp8_ds_mla, 584 B


def rows_cache(nb: int, bs: int = 16) -> torch.Tensor:
    """A [NB, BS, 584] view over 640-byte rows, as AscendKVStorage hands the 950's FP8 pages out."""
    return torch.zeros(nb, bs, kv_quant.ROW, dtype=torch.uint8)[:, :, :kv_quant.CORE_ROW]


def test_record_arrangement_is_a_byte_permutation_of_the_core_record():
    vals = torch.randn(5, 512) * torch.logspace(-3, 2, 5)[:, None]
    core = kv_records.encode(vals, FMT)
    rows = kv_quant.from_core(core, FMT)
    assert rows.shape == (5, 640) and not rows[:, 583:].any()
    assert torch.equal(rows[:, :128], core[:, 448:576])  # RoPE first, as the operator's README orders it
    assert torch.equal(rows[:, 128:576], core[:, :448]) and torch.equal(rows[:, 576:583], core[:, 576:583])
    assert torch.equal(kv_quant.to_core(rows, FMT), core)
    assert kv_quant.is_operator_record(FMT) and not kv_quant.is_operator_record(formats.record("fp8", 32, 8))


def test_storage_pages_fp8_records_in_operator_rows_on_the_950_only():
    from inferhal.core.paging.spec import KVGroupSpec
    from inferhal.core.paging import planning

    specs = [KVGroupSpec("swa", "sliding", (0, 1), (584,), torch.uint8, window=128),
             KVGroupSpec("csa_index", "compressed", (1,), (132,), torch.uint8, tokens_per_slot=4)]
    req = planning.storage_request(specs, 16, 3)
    st = AscendKVStorage(req, "cpu", operator_records=True)
    c = st.layer_cache("swa", 0)
    assert c.shape == (3, 16, 584) and kv_quant.arranged(c) and not kv_quant.arranged(st.layer_cache("csa_index", 1))
    assert st.nbytes() == 2 * 3 * 16 * 640 + 3 * 4 * 132  # the rows' true size, not the planned 584
    assert not kv_quant.arranged(AscendKVStorage(req, "cpu").layer_cache("swa", 0))
    assert profile_for("Ascend950PR_9589").supports("kv_dtype:fp8")
    a3 = profile_for("Ascend910_9392")
    assert not a3.supports("kv_dtype:fp8") and not a3.supports("kv_dtype:fp4")


def test_kv_write_quantises_through_kv_compress_epilog(npu_ops, recorder):
    g = torch.Generator().manual_seed(0)
    vals = (torch.randn(6, 512, generator=g) * 2).to(BF16)
    vals[1, :64] = 0  # an all-zero tile: the operator's scale floor (1e-4) differs from the core's, zeros both
    slots = torch.tensor([0, 5, 17, -1, 40, 33])
    cache, want = rows_cache(3), torch.zeros(3, 16, 584, dtype=torch.uint8)
    npu_ops.kv_write(vals, cache, slots, KVWriteParams(record=FMT))
    ref.kv_write(vals, want, slots, KVWriteParams(record=FMT))
    assert not npu_ops.events and recorder.ops_called() == ["kv_compress_epilog"]
    c = recorder.calls[0]
    assert c.tensor("kv_compress_cache").shape == (48, 1, 640) and c.tensor("kv_compress_cache").dtype == "float8_e4m3fn"
    assert (c.args["quant_group_size"], c.args["quant_mode"], c.args["round_scale_flag"], c.args["layout"]) == (64, 2, True, 1)
    got = kv_quant.to_core(kv_quant.operator_pages(cache), FMT)
    differ = (got != want).any(-1).flatten()
    assert differ.nonzero().flatten().tolist() == [5]  # slot 5: only the zero tile's scale byte
    assert torch.equal(kv_records.decode(got, FMT), kv_records.decode(want, FMT))


def test_kv_write_falls_back_visibly_and_keeps_the_rows_order(npu_ops, recorder):
    g = torch.Generator().manual_seed(1)
    vals = torch.randn(3, 512, generator=g)  # fp32: the operator takes bf16
    cache, want = rows_cache(2), torch.zeros(2, 16, 584, dtype=torch.uint8)
    npu_ops.kv_write(vals, cache, torch.tensor([3, -1, 20]), KVWriteParams(record=FMT))
    ref.kv_write(vals, want, torch.tensor([3, -1, 20]), KVWriteParams(record=FMT))
    assert npu_ops.events == [("kv.write", "values torch.float32: kv_compress_epilog takes bf16")]
    assert not recorder.calls and torch.equal(kv_quant.to_core(kv_quant.operator_pages(cache), FMT), want)
    small = formats.record("fp8", 32, 8)  # the tiny model's 48-byte record: no operator writes it
    rec = torch.zeros(2, 16, small.nbytes, dtype=torch.uint8)
    npu_ops.kv_write(vals[:, :32].to(BF16), rec, torch.tensor([0, 1, 2]), KVWriteParams(record=small))
    assert "kv_compress_epilog writes 448 e4m3" in npu_ops.events[-1][1] and not recorder.calls


def quant_case(g, ratio=4, k=20, h=8, new=(3, 1), tokens=(300, 150)):
    """V4-Flash's attention shapes (D 512, window 128), FP8 records written by the reference into core pages and
    into operator rows."""
    q, _, batch, _, cbatch, idx, p, sinks = sparse_case(g, h=h, d=512, ratio=ratio, k=k)
    batch, nb = paged(list(tokens), list(new), 16, 1, g)
    cbatch, cnb = paged([t // ratio for t in tokens], list(new), 16, ratio, g)
    cbatch = AttnBatch(cbatch.query_start_loc, cbatch.seq_lens, batch.positions, cbatch.block_table,
                       cbatch.slot_mapping, ratio)
    vis = ((batch.positions + 1) // ratio).tolist()
    idx = torch.stack([torch.randperm(v, generator=g)[:k] if v >= k else
                       torch.cat((torch.randperm(v, generator=g), torch.full((k - v,), -1))) for v in vis])
    q = torch.randn(sum(new), h, 512, generator=g).to(BF16)
    core, ccore = (kv_records.encode(torch.randn(n * 16, 512, generator=g), FMT).view(n, 16, FMT.nbytes)
                   for n in (nb, cnb))
    rows, crows = rows_cache(nb), rows_cache(cnb)
    kv_quant.operator_pages(rows).copy_(kv_quant.from_core(core, FMT))
    kv_quant.operator_pages(crows).copy_(kv_quant.from_core(ccore, FMT))
    p = dataclasses.replace(p, kv_format=FMT)
    return q, (core, ccore), (rows, crows), batch, cbatch, idx, p, sinks


def test_quantised_sparse_attention_equals_reference(npu_ops, recorder):
    g = torch.Generator().manual_seed(2)
    q, (core, ccore), (rows, crows), batch, cbatch, idx, p, sinks = quant_case(g)
    got = npu_ops.attn_sparse_topk(q, rows, batch, crows, cbatch, idx, p, sinks)
    want = ref_ds.attn_sparse_topk(q, core, batch, ccore, cbatch, idx, p, sinks)
    close(got, want, 0.02)
    assert not npu_ops.events
    meta, call = recorder.calls
    assert (meta.op, call.op) == ("npu_kv_quant_sparse_attn_sharedkv_metadata", "npu_kv_quant_sparse_attn_sharedkv")
    assert meta.args["kv_quant_mode"] == 1 and meta.args["cmp_topk"] == 512 and meta.args["cmp_ratio"] == 4
    assert call.tensor("q").shape == (4, 64, 512) and call.tensor("ori_kv").shape == (rows.shape[0], 16, 1, 640)
    assert call.tensor("ori_kv").dtype == "float8_e4m3fn" and call.tensor("cmp_sparse_indices").shape == (4, 1, 512)
    assert (call.args["kv_quant_mode"], call.args["tile_size"], call.args["rope_head_dim"]) == (1, 64, 64)


def test_quantised_sparse_attention_hca_and_window_only(npu_ops, recorder):
    g = torch.Generator().manual_seed(3)
    q, (core, ccore), (rows, crows), batch, cbatch, _, p, sinks = quant_case(g, ratio=128, tokens=(300, 260))
    every = ref_ds_all_visible(batch.positions, 128)
    close(npu_ops.attn_sparse_topk(q, rows, batch, crows, cbatch, every, p, sinks),
          ref_ds.attn_sparse_topk(q, core, batch, ccore, cbatch, every, p, sinks), 0.02)
    call = recorder.calls[-1]
    assert call.args["cmp_ratio"] == 128 and call.args.get("cmp_sparse_indices") is None
    close(npu_ops.attn_sparse_topk(q, rows, batch, None, None, None, p, sinks),
          ref_ds.attn_sparse_topk(q, core, batch, None, None, None, p, sinks), 0.02)
    assert recorder.calls[-1].args["cmp_ratio"] == 1 and recorder.calls[-1].args.get("cmp_kv") is None
    assert not npu_ops.events


def ref_ds_all_visible(positions, ratio):
    from inferhal.core.models.deepseek_v4.attention import all_visible

    return all_visible(positions, ratio)


@pytest.mark.parametrize("case,why", [
    ("window", "window 64"), ("topk", "top-k 1100"), ("heads", "<= 128 heads"), ("fp16", "takes bf16"),
    ("pages", "not in the operator's 640-byte rows"), ("a3", "950 only")])
def test_quantised_sparse_attention_falls_back_per_call_and_says_why(recorder, case, why):
    from inferhal.backends.ascend950.ops import NpuOps

    g = torch.Generator().manual_seed(4)
    h = 136 if case == "heads" else 8
    q, (core, ccore), (rows, crows), batch, cbatch, idx, p, sinks = quant_case(
        g, k=1100 if case == "topk" else 20, h=h, tokens=(300, 4400) if case == "topk" else (300, 150))
    if case == "window":
        p = dataclasses.replace(p, window=64)
    if case == "fp16":
        q = q.half()
    ops = NpuOps(recorder, features={"sparse_attn_sharedkv"} if case == "a3" else None)
    kv, ckv = (core, ccore) if case == "pages" else (rows, crows)
    got = ops.attn_sparse_topk(q, kv, batch, ckv, cbatch, idx, p, sinks)
    assert torch.equal(got, ref_ds.attn_sparse_topk(q, core, batch, ccore, cbatch, idx, p, sinks))
    assert len(ops.events) == 1 and ops.events[0][0] == "attn.sparse_topk" and why in ops.events[0][1]
    assert not recorder.calls


def test_out_of_limits_call_under_strict_is_an_error_naming_the_limit(recorder):
    from inferhal.backends.ascend950.ops import NpuOps
    from inferhal.core.ops.table import StrictFallbackError

    g = torch.Generator().manual_seed(5)
    q, _, (rows, crows), batch, cbatch, idx, p, sinks = quant_case(g)
    strict = NpuOps(recorder, strict=True)
    with pytest.raises(StrictFallbackError, match="window 64: the operator's band is fixed at 128"):
        strict.attn_sparse_topk(q, rows, batch, crows, cbatch, idx, dataclasses.replace(p, window=64), sinks)
    with pytest.raises(StrictFallbackError, match="kv_compress_epilog takes bf16"):
        strict.kv_write(torch.randn(2, 512), rows, torch.tensor([0, 1]), KVWriteParams(record=FMT))
    assert not recorder.calls and not strict.events


@pytest.mark.parametrize("soc,kv_dtype", [("Ascend910_9392", "fp8"), ("Ascend950PR_9589", "fp4"),
                                          ("Ascend910B2", "fp4")])
def test_kv_formats_no_operator_reads_are_refused_at_start_up(soc, kv_dtype):
    from inferhal.core.errors import UserError

    with pytest.raises(UserError, match=f"cache.kv_dtype={kv_dtype} is refused: backend 'ascend950' reads KV caches in"):
        formats.check_backend("ascend950", profile_for(soc), kv_dtype)
    formats.check_backend("ascend950", profile_for(soc), "auto")


def test_hca_one_entry_pages_are_regathered_into_16_entry_pages(npu_ops, recorder):
    """128-token blocks hold one HCA entry each; the operator takes 16-aligned compressed blocks, so the wrapper
    copies the entries a batch reads into 16-entry pages for the call (not a fallback)."""
    g = torch.Generator().manual_seed(6)
    q, (core, _), (rows, _), batch, _, _, p, sinks = quant_case(g, ratio=128, tokens=(300, 2200))
    cb, cnb = paged([300 // 128, 2200 // 128], [3, 1], 1, 128, g)
    cbatch = AttnBatch(cb.query_start_loc, cb.seq_lens, batch.positions, cb.block_table, cb.slot_mapping, 128)
    ccore = kv_records.encode(torch.randn(cnb, 512, generator=g), FMT).view(cnb, 1, FMT.nbytes)
    crows = rows_cache(cnb, 1)
    kv_quant.operator_pages(crows).copy_(kv_quant.from_core(ccore, FMT))
    every = ref_ds_all_visible(batch.positions, 128)
    close(npu_ops.attn_sparse_topk(q, rows, batch, crows, cbatch, every, p, sinks),
          ref_ds.attn_sparse_topk(q, core, batch, ccore, cbatch, every, p, sinks), 0.02)
    call = recorder.calls[-1]
    assert call.tensor("cmp_kv").shape == (2 * 2, 16, 1, 640) and call.args["cmp_ratio"] == 128  # 17 entries max
    assert not npu_ops.events
