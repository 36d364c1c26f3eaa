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
    logits = logits.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(h, 1, 1).expand(h, logits.shape[1], 1)
        logits = torch.cat((logits, sink), dim=-1)
    m = logits.amax(dim=-1, keepdim=True).clamp(min=-1e30)
    probs = torch.exp(logits - m)
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("hts,shd->thd", probs, vf).to(q.dtype)


def attn_paged(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, p: AttnParams,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [T, H, D]; kv_cache: [NB, BS, 2, Hk, D] or [NB, BS, Hk, D] when p.shared_kv
    out = []
    qsl = batch.query_start_loc.tolist()
    lens = batch.seq_lens.tolist()
    for b in range(batch.num_seqs):
        s, e, ctx = qsl[b], qsl[b + 1], lens[b]
        if e == s:
            continue
        qpos = batch.positions[s:e].long()
        first = 0 if p.window == 0 else max(0, int(qpos.min()) - p.window + 1)
        kv = gather_pages(kv_cache, batch.block_table[b], first, ctx)
        if p.shared_kv:
            k = v = kv
        else:
            k, v = kv[:, 0], kv[:, 1]
        kpos = torch.arange(first, ctx, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if p.window > 0:
            mask &= kpos[None, :] > qpos[:, None] - p.window
        out.append(attend(q[s:e], k, v, mask, p, sinks))
    if not out:
        return q.new_zeros(0, q.shape[1], q.shape[2])
    return torch.cat(out, dim=0)


OPS = {
    "attn.paged": attn_paged,
}
