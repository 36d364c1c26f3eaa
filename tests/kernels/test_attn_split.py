"""Split-KV decode (kernels/attn_split.py: attn.sparse_topk and attn.paged with ``decode="split"``) in the
interpreter (execution level: interpreter, not a hardware result), at the edges of its splits.

The interpreter's tuning cuts at 16 keys (``SPLIT``), at most 4 splits to a range (``MAX_SPLITS``), 16-key
tiles, so short contexts cross split edges: a window or top-k list that ends exactly on a split boundary,
one key, a range cut into longer splits than ``SPLIT``, sinks with a token's keys spread over several splits
(the combine must add each sink once), FP8 / FP4 records. Tolerances as the kernels' own tests
(test_attn_paged.py, test_deepseek_v4.py): fp32 re-association, and in bf16 P rounded before the P.V dot plus
the output rounding (two roundings at the scale of max|v|).

Batch invariance is bitwise: a sequence alone (its own narrower block table, so fewer range splits, and its
top-k rows only as wide as its own) equals the same sequence in the batch, and launches chunked to one token
equal one launch. The split plan at V4-Flash decode shapes must give the GPU at least 132 programs at B=16.
"""

import math

import pytest
import torch

from inferhal.backends.reference.attention import attn_paged as ref_paged
from inferhal.backends.reference.deepseek import attn_sparse_topk as ref_sparse
from inferhal.core.ops.params import AttnBatch, AttnParams
from inferhal.kernels import attn_split
from inferhal.kernels.attn_paged import attn_paged
from inferhal.kernels.sparse_attn import attn_sparse_topk
from inferhal.kernels.tuning import config

from tests.kernels.test_attn_paged import make_batch
from tests.kernels.test_deepseek_v4 import BLOCK, comp_cache, v4_batch

RATIO = 4


def _rows(pos, comp_lens, seq_of, k, fill, g):
    """[T, k] top-k rows: ``fill`` distinct visible entries first (all visible ones if fewer), then -1."""
    out = torch.full((len(pos), k), -1, dtype=torch.long)
    for t, p in enumerate(pos.tolist()):
        vis = min(int(comp_lens[seq_of[t]]), (p + 1) // RATIO)
        pick = torch.randperm(vis, generator=g)[: min(fill, vis, k)]
        out[t, : pick.numel()] = pick
    return out


def _sparse_inputs(ctx, new, h, d, window, k, fill, dtype, seed, fmt=None):
    g = torch.Generator().manual_seed(seed)
    pos, qsl, attn, nb = v4_batch(ctx, new, RATIO, g)
    seq_of = torch.repeat_interleave(torch.arange(len(ctx)), torch.tensor(new)).tolist()
    kv = torch.randn(nb, BLOCK, d, generator=g).to(dtype)
    cc = comp_cache(nb, RATIO, d, g, dtype)
    q = torch.randn(len(pos), h, d, generator=g).to(dtype)
    sinks = 2.0 + torch.randn(h, generator=g)  # large enough that adding a sink twice shows
    idx = _rows(pos, attn["comp"].seq_lens, seq_of, k, fill, g) if k else None
    p = AttnParams(scale=d ** -0.5, window=window, shared_kv=True, kv_format=fmt)
    return q, kv, attn, cc, idx, p, sinks


SPARSE_EDGES = [
    # ctx, new, H, D, window, top-k width, entries filled, what
    ([1], [1], 4, 32, 8, 16, 16, "one key (position 0), no entry closed yet"),
    ([32, 16], [1, 1], 4, 32, 32, 32, 16, "windows of 32 and 16 keys and 16 entries: splits end on the keys' end"),
    ([64, 70, 9], [1, 1, 9], 16, 32, 0, 48, 48, "no window: 64 keys in 4 splits, 70 in 3 of 32; 48 entries = 3 splits"),
    ([40, 23], [5, 1], 20, 24, 16, 40, 33, "20 heads in two groups, ragged D, a chunk, 33 of 40 entries"),
]


@pytest.mark.parametrize("case", SPARSE_EDGES, ids=lambda c: c[-1].split(":")[0].split(",")[0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_split_edges_match_reference(case, dtype, close):
    ctx, new, h, d, window, k, fill, _ = case
    q, kv, attn, cc, idx, p, sinks = _sparse_inputs(ctx, new, h, d, window, k, fill, dtype, sum(ctx) + h)
    args = (q, kv, attn["swa"], cc, attn["comp"], idx, p, sinks)
    out, ref = attn_sparse_topk(*args), ref_sparse(*args)
    vmax = float(max(kv.float().abs().max(), cc.float().abs().max()))
    close(out, ref, links=2 if dtype == torch.bfloat16 else 1, scale=vmax, name="attn.sparse_topk split")


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_sparse_split_reads_records_over_several_splits(kv_dtype, close):
    """FP8 (fp8_ds_mla: e4m3, ue8m0 per 64, bf16 RoPE) and FP4 (NVFP4) records through decode_tile, a window of
    3 splits and a top-k row of 3; decoded main records are exact in bf16, so the tolerance is the values'."""
    from inferhal.backends.reference import kv_records as codec
    from inferhal.backends.reference.ops import kv_write
    from inferhal.core.ops.params import KVWriteParams
    from inferhal.core.paging import formats

    fmt = formats.record(kv_dtype, 64, 16, role="main")
    q, kv, attn, cc, idx, p, sinks = _sparse_inputs([70, 40], [1, 2], 16, 64, 40, 48, 40, torch.bfloat16, 11, fmt)

    def records(values):
        nb, bs, d = values.shape
        cache = torch.zeros(nb, bs, fmt.nbytes, dtype=torch.uint8)
        kv_write(values.float().reshape(-1, d), cache, torch.arange(nb * bs), KVWriteParams(record=fmt))
        return cache

    kv, cc = records(kv), records(cc)
    args = (q, kv, attn["swa"], cc, attn["comp"], idx, p, sinks)
    vmax = float(max(codec.decode(kv, fmt).abs().max(), codec.decode(cc, fmt).abs().max()))
    close(attn_sparse_topk(*args), ref_sparse(*args), links=2, scale=vmax, name=f"attn.sparse_topk split {fmt.name}")


PAGED_EDGES = [
    # ctx, new, H, Hk, D, shared, window, softcap
    ([1, 16, 32], [1, 1, 1], 4, 1, 32, True, 0, 0.0),  # one key; 16 and 32 keys end on split edges
    ([64, 70, 20], [1, 1, 6], 8, 2, 24, False, 0, 0.0),  # 64 keys in 4 splits, 70 in 3 of 32, a chunk; GQA
    ([50, 33], [1, 1], 32, 1, 16, True, 32, 20.0),  # two 16-head groups, a window of exactly 2 splits, softcap
]


@pytest.mark.parametrize("case", PAGED_EDGES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_split_edges_match_reference(case, dtype, close):
    ctx, new, h, hk, d, shared, window, softcap = case
    g = torch.Generator().manual_seed(sum(ctx) + h)
    batch = make_batch(ctx, new, 8, 32, g)
    cache = torch.randn(32, 8, *((hk, d) if shared else (2, hk, d)), generator=g).to(dtype)
    q = torch.randn(sum(new), h, d, generator=g).to(dtype)
    sinks = 2.0 + torch.randn(h, generator=g)
    p = AttnParams(scale=d ** -0.5, num_kv_heads=hk, window=window, softcap=softcap, shared_kv=shared)
    out, ref = attn_paged(q, cache, batch, p, sinks), ref_paged(q, cache, batch, p, sinks)
    close(out, ref, links=2 if dtype == torch.bfloat16 else 1, scale=float(cache.float().abs().max()),
          name="attn.paged split")


def _alone(batch: AttnBatch, b: int, blocks: int) -> AttnBatch:
    """Sequence ``b`` of ``batch`` alone, its block table cut to its own ``blocks``."""
    lo, hi = int(batch.query_start_loc[b]), int(batch.query_start_loc[b + 1])
    return AttnBatch(torch.tensor([0, hi - lo], dtype=torch.int32), batch.seq_lens[b:b + 1], batch.positions[lo:hi],
                     batch.block_table[b:b + 1, :blocks].contiguous(), batch.slot_mapping[lo:hi],
                     batch.tokens_per_slot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_rows_are_bitwise_batch_invariant(dtype, monkeypatch):
    """No window (range splits from the block table's reach: 4 in the batch, fewer alone) and top-k rows padded
    to the batch's widest (3 list splits in the batch, 1 alone): each sequence alone equals its rows in the
    batch bit for bit, and so do launches of one token each."""
    ctx, new = [70, 9, 40], [1, 1, 3]
    q, kv, attn, cc, idx, p, sinks = _sparse_inputs(ctx, new, 4, 32, 0, 48, 48, dtype, 5)
    full = attn_sparse_topk(q, kv, attn["swa"], cc, attn["comp"], idx, p, sinks)
    qsl = attn["swa"].query_start_loc.tolist()
    for b, c in enumerate(ctx):
        lo, hi = qsl[b], qsl[b + 1]
        own = max(1, int((idx[lo:hi] >= 0).sum(1).max()))  # the row as wide as its own entries
        alone = attn_sparse_topk(q[lo:hi], kv, _alone(attn["swa"], b, -(-c // BLOCK)), cc,
                                 _alone(attn["comp"], b, -(-(c // RATIO) // (BLOCK // RATIO))), idx[lo:hi, :own], p,
                                 sinks)
        assert torch.equal(alone, full[lo:hi]), (b, (alone.float() - full[lo:hi].float()).abs().max())
    g = torch.Generator().manual_seed(2)
    batch = make_batch([70, 9, 33], [1, 1, 4], 8, 32, g)
    cache = torch.randn(32, 8, 2, 2, 16, generator=g).to(dtype)
    pq = torch.randn(6, 8, 16, generator=g).to(dtype)
    pp = AttnParams(scale=0.25, num_kv_heads=2)
    whole = attn_paged(pq, cache, batch, pp, sinks[:1].expand(8).contiguous())
    alone = attn_paged(pq[1:2], cache, _alone(batch, 1, 2), pp, sinks[:1].expand(8).contiguous())
    assert torch.equal(alone, whole[1:2])
    monkeypatch.setattr(attn_split, "PARTIAL_BYTES", 1)  # one token per launch
    assert torch.equal(attn_sparse_topk(q, kv, attn["swa"], cc, attn["comp"], idx, p, sinks), full)
    assert torch.equal(attn_paged(pq, cache, batch, pp, sinks[:1].expand(8).contiguous()), whole)


def test_one_token_alone_and_beside_much_longer_ones_is_bitwise_the_same():
    """A one-key token beside sequences whose block tables reach 16 splits further: every extra split is empty."""
    g = torch.Generator().manual_seed(9)
    batch = make_batch([1, 200], [1, 1], 8, 40, g)
    cache = torch.randn(40, 8, 1, 32, generator=g)
    q = torch.randn(2, 4, 32, generator=g)
    p = AttnParams(scale=32 ** -0.5, num_kv_heads=1, shared_kv=True)
    sinks = torch.randn(4, generator=g)
    both = attn_paged(q, cache, batch, p, sinks)
    assert torch.equal(attn_paged(q[:1], cache, _alone(batch, 0, 1), p, sinks), both[:1])
    close_to = ref_paged(q, cache, batch, p, sinks)
    torch.testing.assert_close(both, close_to, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp4"])
def test_indexer_runs_of_tiles_change_no_bit(kv_dtype, monkeypatch):
    """indexer.scores split: a program walks a run of tiles whose length follows the launch's work; 1 or 4
    tiles a program (and the single kernel's masking) give the same -inf entries, and the same scores bit for
    bit (bf16 keys and FP8 / FP4 records; the interpreter's tiles are 16 entries)."""
    from inferhal.backends.reference.ops import kv_write
    from inferhal.core.ops.params import IndexerParams, KVWriteParams
    from inferhal.core.paging import formats
    from inferhal.kernels import indexer, tuning

    g = torch.Generator().manual_seed(4)
    pos, qsl, attn, nb = v4_batch([300, 200, 9], [4, 6, 1], RATIO, g, nb=160)
    keys = comp_cache(nb, RATIO, 32, g, torch.bfloat16)
    fmt = None if kv_dtype == "auto" else formats.record(kv_dtype, 32, role="index")
    if fmt is not None:
        cache = torch.zeros(nb, keys.shape[1], fmt.nbytes, dtype=torch.uint8)
        kv_write(keys.float().reshape(-1, 32), cache, torch.arange(cache.shape[0] * cache.shape[1]),
                 KVWriteParams(record=fmt))
        keys = cache
    q, w = torch.randn(len(pos), 8, 32, generator=g).to(torch.bfloat16), torch.randn(len(pos), 8, generator=g)
    p = IndexerParams(32 ** -0.5, 8 ** -0.5, fmt)
    runs = []
    for programs in (10 ** 6, 1):  # 1 tile a program, then MAX_TILES (4)
        table = {**tuning.TUNING["interpreter"], "indexer_split": {**tuning.config("indexer_split"),
                                                                  "PROGRAMS": programs}}
        monkeypatch.setitem(tuning.TUNING, "interpreter", table)
        assert indexer.split_tiles(len(pos), 5, tuning.config("indexer_split")) == (1 if programs > 1 else 4)
        runs.append(indexer.indexer_scores(q, keys, attn["comp"], w, p))
    assert torch.equal(runs[0], runs[1])
    single = indexer.indexer_scores(q, keys, attn["comp"], w, p, decode="single")
    assert torch.equal(torch.isinf(single), torch.isinf(runs[0]))
    torch.testing.assert_close(single, runs[0], rtol=1e-5, atol=1e-5)


def test_indexer_over_a_padded_table_masks_past_the_visible_entries_in_any_run_length(monkeypatch):
    """A CUDA graph's block table is padded to max_model_len: the scores are its reach wide (block_table.shape[1]
    x BS entries), -inf past each token's visible entries, the visible ones equal to the reference and the same
    bits whichever run of tiles (1 a program, or MAX_TILES) computes them."""
    from inferhal.backends.reference.deepseek import indexer_scores as ref_indexer
    from inferhal.core.ops.params import IndexerParams
    from inferhal.kernels import indexer, tuning

    g = torch.Generator().manual_seed(5)
    pos, qsl, attn, nb = v4_batch([60, 9], [1, 1], RATIO, g, nb=64)
    comp = attn["comp"]
    pad = comp.block_table.new_full((comp.num_seqs, 30), -1)
    wide = AttnBatch(comp.query_start_loc, comp.seq_lens, comp.positions, torch.cat((comp.block_table, pad), 1),
                     comp.slot_mapping, comp.tokens_per_slot)
    keys = comp_cache(nb, RATIO, 32, g, torch.float32)
    q, w = torch.randn(len(pos), 8, 32, generator=g), torch.randn(len(pos), 8, generator=g)
    p = IndexerParams(32 ** -0.5, 8 ** -0.5)
    width = wide.block_table.shape[1] * keys.shape[1]
    runs = []
    for programs in (10 ** 6, 1):
        table = {**tuning.TUNING["interpreter"], "indexer_split": {**tuning.config("indexer_split"),
                                                                  "PROGRAMS": programs}}
        monkeypatch.setitem(tuning.TUNING, "interpreter", table)
        runs.append(indexer.indexer_scores(q, keys, wide, w, p))
    assert indexer.split_tiles(len(pos), -(-width // tuning.config("indexer_split")["BLOCK_N"]),
                               tuning.config("indexer_split")) > 1  # the last launch ran several tiles a program
    want = ref_indexer(q, keys, wide, w, p)
    assert runs[0].shape == want.shape == (len(pos), width) and width > int(comp.seq_lens.max())
    assert torch.equal(runs[0], runs[1]) and torch.equal(torch.isneginf(runs[0]), torch.isneginf(want))
    vis = ((pos + 1) // RATIO).tolist()
    assert all(torch.isneginf(runs[0][i, v:]).all() and torch.isfinite(runs[0][i, :v]).all() for i, v in enumerate(vis))
    fin = torch.isfinite(want)
    torch.testing.assert_close(runs[0][fin], want[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", ["cuda_sm90", "cuda_sm100"])
def test_v4_decode_plans_fill_132_sms_at_16_sequences(target):
    """V4-Flash decode: 64 heads on the 512-dim latent; CSA = a 128-token window + top-512 (attn.sparse_topk),
    the latent at 4K context through attn.paged; H100/H200 have 132 SMs. The partials of one launch stay
    within PARTIAL_BYTES."""
    for b in (16, 64):
        sparse = attn_split.plan(b, 64, 512, config("attn_sparse_split", target), window=128, reach=65536,
                                 list_len=512)
        paged = attn_split.plan(b, 64, 512, config("attn_paged_split", target), window=0, reach=4096)
        for sp in (sparse, paged):
            assert sp.chunk == b and math.prod(sp.grid(b)) >= 132 * (b // 16), (b, sp)
            assert sp.chunk * sp.num_splits * 64 * 514 * 4 <= attn_split.PARTIAL_BYTES
        assert (sparse.ws, sparse.nsk, sparse.groups) == (1, 4, 4)  # window 1 split + top-512 in 4 of 128
    # a range longer than MAX_SPLITS x SPLIT keeps MAX_SPLITS splits (longer ones), a window never more than it needs
    long = attn_split.plan(16, 64, 512, config("attn_paged_split", target), window=0, reach=1 << 20)
    assert long.ws == config("attn_paged_split", target)["MAX_SPLITS"]
    assert attn_split.plan(1, 8, 64, config("attn_paged_split", target), window=100, reach=1 << 20).ws == 1
    # the indexer at 64K context (16,384 CSA entries, 128 tiles of 128): runs of 7 tiles at B=16 (304 programs),
    # 8 at B=64 (1,024); at 4K (8 tiles) one tile a program: 128 programs at B=16, what 128-entry tiles allow
    from inferhal.kernels.indexer import split_tiles

    cfg = config("indexer_split", target)
    for b, ctx, tiles, programs in ((16, 65536, 7, 304), (64, 65536, 8, 1024), (16, 4096, 1, 128)):
        n = ctx // 4 // cfg["BLOCK_N"]
        assert split_tiles(b, n, cfg) == tiles and b * -(-n // tiles) == programs
