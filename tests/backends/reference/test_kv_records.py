"""The reference codec of FP8/FP4 KV records (backends/reference/kv_records.py) against the formats' stated
definitions (core/paging/formats.py), and the reference ops that write and read records: ``kv.write`` with
``KVWriteParams.record``, ``attn.sparse_topk`` and ``indexer.scores`` reading a record cache equal the same ops
reading a value cache that holds the records' decoded values (the records change the values, never the math)."""

from __future__ import annotations

import pytest
import torch

from inferhal.backends.reference import kv_records
from inferhal.backends.reference.deepseek import attn_sparse_topk, indexer_scores
from inferhal.backends.reference.ops import kv_write
from inferhal.core.ops.params import AttnBatch, AttnParams, IndexerParams, KVWriteParams
from inferhal.core.paging import formats

G = torch.Generator().manual_seed(3)
FP8_MAIN = formats.record("fp8", 512, 64, role="main")
FP8_INDEX = formats.record("fp8", 128, role="index")
NVFP4 = formats.record("fp4", 512, 64, role="main")
MXFP4 = formats.record("fp4", 128, role="index")
ALL = (FP8_MAIN, FP8_INDEX, NVFP4, MXFP4)


def test_the_record_layouts_are_the_stated_byte_counts():
    assert [f.nbytes for f in ALL] == [584, 132, 288, 68]  # vLLM's fp8_ds_mla; 890 B/token's two FP4 records
    assert (FP8_MAIN.coded, FP8_MAIN.raw_dims, FP8_MAIN.num_scales, FP8_MAIN.raw_at, FP8_MAIN.scales_at) == \
        (448, 64, 7, 448, 576)
    assert (NVFP4.block, NVFP4.scale, MXFP4.block, MXFP4.scale) == (16, "e4m3", 32, "ue8m0")


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_decode_of_encode_is_within_half_a_code_step_of_each_block(fmt):
    # rows of very different size; an e4m3 block scale (NVFP4) is a normal number for block amax >= 6 * 2^-6
    # (RMS-normalised latents: block amax ~1-3), smaller blocks get a coarser subnormal scale (formats.py)
    low = -0.9 if fmt.scale == "e4m3" else -3
    x = torch.randn(64, fmt.dims, generator=G) * torch.logspace(low, 2, 64)[:, None]
    y = kv_records.decode(kv_records.encode(x, fmt), fmt)
    assert y.shape == x.shape and y.dtype == torch.float32
    blocks = kv_records._blocks(x[:, :fmt.coded], fmt)
    amax = blocks.abs().amax(-1, keepdim=True).expand_as(blocks).reshape(64, -1)[:, :fmt.coded]
    err = (y[:, :fmt.coded] - x[:, :fmt.coded]).abs()
    if fmt.code == "e4m3":  # 3 mantissa bits: |err| <= 2^-4 |x| (normal range), plus the subnormal step
        scale = amax / 448 * (2 if fmt.scale == "ue8m0" else 1)
        assert bool((err <= x[:, :fmt.coded].abs() * 2 ** -4 + scale * 2 ** -9 + 1e-30).all())
    else:  # e2m1: at most half the widest step (2, between 4 and 6) of the scale, which covers amax / 6
        scale = amax / 6 * (2 if fmt.scale == "ue8m0" else 1.07)  # ue8m0 rounds up to 2x; e4m3 scale rounding
        assert bool((err <= scale + 1e-30).all())
    if fmt.raw_dims:  # the RoPE channels are bf16 exactly
        assert torch.equal(y[:, fmt.coded:], x[:, fmt.coded:].to(torch.bfloat16).float())


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_zero_rows_and_zero_records_decode_to_zero(fmt):
    assert torch.equal(kv_records.decode(kv_records.encode(torch.zeros(2, fmt.dims), fmt), fmt), torch.zeros(2, fmt.dims))
    assert torch.equal(kv_records.decode(torch.zeros(3, fmt.nbytes, dtype=torch.uint8), fmt), torch.zeros(3, fmt.dims))


def test_scales_follow_their_definitions():
    x = torch.zeros(1, 128)
    x[0, :32] = torch.linspace(-5.0, 5.0, 32)  # amax 5 -> ue8m0 2^ceil(log2(5/6)) = 1
    x[0, 32:64] = 7.0  # amax 7 -> 2^ceil(log2(7/6)) = 2; 7 / 2 = 3.5 is a tie between 3 and 4 -> 4 (even code)
    r = kv_records.encode(x, MXFP4)
    assert r[0, MXFP4.scales_at:].tolist() == [127, 128, 1, 1]  # exponent + 127; all-zero blocks get -126
    assert torch.equal(kv_records.decode(r, MXFP4)[0, 32:64], torch.full((32,), 8.0))
    fp32 = kv_records.encode(torch.full((1, 128), 2.0), FP8_INDEX)
    assert fp32[0, 128:].contiguous().view(torch.float32).item() == pytest.approx(2.0 / 448)
    nv = kv_records.encode(torch.full((1, 512), 3.0), NVFP4)
    assert torch.equal(kv_records.decode(nv, NVFP4), torch.full((1, 512), 3.0))  # 3/6 = 0.5 is exact in e4m3


def test_e2m1_ties_go_to_the_even_code():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, -0.75])
    assert kv_records.e2m1_codes(mids).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8 | 2]


def test_a_malformed_record_cache_is_refused_with_its_shape():
    with pytest.raises(ValueError, match=r"nvfp4.*expected uint8 \[..., 288\]"):
        kv_records.decode(torch.zeros(2, 287, dtype=torch.uint8), NVFP4)
    with pytest.raises(ValueError, match=r"kv.write nvfp4: cache must be uint8 \[NB, BS, 288\]"):
        kv_write(torch.zeros(1, 512), torch.zeros(2, 4, 512), torch.tensor([0]), KVWriteParams(record=NVFP4))


# ---- ops over a paged record cache ---------------------------------------------------------------------

BS = 4


def _batch(positions, seq_len, table, tps=1):
    t = len(positions)
    return AttnBatch(torch.tensor([0, t], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
                     torch.tensor(positions), table[None], torch.full((t,), -1), tokens_per_slot=tps)


def _paged(values: torch.Tensor, fmt):
    """``values [S, D]`` written with kv.write into shuffled pages, as records of ``fmt`` and as plain fp32
    values of what those records decode to: (record cache, value cache, block table)."""
    s = values.shape[0]
    nb = -(-s // BS) + 3
    table = torch.randperm(nb, generator=G)[:-(-s // BS)].to(torch.int32)
    slots = table.long()[torch.arange(s) // BS] * BS + torch.arange(s) % BS
    rec = torch.zeros(nb, BS, fmt.nbytes, dtype=torch.uint8)
    kv_write(values, rec, slots, KVWriteParams(record=fmt))
    plain = torch.zeros(nb, BS, fmt.dims)
    kv_write(kv_records.decode(kv_records.encode(values, fmt), fmt), plain, slots)
    assert torch.equal(kv_records.decode(rec, fmt), plain)  # the pages hold exactly the encoded rows
    return rec, plain, table


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_sparse_topk_and_indexer_read_records_as_their_decoded_values(kv_dtype):
    d, rope, di, h, hi, win, m = 64, 16, 32, 2, 3, 4, 4
    main, index = formats.record(kv_dtype, d, rope, role="main"), formats.record(kv_dtype, di, role="index")
    ctx = 14
    lat_r, lat_v, row = _paged(torch.randn(ctx, d, generator=G), main)
    comp_r, comp_v, crow = _paged(torch.randn(ctx // m, d, generator=G), main)
    key_r, key_v, krow = _paged(torch.randn(ctx // m, di, generator=G), index)
    pos = [10, 11, 12, 13]
    q = torch.randn(len(pos), h, d, generator=G)
    sinks = torch.randn(h, generator=G)
    topk = torch.tensor([[1, -1], [0, 2], [2, 1], [-1, -1]])
    args = (_batch(pos, ctx, row),)
    cb = _batch(pos, ctx // m, crow, m)
    p = AttnParams(scale=0.5, window=win, shared_kv=True)
    got = attn_sparse_topk(q, lat_r, *args, comp_r, cb, topk, AttnParams(0.5, window=win, shared_kv=True,
                                                                          kv_format=main), sinks)
    assert torch.equal(got, attn_sparse_topk(q, lat_v, *args, comp_v, cb, topk, p, sinks))
    iq, iw = torch.randn(len(pos), hi, di, generator=G), torch.randn(len(pos), hi, generator=G)
    kb = _batch(pos, ctx // m, krow, m)
    scores = indexer_scores(iq, key_r, kb, iw, IndexerParams(0.3, 0.5, index))
    assert torch.equal(scores, indexer_scores(iq, key_v, kb, iw, IndexerParams(0.3, 0.5)))
