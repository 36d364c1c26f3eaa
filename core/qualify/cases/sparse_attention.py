"""Cases of the DeepSeek-V4 paged ops: attn.sparse_topk (CSA / HCA / window only), attn.compress (CSA / HCA
compressor) and indexer.scores.

Inputs are one engine step laid out the way the model runner lays it out: KV groups
(:class:`~inferhal.core.paging.spec.KVGroupSpec`: a sliding latent group, compressed entry and indexer-key
groups, a sliding compressor-state group) over one shuffled pool of blocks, block tables turned into
per-group :class:`~inferhal.core.ops.params.AttnBatch` by
:func:`~inferhal.core.paging.batch.build_attn_batches`. Sliding groups have the blocks that fell out of
their window released (-1 in the table), as the KV manager does, so an op that reads outside its window
fails. Every cache is random everywhere, so a read from a wrong slot shows in the result.

Each step mixes decode, a fresh prefill and a chunked prefill; the batch of these ops is the set of
sequences (batch invariance takes the first ``n`` sequences, like attn.paged).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from inferhal.core.models.deepseek_v4.attention import closing_row_bound
from inferhal.core.ops.params import AttnParams, CompressParams, IndexerParams, RopeParams
from inferhal.core.paging.batch import SeqSlice, build_attn_batches
from inferhal.core.paging.spec import KVGroupSpec
from inferhal.core.qualify.cases.attention import first_seqs
from inferhal.core.qualify.cases.base import DTYPES, OpCase, cases_for, gen, nbytes, randn
from inferhal.core.qualify.cases.dense import cos_sin_table
from inferhal.core.qualify.tolerances import ulps

Seqs = list[tuple[int, int]]  # (num_computed, num_new) per sequence


def paged_step(g: torch.Generator, specs: list[KVGroupSpec], block_size: int, seqs: Seqs, spare: int = 2):
    """Block tables over one shuffled pool for every group → (pool blocks, {group: AttnBatch}).

    Every group gets ``ceil(context / block_size)`` blocks per sequence (a block holds ``block_size``
    tokens of every group); a sliding group's blocks wholly before ``num_computed - window + 1`` (the
    oldest key this step's first token reads) are released."""
    need = [-(-(c + n) // block_size) for c, n in seqs]
    nb = len(specs) * sum(need) + spare
    pool = torch.randperm(nb, generator=g).tolist()
    slices = []
    for (c, n), k in zip(seqs, need):
        ids = {}
        for spec in specs:
            blocks = [pool.pop() for _ in range(k)]
            if spec.kind == "sliding":
                first = max(0, c - spec.window + 1)
                blocks = [-1 if (i + 1) * block_size <= first else b for i, b in enumerate(blocks)]
            ids[spec.name] = blocks
        slices.append(SeqSlice(c, n, ids))
    _, _, batches = build_attn_batches(specs, block_size, slices)
    return nb, batches


def random_cache(g: torch.Generator, spec: KVGroupSpec, nb: int, block_size: int) -> torch.Tensor:
    return randn(g, nb, spec.slots_per_block(block_size), *spec.slot_shape, dtype=spec.dtype)  # [NB, spb, *slot]


def _label(seqs: Seqs) -> str:
    return "seqs=" + ",".join(f"{c}+{n}" for c, n in seqs)


def _end(batch, n: int) -> int:
    return int(batch.query_start_loc[n])


# ------------------------------------------------------------------------------------------- attn.sparse_topk

def csa_topk(g: torch.Generator, batch, comp_batch, k: int) -> torch.Tensor:
    """[T, k] distinct logical entries of each token's sequence, some -1: what the indexer's top-k hands over,
    plus entries not yet causally closed for early prefill tokens (the op must ignore those)."""
    out = torch.full((int(batch.positions.shape[0]), k), -1, dtype=torch.long)
    qsl = batch.query_start_loc.tolist()
    for b in range(batch.num_seqs):
        n_c = int(comp_batch.seq_lens[b])
        for t in range(qsl[b], qsl[b + 1]):
            pick = torch.randperm(n_c, generator=g)[:k] if n_c else torch.zeros(0, dtype=torch.long)
            out[t, : pick.numel()] = pick
    out[torch.rand(out.shape, generator=g) < 0.15] = -1
    return out


def all_visible(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """HCA: every causally closed entry of each token, [T, max visible], -1 padded."""
    vis = (positions.long() + 1) // ratio
    width = int(vis.max()) if vis.numel() else 0
    idx = torch.arange(width)[None, :].expand(positions.shape[0], width)
    return torch.where(idx < vis[:, None], idx, torch.full_like(idx, -1))


_SPARSE = [
    # label, seqs, H, D, window, ratio, top-k (0: HCA, all visible; None: window only), BS, level
    ("CSA", [(37, 1), (0, 24), (50, 6)], 4, 64, 16, 4, 8, 16, "quick"),
    ("HCA", [(47, 1), (0, 40), (20, 29)], 4, 64, 16, 16, 0, 32, "quick"),
    ("window only", [(30, 1), (0, 12), (9, 3)], 8, 32, 8, 0, None, 16, "quick"),
    ("CSA D=512", [(600, 1), (0, 200), (300, 40)], 16, 512, 128, 4, 128, 64, "full"),
    ("HCA m=128 D=512", [(1000, 1), (0, 384)], 8, 512, 128, 128, 0, 256, "full"),
    ("CSA decode batch", [(c, 1) for c in (3, 64, 97, 130, 255, 31)], 8, 128, 32, 4, 16, 32, "full"),
    # split-KV edges at the GPU tuning (128-key splits): windows of exactly 128 keys and a top-128 row end on a
    # split boundary, one key, a long context beside them (kernels/attn_split.py)
    ("CSA split edges", [(127, 1), (0, 1), (255, 1), (1000, 1)], 16, 512, 128, 4, 128, 64, "full"),
]


@cases_for("attn.sparse_topk")
def attn_sparse_topk() -> list[OpCase]:
    out = []
    for label, seqs, h, d, window, ratio, k, bs, level in _SPARSE:
        for dtype in ("float32", "bfloat16"):
            def build(seed, seqs=seqs, h=h, d=d, window=window, ratio=ratio, k=k, bs=bs, dtype=dtype):
                g = gen(seed)
                dt = DTYPES[dtype]
                specs = [KVGroupSpec("swa", "sliding", (0,), (d,), dt, window=window)]
                if k is not None:
                    specs.append(KVGroupSpec("comp", "compressed", (0,), (d,), dt, tokens_per_slot=ratio))
                nb, batches = paged_step(g, specs, bs, seqs)
                swa = batches["swa"]
                kv = random_cache(g, specs[0], nb, bs)
                comp_cache = comp_batch = topk = None
                if k is not None:
                    comp_batch = batches["comp"]
                    comp_cache = random_cache(g, specs[1], nb, bs)
                    topk = all_visible(swa.positions, ratio) if k == 0 else csa_topk(g, swa, comp_batch, k)
                q = randn(g, int(swa.positions.shape[0]), h, d, dtype=dt)
                p = AttnParams(scale=d ** -0.5, num_kv_heads=1, window=window, shared_kv=True)
                return (q, kv, swa, comp_cache, comp_batch, topk, p), {"sinks": randn(g, h)}

            def take(a, kw, n):
                q, kv, swa, cc, cb, topk, p = a
                e = _end(swa, n)
                return (q[:e], kv, first_seqs(swa, n), cc, None if cb is None else first_seqs(cb, n),
                        None if topk is None else topk[:e], p), kw

            def cost(a, kw, window=window):
                q, kv, swa, cc, cb, topk, p = a
                keys = q.shape[0] * window + (0 if topk is None else int((topk >= 0).sum()))  # upper bound
                return 4.0 * q.shape[1] * q.shape[2] * keys, keys * q.shape[2] * q.element_size() + 2 * nbytes(q)

            n = 128 if dtype == "float32" else 4
            why = ("one softmax in fp32 over the window keys plus the selected entries (up to ~650) and the sink, "
                   "a weighted sum in another order; one output rounding"
                   + ("" if dtype == "float32" else " (bf16 inputs are exact in fp32)"))
            kind = "" if k is None else (f" m={ratio} all-visible" if k == 0 else f" m={ratio} k={k}")
            shape = f"{label} {_label(seqs)} H={h} D={d} W={window}{kind} BS={bs}"
            out.append(OpCase("attn.sparse_topk", shape, dtype, build, ulps(dtype, n, why), level,
                              rows=lambda a, kw: a[2].num_seqs, take=take,
                              row_slice=lambda o, a, kw, n: o[: _end(a[2], n)], cost=cost,
                              notes="top-k lists hold -1 and, for early prefill tokens, entries not yet closed"))
    return out


# ------------------------------------------------------------------------------------------- attn.compress

_COMPRESS = [
    # label, seqs, ratio, overlap (CSA), D, rotary dim, BS, level, padded; padded: the rows a captured step passes,
    # the closing rows and then -1 up to the model's host-known bound (closing_row_bound): zero entries
    ("CSA", [(39, 1), (0, 24), (50, 6)], 4, True, 64, 16, 16, "quick", False),
    ("HCA", [(47, 1), (0, 40), (20, 29)], 16, False, 64, 16, 32, "quick", False),
    ("CSA D=512", [(255, 1), (0, 130), (64, 64)], 4, True, 512, 64, 64, "full", False),
    ("CSA indexer keys D=128", [(127, 1), (3, 61), (0, 8)], 4, True, 128, 64, 32, "full", False),
    ("HCA m=128 D=512", [(127, 1), (0, 300), (200, 184)], 128, False, 512, 64, 256, "full", False),
    ("CSA padded decode", [(c, 1) for c in (3, 10, 7, 14, 0, 31)], 4, True, 64, 16, 16, "quick", True),
    ("HCA padded", [(47, 1), (0, 40), (20, 29)], 16, False, 64, 16, 32, "quick", True),
]


def _real(rows: torch.Tensor, end: int) -> torch.Tensor:
    """The rows of the first sequences (flat rows below ``end``), padding left out."""
    return rows[(rows >= 0) & (rows < end)]


@cases_for("attn.compress")
def attn_compress() -> list[OpCase]:
    out = []
    for label, seqs, m, overlap, d, r, bs, level, padded in _COMPRESS:
        for dtype in ("float32", "bfloat16"):
            def build(seed, seqs=seqs, m=m, overlap=overlap, d=d, r=r, bs=bs, dtype=dtype, padded=padded):
                g = gen(seed)
                dt = DTYPES[dtype]
                c = 2 * d if overlap else d
                specs = [KVGroupSpec("state", "sliding", (0,), (2, c), dt, window=2 * m if overlap else m),
                         KVGroupSpec("comp", "compressed", (0,), (d,), dt, tokens_per_slot=m)]
                nb, batches = paged_step(g, specs, bs, seqs)
                state = random_cache(g, specs[0], nb, bs)  # [NB, BS, 2, C]: kv | gate per token
                rows = torch.nonzero(batches["comp"].slot_mapping >= 0).flatten()  # tokens closing a window
                if padded:
                    n = closing_row_bound(sum(nn for _, nn in seqs), len(seqs), m)
                    rows = torch.cat((rows, rows.new_full((n - rows.numel(),), -1)))
                bias = randn(g, m, c, scale=0.5)
                weight = 1.0 + randn(g, d, dtype=dt, scale=0.1)
                top = max(cc + nn for cc, nn in seqs)
                p = CompressParams(m, overlap, RopeParams(r, "interleaved", "tail"), eps=1e-6)
                return (state, batches["state"], rows, bias, weight, cos_sin_table(top, r, 160000.0), p), {}

            def take(a, kw, n):
                return (a[0], first_seqs(a[1], n), _real(a[2], _end(a[1], n)), *a[3:]), kw

            def row_slice(o, a, kw, n):
                return o[: _real(a[2], _end(a[1], n)).numel()]

            def cost(a, kw, m=m, overlap=overlap):
                win = (2 if overlap else 1) * m
                c = a[0].shape[-1]
                return 4.0 * a[2].numel() * win * c, a[2].numel() * win * 2 * c * a[0].element_size()

            why = ("per-channel softmax pooling over the window in fp32, the pooled entry rounded to the state dtype, "
                   "an RMSNorm and a rotation each rounded once (a fused kernel may skip the two inner roundings)"
                   if dtype != "float32" else
                   "per-channel softmax over <= 2m tokens, an RMSNorm over D and a rotation, in another order")
            tol = ulps(dtype, 8 if dtype != "float32" else 64, why)
            kind = "CSA overlap" if overlap else "HCA"
            shape = f"{label} {_label(seqs)} m={m} {kind} D={d} R={r} BS={bs}"
            out.append(OpCase("attn.compress", shape, dtype, build, tol, level, rows=lambda a, kw: a[1].num_seqs,
                              take=take, row_slice=row_slice, cost=cost))
    return out


# ------------------------------------------------------------------------------------------- indexer.scores

def _split_masked(scores: torch.Tensor):
    """(scores with -inf set to 0, the -inf mask): -inf marks entries a token may not select; the mask must
    match exactly, the finite scores within tolerance (NaN or +inf stay and fail)."""
    masked = scores == float("-inf")
    return torch.where(masked, torch.zeros_like(scores), scores), masked


_INDEXER = [
    # seqs, Hi, Di, ratio, BS, pad, level; pad: extra -1 columns in the block table, as a captured decode graph's table
    # padded to max_model_len has: the scores are block_table.shape[1] * BS wide, -inf past every sequence
    ([(39, 1), (0, 24), (50, 6)], 4, 32, 4, 16, 0, "quick"),
    ([(100, 1), (7, 1), (0, 64)], 8, 64, 4, 32, 3, "quick"),
    ([(1000, 1), (0, 300), (256, 128)], 64, 128, 4, 256, 0, "full"),
    ([(2047, 1), (511, 1), (12, 1), (4095, 1)], 16, 128, 4, 64, 2, "full"),
]


@cases_for("indexer.scores")
def indexer_scores() -> list[OpCase]:
    out = []
    for seqs, hi, di, m, bs, pad, level in _INDEXER:
        for dtype in ("float32", "bfloat16"):
            def build(seed, seqs=seqs, hi=hi, di=di, m=m, bs=bs, pad=pad, dtype=dtype):
                g = gen(seed)
                dt = DTYPES[dtype]
                spec = KVGroupSpec("index", "compressed", (0,), (di,), dt, tokens_per_slot=m)
                nb, batches = paged_step(g, [spec], bs, seqs)
                batch = batches["index"]
                if pad:
                    bt = batch.block_table
                    batch = replace(batch, block_table=torch.cat((bt, bt.new_full((bt.shape[0], pad), -1)), dim=1))
                t = int(batch.positions.shape[0])
                q, w = randn(g, t, hi, di, dtype=dt), randn(g, t, hi, dtype=dt)
                return (q, random_cache(g, spec, nb, bs), batch, w, IndexerParams(di ** -0.5, hi ** -0.5)), {}

            def take(a, kw, n):
                e = _end(a[2], n)
                return (a[0][:e], a[1], first_seqs(a[2], n), a[3][:e], a[4]), kw

            def row_slice(o, a, kw, n):
                return tuple(x[: _end(a[2], n)] for x in o)  # the first n sequences keep the table's width

            def cost(a, kw):
                q, b = a[0], a[2]
                pairs = sum(int(b.seq_lens[i]) * (_end(b, i + 1) - _end(b, i)) for i in range(b.num_seqs))
                keys = int(b.seq_lens.sum()) * q.shape[2] * q.element_size()
                width = b.block_table.shape[1] * a[1].shape[1]  # every column is written, -inf or not
                return 2.0 * pairs * q.shape[1] * (q.shape[2] + 1), keys + nbytes(q) + 4.0 * q.shape[0] * width

            if dtype == "float32":
                tol = ulps(dtype, 4 * (di * hi) ** 0.5, "fp32 sums of Di products per head and Hi weighted heads in "
                           "another order (sqrt growth); -inf entries must match exactly")
            else:
                tol = ulps(dtype, 4, "bf16 inputs are exact in fp32, but a kernel may round relu(q.k) per head to the "
                           "input dtype before the weighted head sum (one bf16 rounding per term); -inf exact")
            shape = f"{_label(seqs)} Hi={hi} Di={di} m={m} BS={bs}" + (f" table+{pad}" if pad else "")
            out.append(OpCase("indexer.scores", shape, dtype, build, tol, level, canon=_split_masked,
                              rows=lambda a, kw: a[2].num_seqs, take=take, row_slice=row_slice, cost=cost))
    return out
