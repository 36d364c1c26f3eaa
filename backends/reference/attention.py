"""Reference attention ops over the paged KV layout (see AttnBatch in inferhal.core.ops.params)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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


def slot_index(block_size: int, block_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    """Where :func:`gather_slots` reads: ``(flat, keep, shape)``, ``flat`` the row of each entry in the
    cache flattened to ``[blocks * block_size, *slot]``, ``keep`` the valid entries (None: all), ``shape``
    the broadcast shape of ``seq``/``pos``/``valid``. A valid position on a block that is not allocated
    (-1 or past the table) raises IndexError."""
    width = block_table.shape[1]
    seq, pos, valid = torch.broadcast_tensors(seq.long(), pos.long(), valid)
    logical = pos.div(block_size, rounding_mode="floor")
    phys = block_table[seq, logical.clamp(0, max(width - 1, 0))].long()
    missing = valid & ((logical >= width) | (phys < 0))
    if bool(missing.any()):
        i = tuple(int(j) for j in torch.nonzero(missing)[0])
        raise IndexError(f"KV position {int(pos[i])} of sequence {int(seq[i])} reaches a block that is not allocated "
                         f"(-1 in the block table)")
    flat = (phys * block_size + pos % block_size).reshape(-1)
    if bool(valid.all()):
        return flat, None, tuple(pos.shape)
    keep = valid.reshape(-1).nonzero().flatten()
    return flat[keep], keep, tuple(pos.shape)


def gather_rows(cache: torch.Tensor, flat: torch.Tensor, keep: torch.Tensor | None,
                shape: tuple[int, ...]) -> torch.Tensor:
    """The entries :func:`slot_index` located, zero where not valid: ``[*shape, *slot]``.

    Row gathers over the flattened cache (``index_select``, ``index_copy_``) run ~10x faster on the CPU
    than 2-D advanced indexing plus a ``masked_fill`` (0.1 vs 1.0 ms per layer for 32 decode rows of
    Gemma 3); invalid entries are zero whatever the cache holds there."""
    slot = cache.shape[2:]
    rows = cache.reshape(-1, *slot)
    if keep is None:
        return rows.index_select(0, flat).view(*shape, *slot)
    out = rows.new_zeros(math.prod(shape), *slot)
    out.index_copy_(0, keep, rows.index_select(0, flat))
    return out.view(*shape, *slot)


def gather_slots(cache: torch.Tensor, block_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
    """Batched :func:`gather_pages`: entry ``pos`` of sequence ``seq`` (broadcast together, e.g. ``[T, S]``)
    through the padded ``block_table [B, M]``; zero where not ``valid`` → ``[*pos.shape, *slot]``.
    A valid position on a block that is not allocated (-1 or past the table) raises IndexError."""
    return gather_rows(cache, *slot_index(cache.shape[1], block_table, seq, pos, valid))


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
                    sinks: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`attend` with keys of each query's own: q: [T, H, D], k: [T, S, Hk, D], v: [T, S, Hk, Dv],
    mask: [T, S] bool (True = visible) -> [T, H, Dv]. Query head ``h`` reads KV head ``h // (H // Hk)``.
    ``bias [T, 1, S]`` (0 where visible, -inf where not), when the caller has it and every row sees at
    least one key, replaces ``mask`` and the softmax runs as one fused op. Products run as batched
    matmuls over strided views (no copies of the keys), the scaling and masking in place."""
    t, h, d = q.shape
    s, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    qg = q.float().view(t, hk, h // hk, d)  # [T, Hk, rep, D]
    logits = torch.matmul(qg, k.float().permute(0, 2, 3, 1)).view(t, h, s).mul_(p.scale)  # [T, H, S]
    if p.softcap > 0:
        logits = logits.div_(p.softcap).tanh_().mul_(p.softcap)
    sink = None if sinks is None else sinks.float().view(1, h, 1)
    if bias is None:
        probs = _sink_softmax(logits, mask[:, None], sink)
    elif sink is None:
        probs = torch.softmax(logits.add_(bias), dim=-1)
    else:
        probs = torch.softmax(torch.cat((logits.add_(bias), sink.expand(t, h, 1)), dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs.reshape(t, hk, h // hk, s), v.float().permute(0, 2, 1, 3))  # [T, Hk, rep, Dv]
    return out.reshape(t, h, dv).to(q.dtype)


#: keys per chunk of :func:`attend_chunked`'s sums
KEY_CHUNK = 64


def attend_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, p: AttnParams,
                   sinks: torch.Tensor | None, chunk: int = KEY_CHUNK) -> torch.Tensor:
    """:func:`attend_gathered` (without ``bias``) whose result does not depend on how many masked keys trail
    each row's last visible one: a row padded wider (a CUDA graph's fixed-width top-k row, a batch's widest)
    gives bitwise the same output. Every sum runs over fixed ``chunk``-key slices at fixed places: the logits
    and each slice's ``P.V`` are matrix products of one shape whatever ``S``, and the slices' sums meet in a
    pairwise tree (slices 2i and 2i + 1 at each level, an odd last one beside an empty one). A masked key
    has probability exactly 0, so a slice of masked keys adds exact zeros, the max (exact in any order)
    ignores it, and the tree over more slices is the one over fewer plus exact zeros. Normalised once at
    the end, ``sum(P V) / (sum(P) + sink)``: within fp32 rounding of :func:`attend_gathered`, not bitwise.
    About twice its time at V4's decode shapes on the CPU, which is why only the batch-invariant mode runs it."""
    t, h, d = q.shape
    s, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    rep = h // hk
    n = max(1, -(-s // chunk))  # slices
    pad = n * chunk - s
    k = F.pad(k.float(), (0, 0, 0, 0, 0, pad)).view(t, n, chunk, hk, d)
    v = F.pad(v.float(), (0, 0, 0, 0, 0, pad)).view(t, n, chunk, hk, dv)
    mask = F.pad(mask, (0, pad), value=False).view(t, n, 1, 1, chunk)
    qg = q.float().view(t, 1, hk, rep, d).expand(t, n, hk, rep, d)
    logits = torch.matmul(qg, k.permute(0, 1, 3, 4, 2)).mul_(p.scale)  # [T, n, Hk, rep, C]
    if p.softcap > 0:
        logits = logits.div_(p.softcap).tanh_().mul_(p.softcap)
    logits = logits.masked_fill_(~mask, float("-inf"))
    top = logits.amax(dim=(1, 4))  # [T, Hk, rep]
    sink = None if sinks is None else sinks.float().view(1, hk, rep)
    if sink is not None:
        top = torch.maximum(top, sink)
    top = top.clamp(min=-1e30)  # a row that sees nothing and has no sink: zeros, as _sink_softmax gives
    probs = torch.exp(logits - top[:, None, :, :, None])  # [T, n, Hk, rep, C]
    den = probs.sum(dim=-1)  # [T, n, Hk, rep]
    num = torch.matmul(probs, v.permute(0, 1, 3, 2, 4))  # [T, n, Hk, rep, Dv]
    while num.shape[1] > 1:  # the pairwise tree: slices (2i, 2i + 1) at each level
        if num.shape[1] % 2:
            den, num = F.pad(den, (0, 0, 0, 0, 0, 1)), F.pad(num, (0, 0, 0, 0, 0, 0, 0, 1))  # an empty slice
        den, num = den[:, 0::2] + den[:, 1::2], num[:, 0::2] + num[:, 1::2]
    den = den[:, 0] + (0.0 if sink is None else torch.exp(sink - top))
    out = num[:, 0] / den.clamp(min=1e-30)[..., None]  # [T, Hk, rep, Dv]
    return out.reshape(t, h, dv).to(q.dtype)


def attn_paged(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, p: AttnParams,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    # q: [T, H, D]; kv_cache: [NB, BS, 2, Hk, D] or [NB, BS, Hk, D] when p.shared_kv
    # Rows are attended together over one padded gather of their visible keys (every row of the batch when
    # that gather is small, else the decode rows); the other rows (long prefill chunks) one sequence at a
    # time, so no [T, S] key tensor of a long prompt is ever built.
    t = q.shape[0]
    plan = _plan(batch, p.window, kv_cache)
    dv = q.shape[2] if p.shared_kv else kv_cache.shape[-1]
    if plan.all_rows:
        kv = plan.gather(kv_cache)  # [T, S, *slot] fp32
        k, v = (kv, kv) if p.shared_kv else (kv[:, :, 0], kv[:, :, 1])
        return attend_gathered(q, k, v, plan.mask, p, sinks, plan.bias)
    out = q.new_empty(t, q.shape[1], dv)
    if plan.rows.numel():
        kv = plan.gather(kv_cache)  # [N, S, *slot] fp32
        k, v = (kv, kv) if p.shared_kv else (kv[:, :, 0], kv[:, :, 1])
        out[plan.rows] = attend_gathered(q[plan.rows], k, v, plan.mask, p, sinks, plan.bias)
    for b, s, e, ctx in plan.chunks:
        out[s:e] = _attend_span(q, kv_cache, batch, p, sinks, b, s, e, ctx)
    return out


def _attend_span(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, p: AttnParams,
                 sinks: torch.Tensor | None, b: int, s: int, e: int, ctx: int) -> torch.Tensor:
    """Rows ``s:e`` of sequence ``b`` (context ``ctx`` keys) over their sequence's own pages, masked causally
    and by the window → ``[e - s, H, Dv]``."""
    qpos = batch.positions[s:e].long()
    first = 0 if p.window == 0 else max(0, int(qpos.min()) - p.window + 1)
    kv = gather_pages(kv_cache, batch.block_table[b], first, ctx)
    k, v = (kv, kv) if p.shared_kv else (kv[:, 0], kv[:, 1])
    kpos = torch.arange(first, ctx, device=q.device)
    mask = kpos[None, :] <= qpos[:, None]
    if p.window > 0:
        mask &= kpos[None, :] > qpos[:, None] - p.window
    return attend(q[s:e], k, v, mask, p, sinks)


def attn_paged_rowwise(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttnBatch, p: AttnParams,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``attn.paged`` in batch-invariant mode: each query row over exactly its own visible keys, one row at a
    time. :func:`attn_paged` attends rows together over keys padded to the batch's longest span (and long
    chunks over the chunk's span), so the length of a row's reductions, and with it their last bits, depends
    on its batch and its chunk; here every product and softmax of a row has the same shape and data whatever
    else runs (slow: a Python loop over rows, which is the price of the mode)."""
    dv = q.shape[2] if p.shared_kv else kv_cache.shape[-1]
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    qsl = batch.query_start_loc.tolist()
    pos = batch.positions.tolist()
    for b in range(len(qsl) - 1):
        for i in range(qsl[b], qsl[b + 1]):  # a span of one row, whose context ends at its own position
            out[i : i + 1] = _attend_span(q, kv_cache, batch, p, sinks, b, i, i + 1, pos[i] + 1)
    return out


GATHER_BYTES = 64 << 20  # every row of a batch goes into the padded gather when its fp32 keys fit in this


class _DecodePlan:
    """Which rows of a batch are attended over one padded gather and where their visible keys sit, worked
    out once per batch, window and cache geometry and reused by every layer of the step (it was a third of
    the decode attention time, repeated for each of Gemma 3's 18 layers).

    A row at position ``qpos`` sees the keys ``[first, qpos]`` (``first`` clipped by the window), padded to
    the batch's longest span. The padding points at the row's own key (written before attention runs), so
    the gather reads no slot the row may not see, needs no zero fill, and the additive ``bias`` (-inf on
    padding) gives those entries exactly zero weight. The gather lands in buffers kept by the plan, so the
    layers of a step reuse the same pages. Every row goes in when the gathered fp32 keys fit in
    :data:`GATHER_BYTES` (decode steps, and prefill of short prompts); otherwise only the single-token rows,
    and each longer chunk runs on its own."""

    def __init__(self, batch: AttnBatch, window: int, kv_cache: torch.Tensor) -> None:
        qsl = batch.query_start_loc.long()
        t = int(qsl[-1])
        qlen = qsl[1:] - qsl[:-1]
        seq_of = torch.repeat_interleave(torch.arange(qlen.numel(), device=qsl.device), qlen)  # [T]
        qpos = batch.positions[:t].long()
        first = torch.zeros_like(qpos) if window == 0 else (qpos - window + 1).clamp(min=0)
        span = int((qpos - first).max()) + 1 if t else 0
        entry = 4 * math.prod(kv_cache.shape[2:])
        self.all_rows = t > 0 and t * span * entry <= GATHER_BYTES
        if self.all_rows:
            self.chunks = []
            self.rows = torch.arange(t, device=qsl.device)
        else:
            lens = batch.seq_lens.tolist()
            self.chunks = [(b, int(qsl[b]), int(qsl[b + 1]), lens[b])
                           for b in torch.nonzero(qlen > 1).flatten().tolist()]
            self.rows = qsl[torch.nonzero(qlen == 1).flatten()]
        self._buf: dict = {}
        if not self.rows.numel():
            return
        qpos, first = qpos[self.rows], first[self.rows]
        span = int((qpos - first).max()) + 1
        pos = first[:, None] + torch.arange(span, device=qpos.device)[None, :]  # [N, S]
        self.mask = pos <= qpos[:, None]
        self.bias = torch.zeros(self.mask.shape, device=pos.device).masked_fill_(~self.mask, float("-inf"))[:, None]
        seqs = seq_of[self.rows][:, None]
        self.index = slot_index(kv_cache.shape[1], batch.block_table, seqs, torch.minimum(pos, qpos[:, None]),
                                torch.ones_like(self.mask))

    def gather(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The rows' keys (and values) in fp32: ``[N, S, *slot]``, in a buffer the next layer reuses."""
        flat, _, shape = self.index
        slot = tuple(kv_cache.shape[2:])
        rows = kv_cache.reshape(-1, *slot)
        key = (kv_cache.dtype, kv_cache.device, slot)
        if key not in self._buf:
            raw = None if kv_cache.dtype == torch.float32 else rows.new_empty(flat.numel(), *slot)
            self._buf[key] = (raw, torch.empty(flat.numel(), *slot, device=kv_cache.device))
        raw, f32 = self._buf[key]
        if raw is None:
            torch.index_select(rows, 0, flat, out=f32)
        else:
            f32.copy_(torch.index_select(rows, 0, flat, out=raw))
        return f32.view(*shape, *slot)


_PLANS: dict = {}  # key -> (batch, plan): the latest step's batches (one per KV layer group)
_MAX_PLANS = 8


def _plan(batch: AttnBatch, window: int, kv_cache: torch.Tensor) -> _DecodePlan:
    # Keyed by the batch object (held, so its id is not reused while cached) and its tensors' version
    # counters, so a batch whose tensors were changed in place is planned afresh.
    tensors = (batch.query_start_loc, batch.seq_lens, batch.positions, batch.block_table)
    try:
        key = (id(batch), window, kv_cache.shape[1], *(t._version for t in tensors))
    except RuntimeError:  # inference-mode tensors keep no version counter: plan every call
        return _DecodePlan(batch, window, kv_cache)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is batch:
        return hit[1]
    if len(_PLANS) >= _MAX_PLANS:  # a new step: the previous step's batches are done with
        _PLANS.clear()
    plan = _DecodePlan(batch, window, kv_cache)
    _PLANS[key] = (batch, plan)
    return plan


OPS = {
    "attn.paged": attn_paged,
}
