"""DeepSeek-V4 sparse-attention kernels (indexer.scores, attn.sparse_topk, attn.compress) vs the reference
ops in the interpreter, over ragged batches built the way the model runner builds them
(``core.paging.batch.build_attn_batches``) over shuffled physical blocks: groups ``swa`` (one latent
slot per token), ``comp`` (one entry per ``ratio`` tokens), ``state`` (one compressor-state slot per token).

Tolerances (``check`` in conftest: ``links`` roundings of the output dtype at the scale of the terms):
- indexer.scores (fp32 out): bf16 x bf16 products are exact in fp32; only the order of the D-term dots
  and the H-term weighted sum differs (fp32 re-association, 1e-5 relative at the scale sum|w||q||k|).
- attn.sparse_topk: as attn.paged (see test_attn_paged.py): fp32 1e-5; bf16 rounds P to bf16 before
  the P.V dot plus the output rounding: two bf16 roundings at the scale of max|v|; both kernels (split-KV
  with its combine, and one program per token).
- attn.compress: the kernel rounds where the oracle does (pooled -> dtype, RMSNorm -> dtype, RoPE ->
  dtype), so in bf16 each link may flip one rounding boundary: three links at the output's scale.
"""

import pytest
import torch

from inferhal.backends.reference.deepseek import attn_compress as ref_compress
from inferhal.backends.reference.deepseek import attn_sparse_topk as ref_sparse
from inferhal.backends.reference.deepseek import indexer_scores as ref_indexer
from inferhal.core.ops.params import AttnParams, CompressParams, IndexerParams, RopeParams
from inferhal.core.paging.batch import SeqSlice, build_attn_batches
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.kernels.indexer import indexer_scores

BLOCK = 16  # tokens per block (4 entries per block at ratio 4, 1 at ratio 16)


def v4_batch(ctx_lens, new_lens, ratio: int, g: torch.Generator, nb: int = 64):
    """-> (positions[T], query_start_loc[B+1], {"swa", "comp", "state": AttnBatch}, num_blocks)."""
    specs = [KVGroupSpec("swa", "full", (0,), (1,), torch.float32),
             KVGroupSpec("comp", "compressed", (0,), (1,), torch.float32, tokens_per_slot=ratio),
             KVGroupSpec("state", "full", (0,), (1,), torch.float32)]
    seqs = []
    perm = {s.name: torch.randperm(nb, generator=g).tolist() for s in specs}
    for c, n in zip(ctx_lens, new_lens):
        ids = {}
        for s in specs:
            need = -(-c // BLOCK) if s.tokens_per_slot == 1 else -(-(c // ratio) // s.slots_per_block(BLOCK))
            ids[s.name] = [perm[s.name].pop() for _ in range(max(need, 1))]
        seqs.append(SeqSlice(c - n, n, ids))
    pos, qsl, attn = build_attn_batches(specs, BLOCK, seqs)
    return pos, qsl, attn, nb


def comp_cache(nb: int, ratio: int, d: int, g: torch.Generator, dtype) -> torch.Tensor:
    """Random compressed entries [NB, BLOCK // ratio, D]."""
    return torch.randn(nb, BLOCK // ratio, d, generator=g).to(dtype)


# ctx_lens, new_lens: decode, chunked prefill, a full prefill, a sequence with no closed entry yet
BATCHES = [([9], [1]), ([23, 40, 6], [1, 5, 6]), ([33, 17], [33, 2])]


@pytest.mark.parametrize("ctx,new", BATCHES)
@pytest.mark.parametrize("dtype,hi,di", [(torch.float32, 3, 24), (torch.bfloat16, 16, 32)])
@pytest.mark.parametrize("decode", ["split", "single"])
def test_indexer_scores_matches_reference(ctx, new, dtype, hi, di, decode, close):
    g = torch.Generator().manual_seed(sum(ctx) + hi)
    m = 4
    pos, qsl, attn, nb = v4_batch(ctx, new, m, g)
    keys = comp_cache(nb, m, di, g, dtype)
    q = torch.randn(len(pos), hi, di, generator=g).to(dtype)
    w = torch.randn(len(pos), hi, generator=g)
    p = IndexerParams(scale=di ** -0.5, weight_scale=hi ** -0.5)
    out, ref = indexer_scores(q, keys, attn["comp"], w, p, decode=decode), ref_indexer(q, keys, attn["comp"], w, p)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = ~torch.isinf(ref)
    # the scale of the summed terms: the same score with |w|, |q|, |k| (the oracle on absolute values)
    mag = float(ref_indexer(q.abs(), keys.abs(), attn["comp"], w.abs(), p)[fin].max())
    close(out[fin], ref[fin], scale=mag, name="indexer.scores")


@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_indexer_split_in_a_table_as_wide_as_a_graphs(tokens, close):
    """A captured step's block table reaches max_model_len (here 64 blocks: 256 columns, 16 tiles of 16) while
    the contexts close 0 .. 40 entries: the visible tiles are shared out over each token's programs and the
    rest of the width is -inf; every column is the reference's (one contiguous run or several per program,
    runs ending inside and past the visible tiles, a tile edge at 16 and 32 entries)."""
    import dataclasses

    g = torch.Generator().manual_seed(tokens)
    m, hi, di = 4, 16, 32
    ctx = [3, 64, 161, 17, 128][:tokens]  # 0, 16, 40, 4, 32 closed entries
    pos, qsl, attn, nb = v4_batch(ctx, [1] * tokens, m, g)
    comp = attn["comp"]
    table = torch.full((tokens, 64), -1, dtype=comp.block_table.dtype)
    table[:, : comp.block_table.shape[1]] = comp.block_table
    comp = dataclasses.replace(comp, block_table=table)
    keys = comp_cache(nb, m, di, g, torch.bfloat16)
    q = torch.randn(tokens, hi, di, generator=g).to(torch.bfloat16)
    w = torch.randn(tokens, hi, generator=g)
    p = IndexerParams(scale=di ** -0.5, weight_scale=hi ** -0.5)
    out, ref = indexer_scores(q, keys, comp, w, p), ref_indexer(q, keys, comp, w, p)
    assert out.shape == (tokens, 256) and torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = ~torch.isinf(ref)
    assert bool((out[~fin] == float("-inf")).all())
    if fin.any():
        mag = float(ref_indexer(q.abs(), keys.abs(), comp, w.abs(), p)[fin].max())
        close(out[fin], ref[fin], scale=mag, name="indexer.scores")
    # the table as wide as the contexts need (other runs, other programs): each tile is the same dot
    narrow = indexer_scores(q, keys, attn["comp"], w, p)
    assert torch.equal(out[:, : narrow.shape[1]], narrow)


def _topk_rows(pos, attn, m, k, mode, g):
    """CSA: k random distinct entries per token (some not yet closed, some -1, one past the sequence);
    HCA: every visible entry (the model's all_visible)."""
    vis = (pos + 1) // m
    if mode == "hca":
        width = max(int(vis.max()), 1)
        idx = torch.arange(width)[None].expand(len(pos), width)
        return torch.where(idx < vis[:, None], idx, torch.full_like(idx, -1))
    span = int(attn["comp"].seq_lens.max()) + 2
    rows = [torch.randperm(span, generator=g)[:k] for _ in range(len(pos))]
    idx = torch.stack([torch.cat((r, torch.full((max(0, k - r.numel()),), -1))) for r in rows])
    return idx.masked_fill(torch.rand(idx.shape, generator=g) < 0.2, -1)


SPARSE = [
    # ctx_lens, new_lens, H, D, window, mode (csa | hca | window-only), sinks
    ([9], [1], 4, 32, 4, "csa", True),
    ([23, 40, 6], [1, 5, 6], 16, 64, 8, "csa", True),  # ragged: decode, chunked prefill, early tokens
    ([33, 17], [3, 2], 8, 24, 6, "hca", False),  # ragged D
    ([20, 5], [20, 1], 2, 16, 0, "none", True),  # window-only layer, full causal (window 0)
]


@pytest.mark.parametrize("case", SPARSE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", ["split", "single"])
def test_attn_sparse_topk_matches_reference(case, dtype, decode, close):
    from inferhal.kernels.sparse_attn import attn_sparse_topk

    ctx, new, h, d, win, mode, with_sinks = case
    g = torch.Generator().manual_seed(sum(ctx) * 7 + h + d)
    m = 4
    pos, qsl, attn, nb = v4_batch(ctx, new, m, g)
    kv = torch.randn(nb, BLOCK, d, generator=g).to(dtype)
    cc = comp_cache(nb, m, d, g, dtype)
    q = torch.randn(len(pos), h, d, generator=g).to(dtype)
    sinks = torch.randn(h, generator=g) if with_sinks else None
    p = AttnParams(scale=d ** -0.5, window=win, shared_kv=True)
    args = (None, None, None) if mode == "none" else (cc, attn["comp"], _topk_rows(pos, attn, m, 5, mode, g))
    out = attn_sparse_topk(q, kv, attn["swa"], *args, p, sinks, decode=decode)
    ref = ref_sparse(q, kv, attn["swa"], *args, p, sinks)
    vmax = float(max(kv.float().abs().max(), cc.float().abs().max()))
    close(out, ref, links=2 if dtype == torch.bfloat16 else 1, scale=vmax, name="attn.sparse_topk")


COMPRESS = [
    # ctx_lens, new_lens, ratio, overlap, C, rope (rotary_dim, style, placement)
    ([8], [8], 4, True, 32, (8, "interleaved", "tail")),  # CSA prefill: windows 0 (no previous) and 1
    ([23, 40, 12], [1, 9, 12], 4, True, 48, (4, "interleaved", "tail")),  # ragged, D = 24
    ([32, 47], [32, 16], 16, False, 40, (8, "neox", "head")),  # HCA-like: 16-token windows, D = 40
]


@pytest.mark.parametrize("case", COMPRESS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_compress_matches_reference(case, dtype, close):
    from inferhal.kernels.compress import attn_compress

    ctx, new, m, overlap, c, (r, style, place) = case
    g = torch.Generator().manual_seed(sum(ctx) + m + c)
    pos, qsl, attn, nb = v4_batch(ctx, new, m, g)
    state = torch.randn(nb, BLOCK, 2, c, generator=g).to(dtype)
    d = c // 2 if overlap else c
    bias = torch.randn(m, c, generator=g)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    f = torch.arange(64).float()[:, None] * torch.rand(r // 2, generator=g)[None]
    cs = torch.cat((f.cos(), f.sin()), dim=-1)
    rows = torch.nonzero(attn["comp"].slot_mapping >= 0).flatten()
    assert rows.numel() > 0
    p = CompressParams(m, overlap, RopeParams(r, style, place), 1e-6)
    out = attn_compress(state, attn["state"], rows, bias, w, cs, p)
    ref = ref_compress(state, attn["state"], rows, bias, w, cs, p)
    close(out, ref, links=3 if dtype == torch.bfloat16 else 1, scale=float(ref.float().abs().max()),
          name="attn.compress")


def test_attn_compress_padding_rows_give_zeros_and_leave_the_rest_bitwise():
    """Rows of -1 (a captured step's bound past its count, #46): zero entries, no position check, and each
    real row's entry bitwise the one computed without the padding (one program per row)."""
    from inferhal.core.engine.host_sync import HostSyncGuard
    from inferhal.kernels.compress import attn_compress

    ctx, new, m, overlap, c, (r, style, place) = COMPRESS[1]
    g = torch.Generator().manual_seed(5)
    pos, qsl, attn, nb = v4_batch(ctx, new, m, g)
    state = torch.randn(nb, BLOCK, 2, c, generator=g)
    bias, w = torch.randn(m, c, generator=g), 1 + 0.1 * torch.randn(c // 2, generator=g)
    cs = torch.randn(64, r, generator=g)
    rows = torch.nonzero(attn["comp"].slot_mapping >= 0).flatten()
    p = CompressParams(m, overlap, RopeParams(r, style, place), 1e-6)
    padded = torch.cat((rows, torch.full((5,), -1, dtype=rows.dtype)))
    with HostSyncGuard(backend_fatal=True):
        out = attn_compress(state, attn["state"], padded, bias, w, cs, p)
    assert torch.equal(out[: rows.numel()], attn_compress(state, attn["state"], rows, bias, w, cs, p))
    assert not out[rows.numel():].any() and out.shape[0] == rows.numel() + 5


def test_attn_compress_rejects_a_row_that_closes_no_window():
    from inferhal.kernels.compress import attn_compress

    g = torch.Generator().manual_seed(0)
    pos, qsl, attn, nb = v4_batch([8], [8], 4, g)
    p = CompressParams(4, False, RopeParams(4, "interleaved", "tail"))
    with pytest.raises(ValueError, match="does not close a window"):
        attn_compress(torch.zeros(nb, BLOCK, 2, 8), attn["state"], torch.tensor([2]), torch.zeros(4, 8),
                      torch.ones(8), torch.zeros(64, 4), p)
