"""Reference DeepSeek-V4 ops over scattered (non-contiguous) pages against direct formulas on dense tensors."""

from __future__ import annotations

import torch

from inferhal.backends.reference.deepseek import attn_compress, attn_sparse_topk, indexer_scores
from inferhal.backends.reference.mhc import mhc_head
from inferhal.backends.reference.moe import moe_route
from inferhal.core.ops.params import AttnBatch, AttnParams, CompressParams, IndexerParams, MhcParams, RopeParams, RouteParams

G = torch.Generator().manual_seed(0)
BS = 8  # slots per block


def _paged(dense: torch.Tensor, nb: int = 16):
    """Scatter [S, *slot] into a cache with shuffled blocks → (cache, block_row)."""
    n_blocks = -(-dense.shape[0] // BS)
    perm = torch.randperm(nb, generator=G)[:n_blocks]
    cache = torch.zeros((nb, BS, *dense.shape[1:]))
    for i, b in enumerate(perm.tolist()):
        chunk = dense[i * BS:(i + 1) * BS]
        cache[b, : chunk.shape[0]] = chunk
    return cache, perm.to(torch.int32)


def _batch(positions, seq_len, row, tps=1):
    t = len(positions)
    return AttnBatch(torch.tensor([0, t], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
                     torch.tensor(positions), row[None], torch.full((t,), -1), tokens_per_slot=tps)


def _cos_sin(n, r):
    f = torch.arange(n).float()[:, None] * torch.rand(r // 2, generator=G)[None]
    return torch.cat((f.cos(), f.sin()), dim=-1)


def test_attn_compress_csa_and_hca_match_direct_pooling():
    m, d, n_tok = 4, 8, 24
    rp = RopeParams(4, "interleaved", "tail")
    cs = _cos_sin(64, 4)
    for overlap in (True, False):
        c = 2 * d if overlap else d
        state = torch.randn(n_tok, 2, c, generator=G)
        bias = torch.randn(m, c, generator=G)
        w = 1 + 0.1 * torch.randn(d, generator=G)
        cache, row = _paged(state)
        rows = torch.tensor([3, 11, 23])  # tokens closing windows 0, 2, 5
        got = attn_compress(cache, _batch(list(range(n_tok)), n_tok, row), rows, bias, w, cs,
                            CompressParams(m, overlap, rp, 1e-6))
        for j, t in enumerate(rows.tolist()):
            e = (t + 1) // m - 1
            kv, g = state[e * m:(e + 1) * m, 0], state[e * m:(e + 1) * m, 1] + bias
            if overlap:
                kv, g = kv[:, d:], g[:, d:]
                if e > 0:
                    kv = torch.cat((state[(e - 1) * m:e * m, 0, :d], kv))
                    g = torch.cat((state[(e - 1) * m:e * m, 1, :d] + bias[:, :d], g))
            x = (kv * torch.softmax(g, 0)).sum(0)
            x = x * torch.rsqrt(x.pow(2).mean() + 1e-6) * w
            cos, sin = cs[e * m, :2], cs[e * m, 2:]
            a, b = x[-4::2].clone(), x[-3::2].clone()
            x[-4::2], x[-3::2] = a * cos - b * sin, b * cos + a * sin
            assert torch.allclose(got[j], x, atol=1e-5), (overlap, t)


def test_indexer_scores_are_weighted_relu_dots_with_causal_minus_inf():
    m, hi, di, n = 4, 3, 8, 5
    keys = torch.randn(n, di, generator=G)
    cache, row = _paged(keys)
    pos = [3, 9, 19, 21]  # sees 1, 2, 5, 5 entries
    q = torch.randn(len(pos), hi, di, generator=G)
    w = torch.randn(len(pos), hi, generator=G)
    got = indexer_scores(q, cache, _batch(pos, n, row, m), w, IndexerParams(scale=0.3, weight_scale=0.5))
    want = (torch.relu(torch.einsum("thd,sd->ths", q, keys)) * 0.3 * (w * 0.5)[:, :, None]).sum(1)
    for i, p in enumerate(pos):
        vis = (p + 1) // m
        assert torch.allclose(got[i, :vis], want[i, :vis], atol=1e-5)
        assert torch.isinf(got[i, vis:]).all()


def test_indexer_scores_span_the_block_tables_reach_with_minus_inf_past_each_sequence():
    """S = block_table.shape[1] * BS (a CUDA graph pads the table): extra columns are -inf, and the scores of the
    visible entries are those over the tight table (to fp32 rounding: the einsum's blocking follows S)."""
    m, hi, di, n = 4, 3, 8, 5
    cache, row = _paged(torch.randn(n, di, generator=G))
    pos = [3, 9, 19, 21]
    q, w = torch.randn(len(pos), hi, di, generator=G), torch.randn(len(pos), hi, generator=G)
    p = IndexerParams(scale=0.3, weight_scale=0.5)
    tight = indexer_scores(q, cache, _batch(pos, n, row, m), w, p)
    wide = indexer_scores(q, cache, _batch(pos, n, torch.cat((row, torch.full((3,), -1, dtype=row.dtype))), m), w, p)
    assert tight.shape == (len(pos), BS) and wide.shape == (len(pos), 4 * BS)  # > max(seq_lens) = 5 either way
    assert torch.isneginf(wide[:, n:]).all() and torch.equal(torch.isneginf(wide[:, :BS]), torch.isneginf(tight))
    fin = torch.isfinite(tight)
    assert torch.allclose(wide[:, :BS][fin], tight[fin], rtol=1e-5, atol=1e-6)
    short = indexer_scores(q, cache, _batch(pos, 2, row, m), w, p)  # a sequence of 2 entries: -inf from entry 2
    assert torch.isneginf(short[:, 2:]).all() and torch.allclose(short[:, :2], tight[:, :2], rtol=1e-5, atol=1e-6)


def test_sparse_topk_is_one_softmax_over_window_and_selected_entries_with_sinks():
    d, h, win, m = 8, 2, 4, 4
    ctx = 14
    lat = torch.randn(ctx, d, generator=G)
    comp = torch.randn(ctx // m, d, generator=G)
    kc, row = _paged(lat)
    cc, crow = _paged(comp)
    pos = [10, 11, 12, 13]
    q = torch.randn(len(pos), h, d, generator=G)
    sinks = torch.randn(h, generator=G)
    topk = torch.tensor([[1, -1], [0, 2], [2, 9], [-1, -1]])  # 9: out of range, ignored
    got = attn_sparse_topk(q, kc, _batch(pos, ctx, row), cc, _batch(pos, ctx // m, crow, m), topk,
                           AttnParams(scale=0.5, window=win, shared_kv=True), sinks)
    for i, p in enumerate(pos):
        keys = [lat[j] for j in range(p - win + 1, p + 1)]
        keys += [comp[e] for e in topk[i].tolist() if 0 <= e < (p + 1) // m]
        k = torch.stack(keys)
        for hh in range(h):
            lg = torch.cat((k @ q[i, hh] * 0.5, sinks[hh:hh + 1]))
            pr = torch.softmax(lg, 0)[:-1]
            assert torch.allclose(got[i, hh], pr @ k, atol=1e-5)
    # window only (sliding layer): comp arguments None
    only = attn_sparse_topk(q, kc, _batch(pos, ctx, row), None, None, None, AttnParams(scale=0.5, window=win), sinks)
    assert only.shape == got.shape and not torch.allclose(only, got)


def test_mhc_head_and_softmax_routing():
    t, n, d = 5, 3, 4
    s = torch.randn(t, n, d, generator=G)
    fn, base, sc = torch.randn(n, n * d, generator=G), torch.randn(n, generator=G), torch.tensor([1.3])
    flat = s.reshape(t, -1)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(flat @ fn.T * 1.3 + base) + 1e-6
    assert torch.allclose(mhc_head(s, fn, base, sc, MhcParams(n)), (pre[..., None] * s).sum(1), atol=1e-6)
    logits = torch.randn(6, 8, generator=G)
    w, ids = moe_route(logits, RouteParams(2, "softmax", True, 1.5))
    probs = torch.softmax(logits, -1)
    assert torch.equal(ids.sort(1).values, probs.topk(2).indices.sort(1).values)
    assert torch.allclose(w.sum(1), torch.full((6,), 1.5))


def test_sparse_topk_in_fixed_order_is_bitwise_the_same_however_wide_the_padded_row():
    """Batch-invariant mode (``fixed_order``): a top-k row padded with -1 (a CUDA graph's HCA row spans
    ``max_model_len // ratio`` entries, an eager step's only its context's) changes no bit: 2 to 13 slices of 64
    keys (trees with odd levels), rows unsorted, with a repeat and an entry past the sequence, with and without
    sinks and window. Within fp32 rounding of the default mode, whose bits follow the width."""
    d, h, m, ctx = 16, 4, 4, 320
    lat, comp = torch.randn(ctx, d, generator=G), torch.randn(ctx // m, d, generator=G)
    kc, row = _paged(lat, 48)
    cc, crow = _paged(comp, 16)
    pos = [319, 200, 37, 3]
    q = torch.randn(len(pos), h, d, generator=G)
    base = torch.stack([torch.randperm(80, generator=G) for _ in pos])  # every entry, shuffled
    base[1, 5], base[2, 0] = base[1, 4], 300  # a repeat, one past the sequence
    for sinks, win in ((torch.randn(h, generator=G), 16), (None, 0)):
        p = AttnParams(scale=0.25, window=win, shared_kv=True)
        args = (q, kc, _batch(pos, ctx, row), cc, _batch(pos, ctx // m, crow, m))
        outs = [attn_sparse_topk(*args, torch.cat((base, torch.full((len(pos), w - 80), -1)), 1), p, sinks,
                                 fixed_order=True) for w in (80, 81, 300, 500)]
        assert all(torch.equal(o, outs[0]) for o in outs[1:])
        assert torch.allclose(outs[0], attn_sparse_topk(*args, base, p, sinks), atol=1e-5)
