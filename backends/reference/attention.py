"""Reference attention ops over the paged KV layout (see AttnBatch in inferhal.core.ops.params)."""

from __future__ import annotations

import torch

from inferhal.core.ops.params import AttnBatch, AttnParams


def gather_pages(cache: torch.Tensor, block_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Entries ``start..end-1`` of one sequence from its block-table row: ``[end-start, *slot]``."""
    bs = cache.shape[1]
    pos = torch.arange(start, end, device=cache.device)
    blocks = block_row[pos // bs].long()
    if bool((blocks < 0).any()):
        raise IndexError(f"KV positions {start}..{end - 1} reach a block that is not allocated (-1 in the block table)")
    return cache[blocks, pos % bs]


def token_seqs(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sequence index of each of the ``num_tokens`` flat rows: ``[T]`` int64."""
    qsl = query_start_loc.long()
    return torch.searchsorted(qsl[1:], torch.arange(num_tokens, device=qsl.device), right=True)


def gather_slots(cache: torch.Tensor, block_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
    """Batched :func:`gather_pages`: entry ``pos`` of sequence ``seq`` (broadcast together, e.g. ``[T, S]``)
    through the padded ``block_table [B, M]``; zero where not ``valid`` → ``[*pos.shape, *slot]``.
    A valid position on a block that is not allocated (-1 or past the table) raises IndexError."""
    bs, width = cache.shape[1], block_table.shape[1]
    seq, pos, valid = torch.broadcast_tensors(seq.long(), pos.long(), valid)
    logical = pos.div(bs, rounding_mode="floor")
    phys = block_table[seq, logical.clamp(0, max(width - 1, 0))].long()
    missing = valid & ((logical >= width) | (phys < 0))
    if bool(missing.any()):
        i = tuple(int(j) for j in torch.nonzero(missing)[0])
        raise IndexError(f"KV position {int(pos[i])} of sequence {int(seq[i])} reaches a block that is not allocated "
                         f"(-1 in the block table)")
    vals = cache[torch.where(valid, phys, 0), torch.where(valid, pos % bs, 0)]  # [*pos.shape, *slot]
    return vals.masked_fill(~valid.view(*valid.shape, *(1,) * (vals.dim() - valid.dim())), 0)


def _sink_softmax(logits: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of visible (``mask``) logits, with an optional extra sink logit per row
    (``sink`` broadcast to ``logits[..., :1]``) that takes probability mass and is dropped."""
    logits = logits.masked_fill(~mask, float("-inf"))
    if sink is not None:
        logits = torch.cat((logits, sink.expand(*logits.shape[:-1], 1)), dim=-1)
    m = logits.amax(dim=-1, keepdim=True).clamp(min=-1e30)
    probs = torch.exp(logits - m)
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    return probs[..., :-1] if sink is not None else probs


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, p: AttnParams,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """q: [Tq, H, D], k: [S, Hk, D], v: [S, Hk, Dv], mask: [Tq, S] bool (True = visible) -> [Tq, H, Dv]."""
    h, hk = q.shape[1], k.shape[1]
    rep = h // hk
    kf = k.float().repeat_interleave(rep, dim=1)  # [S, H, D]
    vf = v.float().repeat_interleave(rep, dim=1)
    logits = torch.einsum("thd,shd->hts", q.float(), kf) * p.scale  # [H, Tq, S]
    if p.softcap > 0:
        logits = p.softcap * torch.tanh(logits / p.softcap)
    probs = _sink_softmax(logits, mask[None], None if sinks is None else sinks.float().view(h, 1, 1))
    return torch.einsum("hts,shd->thd", probs, vf).to(q.dtype)


def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, p: AttnParams,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """:func:`attend` with keys of each query's own: q: [T, H, D], k: [T, S, Hk, D], v: [T, S, Hk, Dv],
    mask: [T, S] bool (True = visible) -> [T, H, Dv]. Query head ``h`` reads KV head ``h // (H // Hk)``."""
    t, h, d = q.shape
    s, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    qg = q.float().view(t, hk, h // hk, d)  # [T, Hk, rep, D]
    logits = torch.einsum("tgrd,tsgd->tgrs", qg, k.float()).reshape(t, h, s) * p.scale  # [T, H, S]
    if p.softcap > 0:
        logits = p.softcap * torch.tanh(logits / p.softcap)
    probs = _sink_softmax(logits, mask[:, None], None if sinks is None else sinks.float().view(1, h, 1))
    out = torch.einsum("tgrs,tsgd->tgrd", probs.view(t, hk, h // hk, s), v.float())  # [T, Hk, rep, Dv]
    return out.reshape(t, h, dv).to(q.dtype)


def attn_paged(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, p: AttnParams,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [T, H, D]; kv_cache: [NB, BS, 2, Hk, D] or [NB, BS, Hk, D] when p.shared_kv
    # Sequences with one new token (decode) are attended together over one padded gather; the others
    # (prefill chunks) one sequence at a time, so no [T, S] key tensor of a long prompt is ever built.
    t = q.shape[0]
    qsl = batch.query_start_loc.long()
    qlen = qsl[1:] - qsl[:-1]
    dv = q.shape[2] if p.shared_kv else kv_cache.shape[-1]
    out = q.new_empty(t, q.shape[1], dv)
    one = torch.nonzero(qlen == 1).flatten()
    if one.numel():
        rows = qsl[one]
        out[rows] = _attend_decode(q[rows], kv_cache, batch, one, batch.positions[rows].long(), p, sinks)
    lens = batch.seq_lens.tolist()
    for b in torch.nonzero(qlen > 1).flatten().tolist():
        s, e, ctx = int(qsl[b]), int(qsl[b + 1]), lens[b]
        qpos = batch.positions[s:e].long()
        first = 0 if p.window == 0 else max(0, int(qpos.min()) - p.window + 1)
        kv = gather_pages(kv_cache, batch.block_table[b], first, ctx)
        k, v = (kv, kv) if p.shared_kv else (kv[:, 0], kv[:, 1])
        kpos = torch.arange(first, ctx, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if p.window > 0:
            mask &= kpos[None, :] > qpos[:, None] - p.window
        out[s:e] = attend(q[s:e], k, v, mask, p, sinks)
    return out


def _attend_decode(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, seqs: torch.Tensor,
                   qpos: torch.Tensor, p: AttnParams, sinks: torch.Tensor | None) -> torch.Tensor:
    """One query per sequence ``seqs`` (q: [N, H, D], at ``qpos [N]``) over its visible keys, gathered
    into ``[N, S, ...]`` with S the longest visible span (window-clipped) and masked past each one's."""
    ctx = batch.seq_lens.long()[seqs]
    first = torch.zeros_like(qpos) if p.window == 0 else (qpos - p.window + 1).clamp(min=0)
    span = int((ctx - first).max())
    pos = first[:, None] + torch.arange(span, device=q.device)[None, :]  # [N, S]
    mask = (pos < ctx[:, None]) & (pos <= qpos[:, None])
    kv = gather_slots(kv_cache, batch.block_table, seqs[:, None], pos, mask)  # [N, S, *slot]
    k, v = (kv, kv) if p.shared_kv else (kv[:, :, 0], kv[:, :, 1])
    return attend_gathered(q, k, v, mask, p, sinks)


OPS = {
    "attn.paged": attn_paged,
}
