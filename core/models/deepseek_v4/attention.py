"""DeepSeek-V4 hybrid attention of one layer, on op IDs over the paged KV groups of :mod:`.kv`.

Per layer: low-rank Q (``q_a`` → RMSNorm → ``q_b`` → per-head unweighted RMSNorm), one latent KV head
(K = V, RMSNorm), interleaved partial RoPE on the last ``rope_dim`` channels (``main`` table on sliding
layers, the YaRN ``compress`` table on CSA/HCA layers); the latent goes into ``swa``. CSA/HCA layers
also push their compressor state, close windows into compressed entries (``attn.compress``) and, for
CSA, let the lightning indexer choose ``index_topk`` entries. A layer that shares another's compressed KV
(``kv_sources``, V4.1's cross-layer sharing) writes none: it reads the source layer's entries and indexer
keys, choosing among them with its own indexer query. One softmax with the learned sinks covers
window and compressed keys (``attn.sparse_topk``); the output is de-rotated (inverse RoPE at the query
position) and projected through the grouped low-rank ``o_a`` (per group) and ``o_b``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from inferhal.core.models.deepseek_v4.config import CSA, SLIDING
from inferhal.core.ops.params import AttnParams, CompressParams, IndexerParams, RopeParams

if TYPE_CHECKING:
    from inferhal.core.models.base import ForwardBatch, KVCache
    from inferhal.core.models.deepseek_v4.model import DeepseekV4ForCausalLM


def all_visible(positions: torch.Tensor, ratio: int, top: int | None = None) -> torch.Tensor:
    """HCA: every causally closed entry of each token, ``[T, (top + 1) // ratio]`` logical indices, -1 padded.
    ``top``: the step's largest position as the host knows it, or an upper bound (a step never takes the
    width from a device read); None (callers outside a step): read from ``positions``."""
    vis = (positions.long() + 1) // ratio
    if top is None:
        top = int(positions.max()) if positions.numel() else -1
    width = max(top + 1, 0) // ratio
    idx = torch.arange(width, device=positions.device)[None, :].expand(positions.shape[0], width)
    return torch.where(idx < vis[:, None], idx, torch.full_like(idx, -1))


def closing_row_bound(num_tokens: int, num_seqs: int, ratio: int) -> int:
    """The most rows a step of ``num_tokens`` tokens over ``num_seqs`` sequences can close, from shapes alone:
    a sequence's ``n`` new tokens hold at most ``ceil(n / ratio)`` multiples of ``ratio``, and the sum of
    ``ceil(n_i / ratio)`` over ``sum(n_i) = T`` is at most ``(T + B (ratio - 1)) // ratio``; every closing
    row is a token, so at most ``T`` (a decode step's ``B`` tokens close at most ``B``)."""
    return min(num_tokens, (num_tokens + num_seqs * (ratio - 1)) // ratio)


def closing_rows(slots: torch.Tensor, batch: "ForwardBatch", ratio: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows, slots)``: the flat rows whose token closes a window (``slots >= 0``), in order, and their
    compressed slots; None when the step closes none. The count is a host number: with the host's plan
    (``batch.seqs``) exactly, per sequence the multiples of ``ratio`` in ``(max(num_computed, write_from),
    num_computed + num_new]``; without it (a captured graph, which must hold for every replay)
    :func:`closing_row_bound` of the step's shapes, the rows past the device's count -1 with slot -1
    (``attn.compress`` gives a -1 row a zero entry, ``kv.write`` skips slot -1). The rows are found on the
    device (the k-th closing row is where the running count of closing rows reaches k): no host read."""
    t = slots.shape[0]
    if batch.seqs is None:
        n = closing_row_bound(t, batch.query_start_loc.shape[0] - 1, ratio)
    else:
        n = sum(max(0, (s.num_computed + s.num_new) // ratio - max(s.num_computed, s.write_from) // ratio)
                for s in batch.seqs)
    if n == 0:
        return None
    seen = torch.cumsum((slots >= 0).to(torch.int64), 0)  # [T] closing rows up to each row
    rows = torch.searchsorted(seen, torch.arange(1, n + 1, device=slots.device))  # [n]; T past the count
    real = rows < t
    rows = torch.where(real, rows, -1)
    return rows, torch.where(real, slots[rows.clamp(max=t - 1)], -1)


def compress(m: "DeepseekV4ForCausalLM", prefix: str, layer: int, group: str, ratio: int, overlap: bool,
             x: torch.Tensor, batch: "ForwardBatch", kv: "KVCache", cos_sin: torch.Tensor) -> None:
    """Write this step's compressor state for ``group`` and every entry the step's tokens close."""
    ops, w = m.ops, m.weights
    state = torch.stack((ops["linear"](x, w[prefix + "kv_proj.weight"]),
                         ops["linear"](x, w[prefix + "gate_proj.weight"])), dim=1)  # [T, 2, C]
    sb = batch.attn[group + "_state"]
    scache = kv.layer_cache(group + "_state", layer)
    ops["kv.write"](state, scache, sb.slot_mapping, m.kv_write_p)
    cb = batch.attn[group]
    closing = closing_rows(cb.slot_mapping, batch, ratio)
    if closing is None:
        return
    rows, slots = closing
    p = CompressParams(ratio, overlap, m.rope_p, m.cfg.rms_eps)
    entries = ops["attn.compress"](scache, sb, rows, w[prefix + "position_bias"], w[prefix + "kv_norm.weight"],
                                   cos_sin, p)  # [N, D]
    role = "index" if group == "csa_index" else "main"
    ops["kv.write"](entries, kv.layer_cache(group, layer), slots, m.kv_record_p[role])


def attention(m: "DeepseekV4ForCausalLM", pre: str, layer: int, x: torch.Tensor, batch: "ForwardBatch",
              kv: "KVCache") -> torch.Tensor:
    """x: [T, D] (after input_layernorm) → [T, D]."""
    cfg, ops, w = m.cfg, m.ops, m.weights
    t, h, hd = x.shape[0], cfg.num_heads, cfg.head_dim
    a = pre + "self_attn."
    lt = cfg.layer_type(layer)
    pos = batch.positions
    top = batch.max_position(m.max_model_len - 1)  # from the host's plan, or the model's bound (no device read)
    cs = (m.rope_main if lt == SLIDING else m.rope_compress).get(top)
    rp = m.rope_p

    qr = ops["norm.rms"](ops["linear"](x, w[a + "q_a_proj.weight"]), w[a + "q_a_norm.weight"], m.norm_p)
    q = ops["norm.rms"](ops["linear"](qr, w[a + "q_b_proj.weight"]).view(t, h, hd), None, m.norm_p)
    q = ops["rope.apply"](q, pos, cs, rp)  # [T, H, hd]
    lat = ops["norm.rms"](ops["linear"](x, w[a + "kv_proj.weight"]), w[a + "kv_norm.weight"], m.norm_p)
    lat = ops["rope.apply"](lat[:, None], pos, cs, rp)[:, 0]  # [T, hd]
    swa = batch.attn["swa"]
    cache = kv.layer_cache("swa", layer)
    ops["kv.write"](lat, cache, swa.slot_mapping, m.kv_record_p["main"])

    comp_cache = comp_batch = topk = None
    if lt != SLIDING:
        ratio = cfg.ratio(layer)
        group = "csa" if lt == CSA else "hca"
        c = a + "compressor."
        src = cfg.kv_source(layer)  # a layer sharing another's compressed KV writes none and reads the source's
        if src == layer:
            compress(m, c, layer, group, ratio, lt == CSA, x, batch, kv, cs)
        comp_batch, comp_cache = batch.attn[group], kv.layer_cache(group, src)
        if lt == CSA:
            if src == layer:
                compress(m, c + "indexer.", layer, "csa_index", ratio, True, x, batch, kv, cs)
            hi, di = cfg.index_n_heads, cfg.index_head_dim  # the layer's own indexer query selects among them
            iq = ops["linear"](qr, w[c + "indexer.q_b_proj.weight"]).view(t, hi, di)
            iq = ops["rope.apply"](iq, pos, cs, rp)
            iw = ops["linear"](x, w[c + "indexer.scorer.weights_proj.weight"])  # [T, Hi]
            scores = ops["indexer.scores"](iq, kv.layer_cache("csa_index", src), batch.attn["csa_index"], iw,
                                           IndexerParams(di ** -0.5, hi ** -0.5, m.kv_formats["index"]))
            # scores span the block table's reach (a shape, so a captured step keeps it), -inf past each token's
            # closed entries: valid_len stops top-k reading those columns
            topk = ops["topk.select"](scores, cfg.index_topk, (pos.long() + 1) // ratio)
        else:
            topk = all_visible(pos, ratio, top)

    p = AttnParams(scale=hd ** -0.5, num_kv_heads=1, window=cfg.sliding_window, shared_kv=True,
                   kv_format=m.kv_formats["main"])
    o = ops["attn.sparse_topk"](q, cache, swa, comp_cache, comp_batch, topk, p, w[a + "sinks"])
    o = ops["rope.apply"](o, pos, cs, RopeParams(rp.rotary_dim, rp.style, rp.placement, inverse=True))
    og = o.reshape(t, cfg.o_groups, h * hd // cfg.o_groups)
    parts = [ops["linear"](og[:, g], wa) for g, wa in enumerate(m.o_a_groups[pre])]
    return ops["linear"](torch.cat(parts, dim=-1), w[a + "o_b_proj.weight"])
