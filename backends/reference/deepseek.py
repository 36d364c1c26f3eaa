"""Reference DeepSeek-V4 attention ops over the paged cache: ``attn.compress``, ``indexer.scores``,
``attn.sparse_topk`` (signatures in :mod:`inferhal.core.ops.vocabulary`).

Compressed groups index entries, not tokens: entry ``e`` of a sequence covers tokens ``[e*m, (e+1)*m)``
(CSA pools ``[(e-1)*m, (e+1)*m)``), is written by token ``(e+1)*m - 1`` and is visible to a query at
position ``t`` iff ``e < (t + 1) // m``.

Every op works on all rows at once: each row gathers the slots it reads (its window, its chosen entries)
through its sequence's row of the padded block table, with a mask for the ones it may not see; masked
keys get zero weight exactly, so this is the per-sequence formula, batched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferhal.backends.reference import kv_records
from inferhal.backends.reference.attention import attend_chunked, attend_gathered, gather_slots, token_seqs
from inferhal.backends.reference.elementwise import norm_rms, rope_apply
from inferhal.core.ops.params import AttnBatch, AttnParams, CompressParams, IndexerParams, RmsNormParams


def read(entries: torch.Tensor, fmt) -> torch.Tensor:
    """Gathered cache entries as fp32 values: records of ``fmt`` decoded (zero records, i.e. entries a row
    may not see, decode to zeros), or the values themselves when ``fmt`` is None."""
    return entries.float() if fmt is None else kv_records.decode(entries, fmt)


def attn_compress(state_cache: torch.Tensor, batch: AttnBatch, rows: torch.Tensor, position_bias: torch.Tensor,
                  norm_weight: torch.Tensor, cos_sin: torch.Tensor, p: CompressParams) -> torch.Tensor:
    # state_cache: [NB, BS, 2, C] (kv | gate per token); rows: [N] flat rows that close a window, -1 = padding
    # (a zero entry, its position unchecked) -> [N, D]
    m = p.ratio
    c = state_cache.shape[-1]
    d = c // 2 if p.overlap else c
    if rows.numel() == 0:
        return state_cache.new_zeros((0, d))
    pad = rows < 0  # [N]
    rows = rows.long().clamp(min=0)  # a padding row stands at row 0, reads nothing and is zeroed at the end
    seq = token_seqs(batch.query_start_loc, batch.positions.shape[0])[rows]  # [N]
    pos = batch.positions[rows].long()  # [N]
    bad = ((pos + 1) % m != 0) & ~pad
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"attn.compress: row {int(rows[i])} at position {int(pos[i])} does not close a window of {m}")
    e = torch.where(pad, 0, (pos + 1) // m - 1)  # [N] entry each row closes
    span = 2 if p.overlap else 1  # CSA pools the previous window too
    tok = (e + 1 - span)[:, None] * m + torch.arange(span * m, device=pos.device)  # [N, span*m] pooled tokens
    valid = tok >= 0  # entry 0 of CSA has no previous window
    reads = valid & ~pad[:, None]  # a padding row reads nothing (its state gathers as zeros)
    st = gather_slots(state_cache, batch.block_table, seq[:, None], tok, reads).float()  # [N, span*m, 2, C]
    kv, gate = st[:, :, 0], st[:, :, 1] + position_bias.float().repeat(span, 1)  # [N, span*m, C]
    if p.overlap:  # the previous window gives its first half of the channels, this window its second
        own = (torch.arange(2 * m, device=pos.device) >= m)[None, :, None]  # [1, 2m, 1]
        kv = torch.where(own, kv[..., d:], kv[..., :d])  # [N, 2m, D]
        gate = torch.where(own, gate[..., d:], gate[..., :d])
    gate = gate.masked_fill(~valid[..., None], float("-inf"))
    w = torch.softmax(gate, dim=1)  # per channel, over the window's tokens
    x = (kv * w).sum(dim=1).to(state_cache.dtype)  # [N, D]
    x = norm_rms(x, norm_weight, RmsNormParams(eps=p.eps))
    return rope_apply(x[:, None], e * m, cos_sin, p.rope)[:, 0].masked_fill(pad[:, None], 0)


def indexer_scores(q: torch.Tensor, key_cache: torch.Tensor, batch: AttnBatch, weights: torch.Tensor,
                   p: IndexerParams, *, fixed_order: bool = False) -> torch.Tensor:
    # q: [T, Hi, Di]; key_cache: [NB, BS, Di]; weights: [T, Hi] -> scores [T, S] fp32, S = the block table's
    # reach (block_table.shape[1] * BS, known from shapes on the host); -inf past each token's visible entries.
    # fixed_order (batch-invariant mode): the Di-sums as elementwise products reduced over the last dim,
    # whose order depends on Di only; the einsum's BLAS kernel depends on the batch-wide width S.
    t = q.shape[0]
    width = batch.block_table.shape[1] * key_cache.shape[1]
    if t == 0 or width == 0 or batch.num_seqs == 0:
        return torch.full((t, width), float("-inf"), device=q.device)
    seq = token_seqs(batch.query_start_loc, t)  # [T]
    cols = torch.arange(width, device=q.device)
    n = torch.minimum((batch.positions.long() + 1) // batch.tokens_per_slot, batch.seq_lens.long()[seq])
    visible = cols[None, :] < n[:, None]  # [T, S]: closed for the token and inside its sequence
    keys = read(gather_slots(key_cache, batch.block_table, seq[:, None], cols[None, :], visible), p.key_format)
    if fixed_order:
        dots = F.relu((q.float()[:, :, None, :] * keys[:, None, :, :]).sum(dim=-1)) * p.scale  # [T, Hi, S]
    else:
        dots = F.relu(torch.einsum("thd,tsd->ths", q.float(), keys)) * p.scale  # [T, Hi, S]
    sc = (dots * (weights.float() * p.weight_scale)[:, :, None]).sum(dim=1)  # [T, S]
    return sc.masked_fill(~visible, float("-inf"))


def attn_sparse_topk(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, comp_cache: torch.Tensor | None,
                     comp_batch: AttnBatch | None, topk_idx: torch.Tensor | None, p: AttnParams,
                     sinks: torch.Tensor | None = None, *, fixed_order: bool = False) -> torch.Tensor:
    # q: [T, H, D]; kv_cache: [NB, BS, D] shared latent K = V; comp_cache: [NB', BS', D]; topk_idx: [T, K]
    # fixed_order (batch-invariant mode): each row's visible keys first, at places that depend on the row alone
    # (its window, then its entries ascending), then the masked ones, attended by attend_chunked: a top-k row
    # padded wider with -1 (a CUDA graph's HCA row spans max_model_len // ratio entries, an eager step's only
    # the batch's context) gives bitwise the same output. The default sorts -1 first and attends over the
    # whole width at once, so its last bits follow the width.
    t = q.shape[0]
    if t == 0:
        return q.new_zeros(0, q.shape[1], q.shape[2])
    seq = token_seqs(batch.query_start_loc, t)  # [T]
    qpos = batch.positions.long()  # [T]
    # window keys: the p.window positions ending at each query (all of 0..qpos when window == 0)
    w = p.window if p.window > 0 else int(qpos.max()) + 1
    if fixed_order and p.window == 0:  # every key up to the query, ascending: the batch's longest pads the end
        kpos = torch.arange(w, device=q.device)[None, :].expand(t, w)
        mask = kpos <= qpos[:, None]
    else:
        kpos = qpos[:, None] - (w - 1) + torch.arange(w, device=q.device)  # [T, W]
        mask = kpos >= 0
    keys = read(gather_slots(kv_cache, batch.block_table, seq[:, None], kpos, mask), p.kv_format)  # [T, W, D]
    if comp_batch is not None and topk_idx is not None and topk_idx.shape[1] > 0:
        n_c = comp_batch.seq_lens.long()[seq]  # [T] entries of each query's sequence
        visible = (qpos + 1) // comp_batch.tokens_per_slot  # [T]
        idx = topk_idx.long()
        ok = (idx >= 0) & (idx < n_c[:, None]) & (idx < visible[:, None])
        if fixed_order:  # the entries ascending, the others last
            last = torch.iinfo(idx.dtype).max
            idx = torch.sort(torch.where(ok, idx, last), dim=1).values
            idx = torch.where(idx == last, -1, idx)
        else:
            idx = torch.sort(torch.where(ok, idx, -1), dim=1).values  # [T, K]; a repeated entry counts once
        pick = idx >= 0
        pick[:, 1:] &= idx[:, 1:] != idx[:, :-1]
        comp = read(gather_slots(comp_cache, comp_batch.block_table, seq[:, None], idx, pick), p.kv_format)
        keys = torch.cat((keys, comp), dim=1)
        mask = torch.cat((mask, pick), dim=1)
    kv = keys[:, :, None]  # [T, S, 1, D]
    if fixed_order:
        return attend_chunked(q, kv, kv, mask, p, sinks)
    return attend_gathered(q, kv, kv, mask, p, sinks)


OPS = {
    "attn.compress": attn_compress,
    "indexer.scores": indexer_scores,
    "attn.sparse_topk": attn_sparse_topk,
}
