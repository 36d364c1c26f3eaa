"""Reference DeepSeek-V4 attention ops over the paged cache: ``attn.compress``, ``indexer.scores``,
``attn.sparse_topk`` (signatures in :mod:`inferhal.core.ops.vocabulary`).

Compressed groups index entries, not tokens: entry ``e`` of a sequence covers tokens ``[e*m, (e+1)*m)``
(CSA pools ``[(e-1)*m, (e+1)*m)``), is written by token ``(e+1)*m - 1`` and is visible to a query at
position ``t`` iff ``e < (t + 1) // m``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferhal.backends.reference.attention import attend, gather_pages
from inferhal.core.ops.params import AttnBatch, AttnParams, CompressParams, IndexerParams, RmsNormParams


def _seq_of(batch: AttnBatch, rows: torch.Tensor) -> torch.Tensor:
    """Sequence index of each flat row."""
    return torch.searchsorted(batch.query_start_loc[1:].long().to(rows.device), rows.long(), right=True)


def attn_compress(state_cache: torch.Tensor, batch: AttnBatch, rows: torch.Tensor, position_bias: torch.Tensor,
                  norm_weight: torch.Tensor, cos_sin: torch.Tensor, p: CompressParams) -> torch.Tensor:
    # state_cache: [NB, BS, 2, C] (kv | gate per token); rows: [N] flat rows that close a window -> [N, D]
    from inferhal.backends.reference.ops import norm_rms, rope_apply  # ops.py collects this module's OPS

    m = p.ratio
    c = state_cache.shape[-1]
    d = c // 2 if p.overlap else c
    if rows.numel() == 0:
        return state_cache.new_zeros((0, d))
    bias = position_bias.float()  # [m, C]
    seqs = _seq_of(batch, rows).tolist()
    pooled, starts = [], []
    for row, b in zip(rows.tolist(), seqs):
        pos = int(batch.positions[row])
        if (pos + 1) % m:
            raise ValueError(f"attn.compress: row {row} at position {pos} does not close a window of {m}")
        e = (pos + 1) // m - 1
        cur = gather_pages(state_cache, batch.block_table[b], e * m, (e + 1) * m).float()  # [m, 2, C]
        kv, gate = cur[:, 0], cur[:, 1] + bias
        if p.overlap:
            kv, gate = kv[:, d:], gate[:, d:]  # this window's own half
            if e > 0:
                prev = gather_pages(state_cache, batch.block_table[b], (e - 1) * m, e * m).float()
                kv = torch.cat((prev[:, 0, :d], kv))
                gate = torch.cat((prev[:, 1, :d] + bias[:, :d], gate))
        w = torch.softmax(gate, dim=0)  # per channel, over the window's tokens
        pooled.append((kv * w).sum(dim=0))
        starts.append(e * m)
    x = torch.stack(pooled).to(state_cache.dtype)  # [N, D]
    x = norm_rms(x, norm_weight, RmsNormParams(eps=p.eps))
    pos_t = torch.tensor(starts, dtype=torch.long, device=x.device)
    return rope_apply(x[:, None], pos_t, cos_sin, p.rope)[:, 0]


def indexer_scores(q: torch.Tensor, key_cache: torch.Tensor, batch: AttnBatch, weights: torch.Tensor,
                   p: IndexerParams) -> torch.Tensor:
    # q: [T, Hi, Di]; key_cache: [NB, BS, Di]; weights: [T, Hi] -> scores [T, S] fp32, S = max entries
    m = batch.tokens_per_slot
    lens = batch.seq_lens.tolist()
    qsl = batch.query_start_loc.tolist()
    out = torch.full((q.shape[0], max(lens, default=0)), float("-inf"), device=q.device)
    for b, n in enumerate(lens):
        s, e = qsl[b], qsl[b + 1]
        if n == 0 or e == s:
            continue
        keys = gather_pages(key_cache, batch.block_table[b], 0, n).float()  # [n, Di]
        dots = F.relu(torch.einsum("thd,sd->ths", q[s:e].float(), keys)) * p.scale
        sc = (dots * (weights[s:e].float() * p.weight_scale)[:, :, None]).sum(dim=1)  # [Tq, n]
        visible = (batch.positions[s:e].long() + 1) // m
        cols = torch.arange(n, device=q.device)
        out[s:e, :n] = sc.masked_fill(cols[None, :] >= visible[:, None], float("-inf"))
    return out


def attn_sparse_topk(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, comp_cache: torch.Tensor | None,
                     comp_batch: AttnBatch | None, topk_idx: torch.Tensor | None, p: AttnParams,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [T, H, D]; kv_cache: [NB, BS, D] shared latent K = V; comp_cache: [NB', BS', D]; topk_idx: [T, K]
    out = []
    qsl = batch.query_start_loc.tolist()
    lens = batch.seq_lens.tolist()
    for b in range(batch.num_seqs):
        s, e, ctx = qsl[b], qsl[b + 1], lens[b]
        if e == s:
            continue
        qpos = batch.positions[s:e].long()
        first = 0 if p.window == 0 else max(0, int(qpos.min()) - p.window + 1)
        keys = gather_pages(kv_cache, batch.block_table[b], first, ctx)  # [Sw, D]
        kpos = torch.arange(first, ctx, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if p.window > 0:
            mask &= kpos[None, :] > qpos[:, None] - p.window
        n_c = int(comp_batch.seq_lens[b]) if comp_batch is not None and topk_idx is not None else 0
        if n_c > 0:
            comp = gather_pages(comp_cache, comp_batch.block_table[b], 0, n_c)  # [n_c, D]
            idx = topk_idx[s:e].long()
            idx = torch.where((idx >= 0) & (idx < n_c), idx, torch.full_like(idx, n_c))
            pick = torch.zeros((e - s, n_c + 1), dtype=torch.bool, device=q.device)
            pick.scatter_(1, idx, True)
            visible = (qpos + 1) // comp_batch.tokens_per_slot
            pick = pick[:, :n_c] & (torch.arange(n_c, device=q.device)[None, :] < visible[:, None])
            keys = torch.cat((keys, comp))
            mask = torch.cat((mask, pick), dim=1)
        kv = keys[:, None]  # [S, 1, D]
        out.append(attend(q[s:e], kv, kv, mask, p, sinks))
    if not out:
        return q.new_zeros(0, q.shape[1], q.shape[2])
    return torch.cat(out, dim=0)


OPS = {
    "attn.compress": attn_compress,
    "indexer.scores": indexer_scores,
    "attn.sparse_topk": attn_sparse_topk,
}
